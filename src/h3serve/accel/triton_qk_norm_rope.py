"""The Triton source of `h3serve.accel.fused`'s qk-norm + rotary pass (imported only where Triton is: a module of
its own because Triton resolves a kernel's helpers from its module's globals). See `fused` for what it computes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from h3serve.accel.triton_block import _TL_DTYPES, _round  # the kernels resolve `_round` from these globals


@triton.jit
def _rstd_weights(x1, x2, x3, w_ptr, c_half, eps, D: tl.constexpr, HALF: tl.constexpr):
    """A (row, head) tile's 1 / rms over its D channels, and the norm weight's two rotary halves."""
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
    rstd = tl.rsqrt(ss / D + eps)[:, None]
    w1 = tl.load(w_ptr + c_half, mask=c_half < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + c_half, mask=c_half < HALF, other=0.0).to(tl.float32)[None, :]
    return rstd, w1, w2


@triton.jit
def _norm_rope_tile(
    x_ptr, out_ptr, w_ptr, cos1, sin1, cos2, sin2, rows, mask_rows, head,
    x_row_stride, x_head_stride, out_row_stride, eps,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr,
    DTYPE: tl.constexpr, ROUND_NORM: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    c_half = tl.arange(0, BLOCK_HALF)
    m_half = mask_rows[:, None] & (c_half[None, :] < HALF)
    base = x_ptr + rows[:, None] * x_row_stride + head * x_head_stride
    x1 = tl.load(base + c_half[None, :], mask=m_half, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + c_half[None, :], mask=m_half, other=0.0).to(tl.float32)
    # The channels past the rotary ones (none when R = D: the mask is then all false).
    c_rest = tl.arange(0, BLOCK_REST)
    m_rest = mask_rows[:, None] & (c_rest[None, :] < REST)
    x3 = tl.load(base + 2 * HALF + c_rest[None, :], mask=m_rest, other=0.0).to(tl.float32)
    if NORM:
        rstd, w1, w2 = _rstd_weights(x1, x2, x3, w_ptr, c_half, eps, D, HALF)
        if ROUND_NORM:  # ATen's composite rms_norm: the normalised value rounded, then times the weight
            y1 = _round(_round(x1 * rstd, DTYPE) * w1, DTYPE)
            y2 = _round(_round(x2 * rstd, DTYPE) * w2, DTYPE)
        else:  # one rounding of x * rstd * w (a fused rms_norm kernel)
            y1 = _round(x1 * rstd * w1, DTYPE)
            y2 = _round(x2 * rstd * w2, DTYPE)
    else:  # q and k come normalised (torch's own rms_norm: the exact eager passes); the rotary alone
        y1, y2 = x1, x2
    # rotate-half: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], each product and the sum rounded as eager's
    o1 = _round(y1 * cos1, DTYPE) + _round(-y2 * sin1, DTYPE)
    o2 = _round(y2 * cos2, DTYPE) + _round(y1 * sin2, DTYPE)
    obase = out_ptr + rows[:, None] * out_row_stride + head * D
    tl.store(obase + c_half[None, :], o1.to(DTYPE), mask=m_half)
    tl.store(obase + HALF + c_half[None, :], o2.to(DTYPE), mask=m_half)
    if NORM:
        w3 = tl.load(w_ptr + 2 * HALF + c_rest, mask=c_rest < REST, other=0.0).to(tl.float32)[None, :]
        if ROUND_NORM:  # noqa: SIM108 (a Triton constexpr branch, kept as a statement)
            y3 = _round(x3 * rstd, DTYPE) * w3
        else:
            y3 = x3 * rstd * w3
    else:
        y3 = x3
    tl.store(obase + 2 * HALF + c_rest[None, :], y3.to(DTYPE), mask=m_rest)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, S,
    q_row_stride, q_head_stride, k_row_stride, k_head_stride, cs_row_stride, out_row_stride, eps,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr,
    BLOCK_M: tl.constexpr, DTYPE: tl.constexpr, ROUND_NORM: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    mask_rows = rows < S
    c_half = tl.arange(0, BLOCK_HALF)
    m_half = mask_rows[:, None] & (c_half[None, :] < HALF)
    cs = rows[:, None] * cs_row_stride + c_half[None, :]
    # The tables rounded to the activations' dtype first, as eager's `apply_rotary` does.
    cos1 = _round(tl.load(cos_ptr + cs, mask=m_half, other=0.0), DTYPE)
    sin1 = _round(tl.load(sin_ptr + cs, mask=m_half, other=0.0), DTYPE)
    cos2 = _round(tl.load(cos_ptr + HALF + cs, mask=m_half, other=0.0), DTYPE)
    sin2 = _round(tl.load(sin_ptr + HALF + cs, mask=m_half, other=0.0), DTYPE)
    _norm_rope_tile(q_ptr, qo_ptr, qw_ptr, cos1, sin1, cos2, sin2, rows, mask_rows, head,
                    q_row_stride, q_head_stride, out_row_stride, eps, D, HALF, BLOCK_HALF, REST, BLOCK_REST,
                    DTYPE, ROUND_NORM, NORM)  # fmt: skip
    _norm_rope_tile(k_ptr, ko_ptr, kw_ptr, cos1, sin1, cos2, sin2, rows, mask_rows, head,
                    k_row_stride, k_head_stride, out_row_stride, eps, D, HALF, BLOCK_HALF, REST, BLOCK_REST,
                    DTYPE, ROUND_NORM, NORM)  # fmt: skip


# Whether the norm rounds twice (ATen's composite rms_norm) or once. Against eager's CUDA rms_norm, one rounding is
# the closer (tests/test_fused.py prints both; the GPU runs are in bench/results/README.md), so: one. Most of what
# was left were the compiler fusing a rounded product into the following add, which `_round` prevents by going back
# from bfloat16 through the bits.
ROUND_NORM = False

# (BLOCK_M rows per program, num_warps) of the pass with the norm and of the rotary alone (the eager passes' qk pass,
# after torch's rms_norm); bench/fused_passes.py times the choices. Fixed, not autotuned (the tile's layout may
# decide the order of the norm's sum).
LAUNCH = {"qk_norm_rope": (16, 4), "qk_rope": (16, 4)}


@triton_op("h3serve::qk_norm_rope", mutates_args={})
def qk_norm_rope_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    round_norm: bool = ROUND_NORM,
    norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    s, h, d = q.shape
    r = cos.shape[-1]
    q_out = torch.empty((s, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((s, h, d), dtype=q.dtype, device=q.device)
    block_m, warps = LAUNCH["qk_norm_rope" if norm else "qk_rope"]

    def grid(meta):
        return (triton.cdiv(s, meta["BLOCK_M"]), h)

    wrap_triton(_qk_norm_rope_kernel)[grid](
        q, k, q_weight, k_weight, cos, sin, q_out, k_out, s,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), h * d, eps,
        D=d, HALF=r // 2, BLOCK_HALF=triton.next_power_of_2(r // 2), REST=d - r,
        BLOCK_REST=triton.next_power_of_2(max(d - r, 1)), BLOCK_M=block_m, DTYPE=_TL_DTYPES[q.dtype],
        ROUND_NORM=round_norm, NORM=norm, num_warps=warps,
    )  # fmt: skip
    return q_out, k_out
