"""One rank's part of a render split over the GPUs (Ulysses sequence parallelism), as the engine's `Spread`.

- Text and keyframe encoding run on rank 0; their results are broadcast (`share`).
- The packed sequence is cut in contiguous row ranges, every row kind alike (`group.row_ranges`). A rank runs the
  DiT's blocks on its own rows only, given its slice of the RoPE table, tags and timestep indices and the local
  positions of its video, audio and text rows. The AdaLN tables and the timestep embedding are made on every rank;
  the text refiner runs on every rank (its input is the broadcast text states). The fp32 GEMMs outside the blocks
  keep the one-GPU call's shape: the input projections run over every row, the audio head over every audio row
  (gathered), the video head over an input shaped as all the video rows (the rank's in place): a GEMM's kernel is
  chosen by its shape, and a call on a rank's rows alone rounds differently.
- Around each main block's attention one all-to-all turns "my rows, all heads" into "all rows, my heads" for Q, K
  and V together, the profile's kernel runs unchanged on the local heads, and a second all-to-all brings the output
  back (`UlyssesAttention`). The block GEMMs give the same bits for a row block as inside the whole product
  (measured on the H200), and attention per head is the same computation (bench/split.py): eager renders are bit
  for bit the one-GPU render (docs/parallel.md).
- After each forward only the compact outputs are gathered (video patch channels per video row, and the audio rows'
  head inputs), so every rank steps the same full latents.
- The video decode's tiles are dealt out round-robin (`DecodePlan.owner`), sent to rank 0 and stitched and
  cross-faded there exactly as one GPU does (`DealtTiles`); the audio decode runs on rank 0.
- The step cache's measured change is summed over the ranks before it decides, so every rank skips the same
  forwards. A cancel is agreed at every check point (`AgreedContext`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from h3serve.config import NUM_MODALITIES
from h3serve.model.ops import AttentionKernel
from h3serve.model.video_vae import VideoVAE
from h3serve.parallel.group import Group, row_ranges
from h3serve.pipeline.context import ProgressCallback, RenderCancelled, RenderContext
from h3serve.pipeline.decode import decode_audio, decode_video, video_latents
from h3serve.pipeline.sampling import ModelFn, request_rows
from h3serve.pipeline.video_decode import DecodePlan, rank_tiles

Picks = list[tuple[torch.Tensor, torch.Tensor]]  # per rank: (which rows of a kind it holds, their local positions)


@dataclass(eq=False)
class Ranks:
    """This rank's side of every split stage. `sizes`: the current request's packed rows per rank (set by `bind`,
    read by each block's `UlyssesAttention`)."""

    group: Group
    sizes: list[int] = field(default_factory=list)

    @property
    def lead(self) -> bool:
        return self.group.lead

    @property
    def ranks(self) -> int:
        return self.group.size

    def install(self, engine: Any) -> None:
        """Split `engine`'s DiTs: every main block's attention all-to-all around its kernel, and every step cache's
        measured change summed over the ranks. Run once, after the profile was applied."""
        for dit in engine.components.dits.values():
            kernels = {block.attn.kernel for block in dit.blocks}
            if len(kernels) != 1:
                raise ValueError(f"the DiT's blocks run {len(kernels)} attention kernels; a split needs one")
            split = UlyssesAttention(kernels.pop(), self.group, self.sizes)  # one op, shared by the blocks
            for block in dit.blocks:
                block.attn.kernel = split
        for cache in engine.step_caches.values():
            cache.sum_over_ranks = self.group.all_sum

    # ---- Spread -------------------------------------------------------------------------------------------------
    def share(self, compute: Callable[[], Any]) -> Any:
        """Rank 0 computes, every rank gets the result; a failure on rank 0 is raised on every rank (the others
        would otherwise wait in the broadcast)."""
        if not self.lead:
            failed, value = self.group.broadcast_object(None)
            if failed:
                raise LeadFailed(value)
            return value
        try:
            value = compute()
        except Exception as err:
            self.group.broadcast_object((True, f"{type(err).__name__}: {err}"))
            raise
        return self.group.broadcast_object((False, value))[1]

    def bind(self, dit, layout, text_states, tables) -> ModelFn:
        g = self.group
        ranges = row_ranges(layout.token_tags.shape[0], g.size)
        self.sizes[:] = [end - start for start, end in ranges]
        start, end = ranges[g.rank]
        text, (cos, sin), device = request_rows(dit, layout, text_states)  # every rank: the same input, the same rows
        rope = (cos[start:end], sin[start:end])
        tags = layout.token_tags[start:end].to(device)
        video, audio, texts = (_picks(i, ranges, device) for i in (layout.video_indices, layout.audio_indices,
                                                                  layout.text_indices))  # fmt: skip
        (v_rows, v_at), (a_rows, a_at), (t_rows, t_at) = video[g.rank], audio[g.rank], texts[g.rank]
        text = text.index_select(0, t_rows)

        def model(video_in, audio_in, timesteps, timestep_indices, step):
            # The input projections over every row (the one-GPU call, a few small GEMMs), this rank's rows kept: a
            # GEMM of a handful of rows can round differently from the same rows inside a larger one.
            v, a = dit.embed(video_in, audio_in)
            x = dit.pack(end - start, v.index_select(0, v_rows), a.index_select(0, a_rows), text, v_at, a_at, t_at)
            temb = dit.time_embedder(timesteps)
            t_index = timestep_indices[start:end]
            x = dit.run_blocks(x, temb, t_index * NUM_MODALITIES + tags, rope, None if tables is None else tables[step])
            # The video head over a tensor shaped as the one-GPU call's input (every video row: this rank's in their
            # place, the others zero), so that cuBLAS picks the same kernel and each row gets the same bits (a call
            # on the rank's rows alone differed by 1.7e-5 at 4 ranks on the H200); the audio head over every audio
            # row, gathered first (a few hundred rows: the one-GPU call).
            h = dit.final_layer.hidden(x, temb, t_index)
            rows = h.new_zeros(video_in.shape[0], h.shape[1]).index_copy_(0, v_rows, h.index_select(0, v_at))
            v = self._gather(dit.final_layer.video_out(rows).index_select(0, v_rows), video, video_in.shape[0])
            return v, dit.final_layer.audio_out(self._gather(h.index_select(0, a_at), audio, audio_in.shape[0]))

        return model

    def decode_video(self, vae, video_rows, layout, autocast, on_window, on_frames=None) -> np.ndarray | None:
        # No `on_frames` here: a split render's frames do not stream (`Admission.frames_stream`, the engine's check);
        # the parent holds the sink and rank 0's frames reach it whole (`ParallelEngine`).
        tiles = DealtTiles(self.group)
        if self.lead:
            return self._agreed(lambda: decode_video(vae, video_rows, layout, autocast, on_window, source=tiles))
        z = video_latents(vae, video_rows, layout)
        tiles.send(vae, z, DecodePlan.of(vae, z, autocast_dtype=autocast, ranks=tiles.ranks), autocast, on_window)
        return self._agreed(None)

    def decode_audio(self, vae, audio_rows, layout) -> np.ndarray | None:
        return self._agreed(lambda: decode_audio(vae, audio_rows, layout) if self.lead else None)

    def _agreed(self, compute: Callable[[], Any] | None) -> Any:
        """Run rank 0's part of a stage (`compute`; None elsewhere) and agree on whether it failed, so that a
        failure there (non-finite pixels) ends the stage on every rank instead of leaving the others waiting."""
        try:
            value = compute() if compute is not None else None
        except Exception:
            self.group.agree(True)
            raise
        if self.group.agree(False):
            raise LeadFailed("rank 0 failed in this stage")
        return value

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _gather(self, local: torch.Tensor, picks: Picks, total: int) -> torch.Tensor:
        """Every rank's rows of one kind (`local`: this rank's, in its `picks` order), in the order of all of them."""
        width = local.shape[1]
        parts = self.group.all_gather(local.flatten(), [rows.numel() * width for rows, _ in picks])
        out = local.new_empty(total, width)
        for part, (rows, _) in zip(parts, picks, strict=True):
            out.index_copy_(0, rows, part.view(-1, width))
        return out


@dataclass(frozen=True)
class DealtTiles:
    """A video decode's tiles dealt over the group's ranks (`DecodePlan.owner`), each rank decoding its own
    `tile_batch` at a time (`rank_tiles`): rank 0 is the decode's `TileSource` (`tiles`), the others `send` theirs.
    Each tile is its own sequence through the decoder, so its bits are the same whichever rank decodes it, alone or
    in a batch (the kernels' batch invariance, tests/test_gpu_decode.py)."""

    group: Group

    @property
    def ranks(self) -> int:
        return self.group.size

    def tiles(
        self, vae: VideoVAE, z: torch.Tensor, plan: DecodePlan, autocast_dtype: torch.dtype | None
    ) -> Iterator[torch.Tensor]:
        """Rank 0's side: every tile of `plan` in order, its own decoded, the others' received from their owners."""
        g = self.group
        z = plan.padded(z)
        for window in range(plan.windows):
            own = rank_tiles(vae, z, plan, window, g.rank, autocast_dtype)
            for u in plan.window_tiles(window):
                owner = plan.owner(u)
                if owner == g.rank:
                    yield next(own)[1]
                else:
                    shape = g.recv(torch.empty(5, dtype=torch.int64, device=g.device), owner)
                    yield g.recv(torch.empty(tuple(shape.tolist()), dtype=torch.float32, device=g.device), owner)

    def send(
        self,
        vae: VideoVAE,
        z: torch.Tensor,
        plan: DecodePlan,
        autocast_dtype: torch.dtype | None,
        on_window: Callable[[int, int], None],
    ) -> None:
        """Another rank's side: its tiles of each window decoded and sent to rank 0 (shape, then pixels), then the
        same check point as rank 0's after the window (`on_window`, which may raise to cancel)."""
        g = self.group
        z = plan.padded(z)
        for window in range(plan.windows):
            for _, tile in rank_tiles(vae, z, plan, window, g.rank, autocast_dtype):
                g.send(torch.tensor(tile.shape, dtype=torch.int64, device=tile.device), 0)
                g.send(tile, 0)
                del tile  # let go before the next batch decodes (a tile is a view of its whole batch)
            on_window(window + 1, plan.windows)


def _picks(indices: torch.Tensor, ranges: list[tuple[int, int]], device: torch.device) -> Picks:
    """For each rank: the positions (among this kind's rows) of the rows it holds, and their local packed index."""
    out = []
    for start, end in ranges:
        rows = ((indices >= start) & (indices < end)).nonzero().flatten()
        out.append((rows.to(device), (indices[rows] - start).to(device)))
    return out


class UlyssesAttention:
    """An attention kernel over this rank's rows and every head: the rows of every rank for this rank's heads go
    through `inner` (the profile's kernel), and the result comes back to its rows. `sizes`: rows per rank (read at
    each call). It is a custom op of its own, so that a compiled block traces it as one opaque call: the
    collectives stay outside the compiled code, with no graph break and no guard on the sizes."""

    def __init__(self, inner: AttentionKernel, group: Group, sizes: list[int]):
        self.inner, self.group, self.sizes = inner, group, sizes
        name = f"h3serve_parallel::ulysses_attention_{id(self):x}"  # one op per instance (per DiT, per process)
        self.op = torch.library.custom_op(name, self._run, mutates_args=(), schema=SCHEMA)
        self.op.register_fake(_fake_ulysses)

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        return _ulysses(q, k, v, causal, self.inner, self.group, self.sizes)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        return self.op(q, k, v, causal)


SCHEMA = "(Tensor q, Tensor k, Tensor v, bool causal) -> Tensor"


def _ulysses(q, k, v, causal: bool, inner: AttentionKernel, group: Group, sizes: list[int]) -> torch.Tensor:
    # q, k, v: (1, H, s, D), this rank's s rows, any strides. The wire is row-major, as the kernel reads it: rank j
    # is sent (s, 3, hn, D) (this rank's rows; Q, K and V of j's heads), so what arrives from the ranks in order is
    # (S, 3, hn, D) with no copy, and Q, K and V are strided views of it, (S, hn, D) rows as in the one-GPU call
    # (whose Q, K and V are views of the QKV projection). The output comes back the same way, row-major.
    n = group.size
    _, heads, s, d = q.shape
    hn = heads // n
    send = q.new_empty(n, s, 3, hn, d)
    for i, t in enumerate((q, k, v)):  # (H, s, D) -> (n, s, hn, D): one pass each, D-contiguous runs of hn * D
        send[:, :, i].copy_(t[0].unflatten(0, (n, hn)).permute(0, 2, 1, 3))
    counts = [m * 3 * hn * d for m in sizes]
    recv = send.new_empty(sum(counts))
    group.all_to_all(recv, send.flatten(), counts, [s * 3 * hn * d] * n)
    qkv = recv.view(-1, 3, hn, d).permute(1, 2, 0, 3)  # (3, hn, S, D), rows of every rank in rank order
    out = inner(qkv[0:1], qkv[1:2], qkv[2:3], causal)[0]  # (hn, S, D): every row, this rank's heads
    back = out.transpose(0, 1).contiguous()  # (S, hn, D): no copy where the kernel wrote rows first (cuDNN, flash)
    mine = back.new_empty(n * s * hn * d)
    group.all_to_all(mine, back.flatten(), [s * hn * d] * n, [m * hn * d for m in sizes])
    res = mine.new_empty(s, n, hn, d)  # rows first, as the one-GPU kernel's output: the out projection reads it
    res.copy_(mine.view(n, s, hn, d).transpose(0, 1))  # rank j's part holds heads j*hn..(j+1)*hn
    return res.view(s, heads, d).transpose(0, 1)[None]  # (1, H, s, D)


def _fake_ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The op's output as compiled code sees it: `_ulysses`'s shape and strides, (1, H, s, D) over rows-first memory."""
    _, heads, s, d = q.shape
    return q.new_empty(s, heads, d).transpose(0, 1)[None]


class LeadFailed(RuntimeError):
    """Raised on the other ranks where rank 0 failed in a stage only it runs (its own error is the render's)."""


class AgreedContext(RenderContext):
    """A rank's render context: the cancel flag is the parent's `event`, read at each check point by every rank and
    agreed (one rank seeing it set stops them all at the same point). Progress goes to `on_progress` (rank 0's)."""

    def __init__(self, group: Group, event: Any, on_progress: ProgressCallback | None = None):
        super().__init__(on_progress)
        self.group = group
        self.event = event

    def check(self) -> None:
        if self.group.agree(self.event.is_set()):
            raise RenderCancelled("cancelled")
