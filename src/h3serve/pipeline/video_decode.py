"""The video decode's schedule: which latents each temporal window reads, which process decodes each of its spatial
tiles, and how the decoded tiles become frames. The model (`model.video_vae`) decodes one batch of tiles
(`VideoVAE.decode_tiles`) and owns the geometry of its recipe (windows, tiles, blends); everything around that call is
here, so that a new way to decode (another split, a stream) changes this file only.

    DecodePlan     one decode's windows x tiles, as data, and which rank decodes each tile (`owner`)
    TileSource     where a decode's raw tiles come from: this process (`LOCAL_TILES`) or the ranks of a split render
                   (`parallel.ranks`), every tile in order
    rank_tiles     one rank's tiles of a window, decoded `tile_batch` at a time
    decode         each window's tiles stitched, the windows cross-faded, the frames emitted in order
    decode_window  one window alone (what a preview decodes)

Windows (released recipe): `chunk + token_overlap` (5 + 2) latents each, `chunk` apart; each decodes to
`chunk * ratio` frames plus the overlap, whose first `frame_pre_padding` frames are dropped, and the last
`frame_overlap` frames of one window are cross-faded into the first of the next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from h3serve.model.video_vae import TileGrid, VideoVAE, blend, check_tile_batch


@dataclass(frozen=True)
class DecodePlan:
    """One decode's `windows` temporal windows, each cut into the same spatial tiles (`grid`), and the `ranks`
    processes the tiles are dealt to. Tile u is tile `u % grid.count` (row-major) of window `u // grid.count`; each
    is its own sequence through the decoder, so any process may decode any of them and its bits are the same."""

    windows: int
    grid: TileGrid
    pad: int  # copies of the last latent appended, to whole chunks (`VideoVAEConfig.decode_plan`)
    frames: int  # pixel frames the decode emits
    stride: int  # latents from one window's start to the next's (a chunk)
    reach: int  # latents each window reads (a chunk and the overlap)
    ranks: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"a decode is dealt to a positive number of ranks, got {self.ranks!r}")

    @classmethod
    def of(
        cls,
        vae: VideoVAE,
        z: torch.Tensor,
        *,
        tiled: bool | None = None,
        autocast_dtype: torch.dtype | None = None,
        ranks: int = 1,
    ) -> DecodePlan:
        """The plan of decoding latents `z` (B, C, T, h, w) with `vae`, checked; no copy of z."""
        vae.check_decode(z, autocast_dtype)
        cfg = vae.cfg
        pad, windows, frames = cfg.decode_plan(z.shape[2])
        grid = TileGrid.of(cfg, z.shape[-2], z.shape[-1], cfg.decoder_tiling if tiled is None else tiled)
        chunk = cfg.tokens_chunk_size
        return cls(windows, grid, pad, frames, chunk, chunk + cfg.token_overlap, ranks)

    @property
    def count(self) -> int:
        """Tiles in all (every window's)."""
        return self.windows * self.grid.count

    def owner(self, u: int) -> int:
        """The rank that decodes tile u. Dealt round-robin over every window's tiles in order, so each rank holds a
        near-even share of every window and rank 0 stitches a window while the others decode their next tiles."""
        return u % self.ranks

    def tiles_of(self, rank: int, window: int | None = None) -> list[int]:
        """The tiles rank `rank` decodes (of one `window`, or of every one), in order."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not one of the plan's {self.ranks}")
        every = range(self.count) if window is None else self.window_tiles(window)
        return [u for u in every if self.owner(u) == rank]

    def window_tiles(self, window: int) -> range:
        """Window `window`'s tiles, in order."""
        return range(window * self.grid.count, (window + 1) * self.grid.count)

    def padded(self, z: torch.Tensor) -> torch.Tensor:
        """The latents the windows read: `z` in float32, with `pad` copies of its last latent. Encoding dropped
        `token_drop` latents from the end, so decoding pretends they are there (and cuts their frames off again)."""
        z = z.float()
        if not self.pad:
            return z
        return torch.cat([z, z[:, :, -1:].expand(-1, -1, self.pad, -1, -1)], dim=2)

    def window_latents(self, z: torch.Tensor, window: int) -> torch.Tensor:
        """Window `window`'s latents of the padded latents `z` (`padded`), a view."""
        start = window * self.stride
        return z[:, :, start : start + self.reach]


class TileSource(Protocol):
    """Where a decode's raw tiles come from: float32 pixels (B, 3, 4T, th, tw) each, as `VideoVAE.decode_tiles`
    returns them, every tile of the plan in order (window by window, row-major), each window's only when the
    previous window's were taken (`decode` stitches one window at a time)."""

    @property
    def ranks(self) -> int:
        """How many processes decode the tiles (the plan's `ranks`)."""
        ...

    def tiles(
        self, vae: VideoVAE, z: torch.Tensor, plan: DecodePlan, autocast_dtype: torch.dtype | None
    ) -> Iterator[torch.Tensor]: ...


@dataclass(frozen=True)
class LocalTiles:
    """Every tile decoded in this process, `tile_batch` at a time (`rank_tiles`)."""

    @property
    def ranks(self) -> int:
        return 1

    def tiles(
        self, vae: VideoVAE, z: torch.Tensor, plan: DecodePlan, autocast_dtype: torch.dtype | None
    ) -> Iterator[torch.Tensor]:
        z = plan.padded(z)
        for window in range(plan.windows):
            for _, tile in rank_tiles(vae, z, plan, window, 0, autocast_dtype):
                yield tile
                del tile  # let go before the next batch decodes (a tile is a view of its whole batch)


LOCAL_TILES = LocalTiles()


def rank_tiles(
    vae: VideoVAE, z: torch.Tensor, plan: DecodePlan, window: int, rank: int, autocast_dtype: torch.dtype | None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Rank `rank`'s tiles of window `window` of `plan`, in order, each with its number u; `z`: the padded latents
    (`DecodePlan.padded`). `vae.tile_batch` of them go through the decoder as one batch, the ones left over one at a
    time, so a decode runs batches of exactly these two sizes (the ones the GPU tier holds bitwise); a batch is
    decoded when its first tile is asked for, and each tile is let go of as it is handed over, so a rank holds one
    batch of raw tiles at a time (a tile is a view of its batch: one kept reference keeps the whole batch)."""
    tiles = plan.tiles_of(rank, window)
    latents = plan.window_latents(z, window)
    for group in _batches(tiles, check_tile_batch(vae.tile_batch)):
        decoded = vae.decode_tiles(latents, plan.grid, [u % plan.grid.count for u in group], autocast_dtype)
        for u in group:
            yield u, decoded.pop(0)


def _batches(tiles: list[int], batch: int) -> Iterator[list[int]]:
    """`tiles` (of one window) as whole batches of `batch`, then the rest one at a time."""
    whole = len(tiles) - len(tiles) % batch
    for k in range(0, whole, batch):
        yield tiles[k : k + batch]
    for u in tiles[whole:]:
        yield [u]


@torch.no_grad()
def decode(
    vae: VideoVAE,
    z: torch.Tensor,
    *,
    tiled: bool | None = None,
    autocast_dtype: torch.dtype | None = None,
    source: TileSource = LOCAL_TILES,
    on_window: Callable[[int, int], None] | None = None,
    on_frames: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor | None:
    """Latents (B, C, T, h, w), *de-normalised*, -> pixels (B, 3, F, 16h, 16w) float32 in ImageNet space.

    The release decodes on the GPU under float16 autocast with float32 weights (`autocast_dtype=torch.float16`, which
    the engine's CUDA profile passes); the default, None, is a pure float32 decode. The windows' tiles come from
    `source` (default: decoded here); each window is stitched, its overlapping frames are linearly cross-faded with
    the previous window's, and the frames are written straight into the output. `on_window(done, total)` is called
    after each window (a caller may raise from it to stop the decode). `on_frames(pixels)`: each run of frames as it
    is final (after its cross-fade), (B, 3, n, H, W) float32, which it may change in place; the decode then holds one
    window at a time and returns None.
    """
    cfg = vae.cfg
    plan = DecodePlan.of(vae, z, tiled=tiled, autocast_dtype=autocast_dtype, ranks=source.ranks)
    tiles = iter(source.tiles(vae, z, plan, autocast_dtype))
    out = None
    if on_frames is None:
        out = z.new_empty(z.shape[0], cfg.out_channels, plan.frames, plan.grid.height, plan.grid.width)
    emit = _Emit(plan.frames, out, on_frames)
    span = cfg.tokens_chunk_size * cfg.temporal_ratio  # pixel frames per chunk before pre-padding is dropped
    carry: torch.Tensor | None = None  # the previous window's frames that overlap this window's first frames
    for i in range(plan.windows):
        part = plan.grid.stitch(tiles)  # this window's tiles, the next `grid.count` of them
        head = part[:, :, :span][:, :, cfg.frame_pre_padding :]
        after = part[:, :, span : 2 * span][:, :, cfg.frame_pre_padding :].clone() if cfg.token_drop > 0 else None
        if carry is not None:
            blend(carry, head, cfg.frame_overlap, dim=2)
        emit(head)
        carry = after
        del part, head
        if on_window is not None:
            on_window(i + 1, plan.windows)
    if carry is not None:
        emit(carry)
    assert emit.pos == plan.frames, (emit.pos, plan.frames)
    return out


class _Emit:
    """Where a decode's final frames go, in order: into `out`, or handed to `on_frames`; the frames past `frames`
    (those of the padding) are cut off."""

    def __init__(self, frames: int, out: torch.Tensor | None, on_frames: Callable[[torch.Tensor], None] | None):
        self.frames, self.out, self.on_frames, self.pos = frames, out, on_frames, 0

    def __call__(self, part: torch.Tensor) -> None:
        n = min(part.shape[2], self.frames - self.pos)
        if self.out is not None:
            self.out[:, :, self.pos : self.pos + n] = part[:, :, :n]
        elif self.on_frames is not None:
            self.on_frames(part[:, :, :n])
        self.pos += n


@torch.no_grad()
def decode_window(
    vae: VideoVAE, z: torch.Tensor, *, tiled: bool | None = None, autocast_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Latents (B, C, T, h, w), de-normalised, decoded as one window (no padding, no cross-fade) -> pixels
    (B, 3, 4T, 16h, 16w) float32, the first `frame_pre_padding` frames ahead of the first latent's: what `decode`
    runs per window (T = chunk + token_overlap); a preview runs it on a few latents."""
    vae.check_decode(z, autocast_dtype)
    cfg = vae.cfg
    grid = TileGrid.of(cfg, z.shape[-2], z.shape[-1], cfg.decoder_tiling if tiled is None else tiled)
    z = z.float()
    groups = _batches(list(range(grid.count)), check_tile_batch(vae.tile_batch))
    return grid.stitch(tile for ks in groups for tile in vae.decode_tiles(z, grid, ks, autocast_dtype))
