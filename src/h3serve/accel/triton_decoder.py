"""The Triton source of `h3serve.accel.vae`'s decoder passes (imported only where Triton is). Each kernel computes
what its reference in `h3serve.model.video_vae` computes, value for value: every product, sum and quotient rounded
where eager rounds it (to the activations' dtype between two ops, float32 inside one), no sum reordered (none of
these passes has a reduction: the norms stay torch's own), and no multiply-add contracted into one FMA (launched with
`enable_fp_fusion=False`, so each product is rounded before its add, as eager's two kernels do).

residual  x + y * scale: the block's residual add (x, scale float32; y the projection's output)
swiglu    up * silu(gate) of the feed-forward's `[gate | up]` rows: silu = g / (1 + exp(-g)) in float32 (libdevice's
          expf, torch's CUDA silu's), rounded, then the product, rounded
qk_rope   the qk-norm's float32 output rounded to the activations' dtype, then the rotate-half rotary on the leading
          R channels of each head: q and k in one launch
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
BLOCK = 2048  # elements per program of the element-wise passes
WARPS = 8


@triton.jit
def _r(x, DTYPE: tl.constexpr):
    """x rounded to DTYPE, back in float32 (eager's rounding between two ops; none for float32)."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _residual_kernel(x_ptr, y_ptr, scale_ptr, out_ptr, total, N, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    y = tl.load(y_ptr + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + i % N, mask=mask, other=0.0)
    tl.store(out_ptr + i, x + y * s, mask=mask)


@triton.jit
def _swiglu_kernel(f_ptr, out_ptr, total, H, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    row, col = i // H, i % H
    gate = tl.load(f_ptr + row * 2 * H + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(f_ptr + row * 2 * H + H + col, mask=mask, other=0.0).to(tl.float32)
    silu = _r(tl.div_rn(gate, 1.0 + libdevice.exp(-gate)), DTYPE)
    tl.store(out_ptr + i, (up * silu).to(DTYPE), mask=mask)


@triton.jit
def _rope_one(x_ptr, out_ptr, base, c, cos1, sin1, cos2, sin2, m_half, m_rest, HALF: tl.constexpr,
              DTYPE: tl.constexpr):  # fmt: skip
    y1 = _r(tl.load(x_ptr + base + c[None, :], mask=m_half, other=0.0), DTYPE)
    y2 = _r(tl.load(x_ptr + base + HALF + c[None, :], mask=m_half, other=0.0), DTYPE)
    # [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], each product and the sum rounded as eager's
    o1 = _r(y1 * cos1, DTYPE) + _r(-y2 * sin1, DTYPE)
    o2 = _r(y2 * cos2, DTYPE) + _r(y1 * sin2, DTYPE)
    tl.store(out_ptr + base + c[None, :], o1.to(DTYPE), mask=m_half)
    tl.store(out_ptr + base + HALF + c[None, :], o2.to(DTYPE), mask=m_half)
    y3 = tl.load(x_ptr + base + 2 * HALF + c[None, :], mask=m_rest, other=0.0)
    tl.store(out_ptr + base + 2 * HALF + c[None, :], y3.to(DTYPE), mask=m_rest)


@triton.jit
def _qk_rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, rows, S, H, cs_stride,
                    D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    DTYPE: tl.constexpr):  # fmt: skip
    """Rows of (B*S*H) head vectors (D channels, contiguous); a row's position is (row // H) % S."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_rows = r < rows
    c = tl.arange(0, BLOCK_D)
    m_half = m_rows[:, None] & (c[None, :] < HALF)
    m_rest = m_rows[:, None] & (c[None, :] < D - 2 * HALF)
    pos = (r // H) % S
    cs = pos[:, None] * cs_stride + c[None, :]
    # The tables rounded to the activations' dtype first, as `apply_rotary` does.
    cos1 = _r(tl.load(cos_ptr + cs, mask=m_half, other=0.0), DTYPE)
    sin1 = _r(tl.load(sin_ptr + cs, mask=m_half, other=0.0), DTYPE)
    cos2 = _r(tl.load(cos_ptr + HALF + cs, mask=m_half, other=0.0), DTYPE)
    sin2 = _r(tl.load(sin_ptr + HALF + cs, mask=m_half, other=0.0), DTYPE)
    base = r[:, None] * D
    _rope_one(q_ptr, qo_ptr, base, c, cos1, sin1, cos2, sin2, m_half, m_rest, HALF, DTYPE)
    _rope_one(k_ptr, ko_ptr, base, c, cos1, sin1, cos2, sin2, m_half, m_rest, HALF, DTYPE)


def residual(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x, y = x.contiguous(), y.contiguous()
    # eager's type promotion: the first block's stream is the embedding's dtype, float32 after the add
    out = torch.empty(x.shape, dtype=torch.promote_types(torch.promote_types(x.dtype, y.dtype), scale.dtype),
                      device=x.device)  # fmt: skip
    total = x.numel()
    _residual_kernel[(triton.cdiv(total, BLOCK),)](
        x, y, scale, out, total, x.shape[-1], BLOCK=BLOCK, num_warps=WARPS, enable_fp_fusion=False
    )
    return out


def swiglu(f: torch.Tensor) -> torch.Tensor:
    f = f.contiguous()
    h = f.shape[-1] // 2
    out = f.new_empty((*f.shape[:-1], h))
    total = out.numel()
    _swiglu_kernel[(triton.cdiv(total, BLOCK),)](
        f, out, total, h, BLOCK=BLOCK, DTYPE=_TL[f.dtype], num_warps=WARPS, enable_fp_fusion=False
    )
    return out


def qk_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: (B, S, H, D) float32 (the norm's output), cos, sin: (S, R) float32 -> (B, S, H, D) in `dtype`."""
    q, k, cos, sin = q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous()
    b, s, h, d = q.shape
    r = cos.shape[-1]
    q_out, k_out = (
        torch.empty(q.shape, dtype=dtype, device=q.device),
        torch.empty(k.shape, dtype=dtype, device=q.device),
    )
    rows, block_m = b * s * h, 16
    _qk_rope_kernel[(triton.cdiv(rows, block_m),)](
        q, k, cos, sin, q_out, k_out, rows, s, h, cos.stride(0),
        D=d, HALF=r // 2, BLOCK_D=triton.next_power_of_2(max(r // 2, d - r)), BLOCK_M=block_m, DTYPE=_TL[dtype],
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return q_out, k_out
