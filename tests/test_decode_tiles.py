"""A window's decode tiles run `tile_batch` at a time (`VideoVAE.tile_batch`; the engine sets 4 on CUDA), and the
tiles dealt out to several ranks (`DecodePlan.owner`, `rank_tiles`: what `parallel.ranks` runs): the same frames as
one tile at a time, on the tiny VAE at one CPU thread (a CPU GEMM split over threads may round a row differently with
the row count). The CUDA tier holds the released decoder's shapes to the same (tests/test_gpu_decode.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from h3serve.accel.vae import set_tile_batch
from h3serve.model.video_vae import TileGrid
from h3serve.pipeline.video_decode import DecodePlan, decode, decode_window, rank_tiles
from test_decode_exact import tiny_vae


@pytest.fixture(scope="module")
def vae():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_vae(seed=3)
    torch.set_num_threads(threads)


def latents(n: int) -> torch.Tensor:
    return torch.randn(1, 24, n, 7, 9, generator=torch.Generator().manual_seed(n))  # 28 x 36 px: 2 x 3 tiles of 16 px


def decoded(vae, z, batch: int, **kwargs) -> torch.Tensor:
    set_tile_batch(vae, batch)
    try:
        return decode(vae, z, **kwargs)
    finally:
        set_tile_batch(vae, 1)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 18])  # one window; three windows with cross-fades and a padded tail
def test_tiles_decoded_in_batches_are_the_tiles_decoded_alone(vae, autocast, n):
    z = latents(n)
    one = decoded(vae, z, 1, autocast_dtype=autocast)
    # 4 leaves a short batch at each window's end; 6 is a whole window; 20 is more than a window holds
    for batch in (2, 4, 6, 20):
        torch.testing.assert_close(decoded(vae, z, batch, autocast_dtype=autocast), one, rtol=0, atol=0)


def test_a_batch_of_several_videos_keeps_each_video_and_tile_in_its_place(vae):
    z = torch.cat([latents(7), latents(12)[:, :, :7]])
    one = decoded(vae, z, 1)
    torch.testing.assert_close(decoded(vae, z, 4), one, rtol=0, atol=0)
    # and each video alone decodes to its own frames
    torch.testing.assert_close(decoded(vae, z[1:], 4), one[1:], rtol=0, atol=0)


def test_a_preview_window_decodes_in_batches_too(vae):
    z = latents(7)
    set_tile_batch(vae, 1)
    one = decode_window(vae, z[:, :, :3])
    set_tile_batch(vae, 4)
    try:
        torch.testing.assert_close(decode_window(vae, z[:, :, :3]), one, rtol=0, atol=0)
    finally:
        set_tile_batch(vae, 1)


def tiles_of_rank(vae, z, plan: DecodePlan, rank: int) -> dict[int, torch.Tensor]:
    """Every tile rank `rank` decodes, by number, as `parallel.ranks` asks for them: window by window, in order."""
    padded = plan.padded(z)
    return {u: t for w in range(plan.windows) for u, t in rank_tiles(vae, padded, plan, w, rank, None)}


@dataclass(frozen=True)
class DealtHere:
    """A `TileSource` dealing the tiles over `ranks` in one process, as `parallel.ranks.DealtTiles` does over the
    wire: every rank's tiles of a window decoded by its own `rank_tiles`, taken by owner."""

    ranks: int

    def tiles(self, vae, z, plan: DecodePlan, autocast_dtype) -> Iterator[torch.Tensor]:
        padded = plan.padded(z)
        for window in range(plan.windows):
            own = [rank_tiles(vae, padded, plan, window, r, autocast_dtype) for r in range(self.ranks)]
            for u in plan.window_tiles(window):
                v, tile = next(own[plan.owner(u)])
                assert v == u
                yield tile


@pytest.mark.parametrize("ranks", [2, 3])
def test_tiles_dealt_to_ranks_in_batches_are_the_decode_of_one(vae, ranks):
    """Each rank decodes its own tiles (`DecodePlan.tiles_of`) in batches; a rank's batch never takes another rank's
    tile, nor a tile of the next window."""
    z = latents(12)  # 2 windows x 6 tiles
    set_tile_batch(vae, 1)
    reference = tiles_of_rank(vae, z, DecodePlan.of(vae, z), 0)
    assert sorted(reference) == list(range(12))
    set_tile_batch(vae, 4)
    try:
        plan = DecodePlan.of(vae, z, ranks=ranks)
        for rank in range(ranks):
            own = tiles_of_rank(vae, z, plan, rank)
            assert list(own) == plan.tiles_of(rank)
            for u, tile in own.items():
                torch.testing.assert_close(tile, reference[u], rtol=0, atol=0)
        torch.testing.assert_close(decode(vae, z, source=DealtHere(ranks)), decoded(vae, z, 1), rtol=0, atol=0)
    finally:
        set_tile_batch(vae, 1)


def calls(vae, z, batch: int, ranks: int = 1, rank: int = 0) -> tuple[list[int], int]:
    """The batch size of each decoder call, and the tiles whose latents went through `post_quant_conv`, when rank
    `rank` of `ranks` decodes its tiles."""
    sizes, tiles = [], []
    hooks = [
        vae.decoder.register_forward_pre_hook(lambda _m, args: sizes.append(args[0].shape[0])),
        vae.post_quant_conv.register_forward_pre_hook(lambda _m, args: tiles.append(args[0])),
    ]
    set_tile_batch(vae, batch)
    try:
        tiles_of_rank(vae, z, DecodePlan.of(vae, z, ranks=ranks), rank)
    finally:
        set_tile_batch(vae, 1)
        for hook in hooks:
            hook.remove()
    return sizes, len(tiles)


def test_only_whole_batches_run_and_each_tile_is_decoded_once(vae):
    """A window's tiles go `tile_batch` at a time and the ones left over one at a time (so a decode runs batches of
    two sizes only, each one the GPU tier holds); a rank's batches hold only its own tiles, of one window."""
    z = latents(12)  # 2 windows x 6 tiles
    assert calls(vae, z, 4) == ([4, 1, 1] * 2, 12)
    assert calls(vae, z, 6) == ([6] * 2, 12)
    assert calls(vae, z, 20) == ([1] * 12, 12)
    assert calls(vae, z, 2, ranks=2, rank=0) == ([2, 1] * 2, 6)  # rank 0 of 2: (0, 2), 4 | (6, 8), 10
    assert calls(vae, z, 2, ranks=3, rank=1) == ([2] * 2, 4)  # rank 1 of 3: (1, 4) | (7, 10)


@pytest.mark.parametrize("windows", [1, 2, 5])
@pytest.mark.parametrize("grid", [1, 2, 6, 7])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_the_ranks_share_every_tile_exactly_once_and_each_window_near_evenly(windows, grid, ranks):
    tiles = TileGrid(16, [0], [], [12 * j for j in range(grid)], [4] * (grid - 1), 1, 1, 16, 12 * grid + 4)  # 1 x grid
    plan = DecodePlan(windows, tiles, pad=0, frames=0, stride=5, reach=7, ranks=ranks)
    assert plan.count == windows * grid
    shares = [plan.tiles_of(rank) for rank in range(ranks)]
    assert Counter(u for share in shares for u in share) == Counter(range(plan.count))  # each tile once
    for rank, share in enumerate(shares):
        assert share == sorted(share) and all(plan.owner(u) == rank for u in share)
        assert share == [u for w in range(windows) for u in plan.tiles_of(rank, w)]
    for w in range(windows):
        sizes = [len(plan.tiles_of(rank, w)) for rank in range(ranks)]
        assert sum(sizes) == grid and max(sizes) - min(sizes) <= 1


def test_a_plan_refuses_a_rank_it_does_not_have(vae):
    plan = DecodePlan.of(vae, latents(7), ranks=2)
    with pytest.raises(ValueError, match="rank 2 is not one of the plan's 2"):
        plan.tiles_of(2)
    with pytest.raises(ValueError, match="rank -1 is not one of the plan's 2"):
        plan.tiles_of(-1)
    with pytest.raises(ValueError, match="a positive number of ranks, got 0"):
        DecodePlan.of(vae, latents(7), ranks=0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_a_tile_batch_that_is_not_a_positive_int_is_refused(vae, bad):
    with pytest.raises(ValueError, match="tile_batch must be a positive int"):
        set_tile_batch(vae, bad)


@pytest.mark.parametrize("batch", [2, 4])
def test_a_batch_of_raw_tiles_is_let_go_of_before_the_next_one_decodes(vae, monkeypatch, batch):
    """Memory: a decode holds one batch of raw tiles at a time. A tile is a view of its batch, so one reference kept
    past its stitch (a generator's loop variable, the batch's list) keeps the whole batch alive while the next one
    decodes: on the H100 that was +0.08 GiB of peak at the default request (bench/results, 2026-12-07 house round).
    Each call checks that every batch before it is gone; the decode is the same either way."""
    import gc
    import weakref

    earlier: list[weakref.ref] = []
    alive: list[int] = []
    decode_tiles = type(vae).decode_tiles

    def watched(self, *args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in earlier))
        tiles = decode_tiles(self, *args, **kwargs)
        earlier.append(weakref.ref(tiles[0]._base if tiles[0]._base is not None else tiles[0]))
        return tiles

    monkeypatch.setattr(type(vae), "decode_tiles", watched)
    z = latents(18)  # three windows x 6 tiles
    decoded(vae, z, batch)
    assert len(alive) > 3 and alive == [0] * len(alive), alive
