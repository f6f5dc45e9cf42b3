"""The Triton source of `h3serve.accel.fp8_attention`'s two passes over q, k and v (imported only where Triton is).

stats     one read of q, k, v: per (row block, head) the amax of q, and per channel the sum, max and min of k and of
          v (partials; the caller reduces them, so every sum has one fixed order)
quantize  one more read: q, k - its mean, v - its mean times their head's scale, saturated, rounded to e4m3, written
          as (B, S, H, D)

Both take (B, H, S, D) views with any strides but a unit channel stride, and a power-of-two head size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# Rows per program of both passes, and their warps (fixed, not autotuned: the partial sums' order is the layout's).
BLOCK_S, WARPS = 64, 4
E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _tile(ptr, b, h, rows, cols, mask, sb, sh, ss):
    # int64 offsets: v is a slice of the fused projection, 3 H D elements a row, past 2^31 at ~100k rows
    offsets = b.to(tl.int64) * sb + h.to(tl.int64) * sh + rows.to(tl.int64)[:, None] * ss + cols[None, :]
    return tl.load(ptr + offsets, mask=mask[:, None], other=0.0).to(tl.float32)


@triton.jit
def _program(S, D: tl.constexpr, BLOCK: tl.constexpr):
    """This program's row block, head and batch item (the grid's axes), its rows and channels, and its rows' mask."""
    blk, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    return blk, h, b, rows, tl.arange(0, D), rows < S


@triton.jit
def _channel_stats(x, mask, out_ptr, slot, part, cols, D: tl.constexpr):
    """A tile's per-channel sum, max and min, at `out_ptr`'s [0 | 1 | 2][slot] rows (`part` apart)."""
    tl.store(out_ptr + slot * D + cols, tl.sum(x, axis=0))
    tl.store(out_ptr + part + slot * D + cols, tl.max(tl.where(mask[:, None], x, -float("inf")), axis=0))
    tl.store(out_ptr + 2 * part + slot * D + cols, tl.min(tl.where(mask[:, None], x, float("inf")), axis=0))


@triton.jit
def _stats_kernel(
    q_ptr, k_ptr, v_ptr, qa_ptr, kst_ptr, vst_ptr, S, H, NB, part,
    qsb, qsh, qss, ksb, ksh, kss, vsb, vsh, vss,
    D: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    blk, h, b, rows, cols, mask = _program(S, D, BLOCK)
    slot = (b * H + h) * NB + blk
    q = _tile(q_ptr, b, h, rows, cols, mask, qsb, qsh, qss)
    tl.store(qa_ptr + slot, tl.max(tl.max(tl.abs(q), axis=1), axis=0))
    _channel_stats(_tile(k_ptr, b, h, rows, cols, mask, ksb, ksh, kss), mask, kst_ptr, slot, part, cols, D)
    _channel_stats(_tile(v_ptr, b, h, rows, cols, mask, vsb, vsh, vss), mask, vst_ptr, slot, part, cols, D)


@triton.jit
def _quantize_tile(x_ptr, out_ptr, b, h, rows, cols, mask, sb, sh, ss, osb, osh, oss, scale, shift):
    x = (_tile(x_ptr, b, h, rows, cols, mask, sb, sh, ss) - shift) * scale
    x = tl.minimum(tl.maximum(x, -E4M3_MAX), E4M3_MAX)
    offsets = b.to(tl.int64) * osb + h.to(tl.int64) * osh + rows.to(tl.int64)[:, None] * oss + cols[None, :]
    tl.store(out_ptr + offsets, x.to(tl.float8e4nv), mask=mask[:, None])


@triton.jit
def _quantize_kernel(
    q_ptr, k_ptr, v_ptr, sq_ptr, sk_ptr, sv_ptr, kmean_ptr, vmean_ptr, q8_ptr, k8_ptr, v8_ptr, S, H,
    qsb, qsh, qss, ksb, ksh, kss, vsb, vsh, vss, osb, osh, oss,
    D: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    _, h, b, rows, cols, mask = _program(S, D, BLOCK)
    k_mean = tl.load(kmean_ptr + (b * H + h) * D + cols)[None, :]
    v_mean = tl.load(vmean_ptr + (b * H + h) * D + cols)[None, :]
    _quantize_tile(q_ptr, q8_ptr, b, h, rows, cols, mask, qsb, qsh, qss, osb, osh, oss, tl.load(sq_ptr + h), 0.0)
    _quantize_tile(k_ptr, k8_ptr, b, h, rows, cols, mask, ksb, ksh, kss, osb, osh, oss, tl.load(sk_ptr + h), k_mean)
    _quantize_tile(v_ptr, v8_ptr, b, h, rows, cols, mask, vsb, vsh, vss, osb, osh, oss, tl.load(sv_ptr + h), v_mean)


def _grid(b: int, h: int, s: int):
    return lambda meta: (triton.cdiv(s, meta["BLOCK"]), h, b)


@triton_op("h3serve::fp8_attention_stats", mutates_args={})
def stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partials per (B, H, row block): q's amax (B, H, NB), and k's and v's per-channel sums, maxima and minima
    (3, B, H, NB, D) each."""
    b, h, s, d = q.shape
    nb = triton.cdiv(s, BLOCK_S)
    f32 = {"dtype": torch.float32, "device": q.device}
    qa = torch.empty((b, h, nb), **f32)
    k_stats, v_stats = torch.empty((3, b, h, nb, d), **f32), torch.empty((3, b, h, nb, d), **f32)
    wrap_triton(_stats_kernel)[_grid(b, h, s)](
        q, k, v, qa, k_stats, v_stats, s, h, nb, b * h * nb * d, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        D=d, BLOCK=BLOCK_S, num_warps=WARPS,
    )  # fmt: skip
    return qa, k_stats, v_stats


@triton_op("h3serve::fp8_attention_quantize", mutates_args={})
def quantize(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale_q: torch.Tensor,
    scale_k: torch.Tensor,
    scale_v: torch.Tensor,
    k_mean: torch.Tensor,
    v_mean: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q * scale_q[h], (k - k_mean[b, h]) * scale_k[h], (v - v_mean[b, h]) * scale_v[h] in e4m3, each as (B, S, H, D)
    rows."""
    b, h, s, d = q.shape
    out = [torch.empty((b, s, h, d), dtype=torch.float8_e4m3fn, device=q.device) for _ in range(3)]
    osb, oss, osh = out[0].stride()[:3]
    wrap_triton(_quantize_kernel)[_grid(b, h, s)](
        q, k, v, scale_q, scale_k, scale_v, k_mean, v_mean, *out, s, h,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], osb, osh, oss, D=d, BLOCK=BLOCK_S, num_warps=WARPS,
    )  # fmt: skip
    return out[0], out[1], out[2]
