"""A window's decode tiles run `tile_batch` at a time (`VideoVAE.tile_batch`; the engine sets 4 on CUDA), and the
tiles dealt out to several ranks (`VideoVAE.decode_tiles(order=...)`, what `parallel.ranks` runs): the same frames as
one tile at a time, on the tiny VAE at one CPU thread (a CPU GEMM split over threads may round a row differently with
the row count). The CUDA tier holds the released decoder's shapes to the same (tests/test_gpu_decode.py)."""

from __future__ import annotations

import pytest
import torch

from h3serve.accel.vae import set_tile_batch
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
        return vae.decode(z, **kwargs)
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
    one = vae.decode_window(z[:, :, :3])
    set_tile_batch(vae, 4)
    try:
        torch.testing.assert_close(vae.decode_window(z[:, :, :3]), one, rtol=0, atol=0)
    finally:
        set_tile_batch(vae, 1)


@pytest.mark.parametrize("ranks", [2, 3])
def test_tiles_dealt_to_ranks_in_batches_are_the_decode_of_one(vae, ranks):
    """Each rank asks for its own tiles (u % ranks == rank) in order, as `parallel.ranks` deals them; a rank's batch
    never takes another rank's tile, nor a tile of the next window."""
    z = latents(12)  # 2 windows x 6 tiles
    set_tile_batch(vae, 1)
    windows, grid, whole = vae.decode_tiles(z)
    count = windows * grid.count
    reference = [whole(u) for u in range(count)]
    set_tile_batch(vae, 4)
    try:
        own = [vae.decode_tiles(z, order=range(r, count, ranks))[2] for r in range(ranks)]
        for u in range(count):
            torch.testing.assert_close(own[u % ranks](u), reference[u], rtol=0, atol=0)

        def deal(tiles_for, n):  # a TileRunner dealing over `ranks` in one process, as `_lead_tiles` does
            mine = [tiles_for(range(r, n, ranks)) for r in range(ranks)]
            return (mine[u % ranks](u) for u in range(n))

        torch.testing.assert_close(vae.decode(z, run_tiles=deal), decoded(vae, z, 1), rtol=0, atol=0)
    finally:
        set_tile_batch(vae, 1)


def calls(vae, z, batch: int, order=None) -> tuple[list[int], int]:
    """The batch size of each decoder call, and the tiles whose latents went through `post_quant_conv`, when every
    tile of `order` is asked for in order."""
    sizes, tiles = [], []
    hooks = [
        vae.decoder.register_forward_pre_hook(lambda _m, args: sizes.append(args[0].shape[0])),
        vae.post_quant_conv.register_forward_pre_hook(lambda _m, args: tiles.append(args[0])),
    ]
    set_tile_batch(vae, batch)
    try:
        windows, grid, tile = vae.decode_tiles(z, order=order)
        for u in range(windows * grid.count) if order is None else order:
            tile(u)
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
    assert calls(vae, z, 2, order=range(0, 12, 2)) == ([2, 1] * 2, 6)  # rank 0 of 2: (0, 2), 4 | (6, 8), 10
    assert calls(vae, z, 2, order=range(1, 12, 3)) == ([2] * 2, 4)  # rank 1 of 3: (1, 4) | (7, 10)


def test_tiles_asked_out_of_their_order_are_refused(vae):
    z = latents(7)
    set_tile_batch(vae, 4)
    try:
        _, _, tile = vae.decode_tiles(z, order=[0, 2, 4])
        tile(0)
        with pytest.raises(ValueError, match="tile 4 asked out of `order`: the next is 2"):
            tile(4)
        tile(2), tile(4)
        with pytest.raises(ValueError, match="tile 5 asked out of `order`: every tile of it was asked"):
            tile(5)
        _, _, tile = vae.decode_tiles(z)
        with pytest.raises(ValueError, match="tile 1 asked out of `order`: the next is 0"):
            tile(1)
        with pytest.raises(ValueError, match=r"order must name distinct tiles of 0\.\.5: \[-1, 6\] are not"):
            vae.decode_tiles(z, order=[0, 6, -1])
        with pytest.raises(ValueError, match=r"order must name distinct tiles of 0\.\.5: \[1\] are not"):
            vae.decode_tiles(z, order=[1, 2, 1])
    finally:
        set_tile_batch(vae, 1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_a_tile_batch_that_is_not_a_positive_int_is_refused(vae, bad):
    with pytest.raises(ValueError, match="tile_batch must be a positive int"):
        set_tile_batch(vae, bad)
