"""The Triton source of `h3serve.accel.fused`'s block passes (imported only where Triton is). See `fused` for what
each computes and which reference it is checked against.

Every kernel here is one program per row: a DiT row (5376 wide, 14336 after the SwiGLU gate) fits in one program's
registers, so a per-row reduction (the RMSNorm's sum of squares, the FP8 scale's amax) and the values it scales are
read from memory once, where Inductor's code for the same ops looped over the row two or three times.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(FP8).max; accel.linear.FP8_MAX
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _store_rows(h, out_ptr, scale_ptr, row, cols, mask, N, QUANT: tl.constexpr, DTYPE: tl.constexpr):
    """Store one row in the activations' dtype, or (QUANT) as `accel.linear.quantize_rows` makes it from the row
    rounded to that dtype: scale = max(amax, 1e-12) / 448, e4m3 = clamp(x / scale), IEEE divisions."""
    if QUANT:
        h = _round(h, DTYPE)
        amax = tl.max(tl.where(mask, tl.abs(h), 0.0), axis=0)
        scale = tl.div_rn(tl.maximum(amax, 1e-12), FP8_MAX)
        q = tl.minimum(tl.maximum(tl.div_rn(h, scale), -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + row * N + cols, q.to(tl.float8e4nv), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * N + cols, h.to(DTYPE), mask=mask)


@triton.jit
def _norm_modulate_kernel(
    x_ptr, y_ptr, w_ptr, table_ptr, idx_ptr, x_out_ptr, h_ptr, scale_ptr, N, table_stride, eps,
    GATE: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr, RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
    ROUND: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    t = tl.load(idx_ptr + row).to(tl.int64)  # this row's modulation row: t_index * 3 + tag
    mod = table_ptr + t * table_stride
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:  # x + gate * y, stored: the residual stream the rest of the block adds to
        y = tl.load(y_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(mod + GATE * N + cols, mask=mask, other=0.0).to(tl.float32)
        if ROUND:  # noqa: SIM108 (a Triton constexpr branch, kept as a statement)
            x = _round(x + _round(gate * y, DTYPE), DTYPE)
        else:
            x = _round(x + gate * y, DTYPE)
        tl.store(x_out_ptr + row * N + cols, x.to(DTYPE), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(mod + SHIFT * N + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(mod + SCALE * N + cols, mask=mask, other=0.0).to(tl.float32)
    if ROUND:  # eager's roundings: the norm (x * rstd * w) once, 1 + scale, the product, the sum
        h = _round(_round(_round(x * rstd * w, DTYPE) * _round(1.0 + scale, DTYPE), DTYPE) + shift, DTYPE)
    else:
        h = x * rstd * w * (1.0 + scale) + shift
    _store_rows(h, h_ptr, scale_ptr, row, cols, mask, N, QUANT, DTYPE)


@triton.jit
def _swiglu_kernel(
    f_ptr, h_ptr, scale_ptr, F, QUANT: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(f_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    value = tl.load(f_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.div_rn(gate, 1.0 + tl.exp(-gate))
    if ROUND:  # noqa: SIM108 (eager: silu rounded, then the product)
        h = _round(value * _round(silu, DTYPE), DTYPE)
    else:
        h = value * silu
    _store_rows(h, h_ptr, scale_ptr, row, cols, mask, F, QUANT, DTYPE)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, N, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    _store_rows(x, q_ptr, scale_ptr, row, cols, mask, N, True, DTYPE)


def _launch(n: int) -> tuple[int, int]:
    """BLOCK (the row, padded to a power of two) and warps: about 16 to 32 values per thread."""
    block = triton.next_power_of_2(n)
    return block, max(1, min(16, block // 512))


def _outputs(x: torch.Tensor, n: int, quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.shape[0]
    scales = torch.empty((s if quantize else 0, 1), dtype=torch.float32, device=x.device)
    return torch.empty((s, n), dtype=FP8 if quantize else x.dtype, device=x.device), scales


@triton_op("h3serve::norm_modulate", mutates_args={})
def norm_modulate_op(
    x: torch.Tensor,
    y: torch.Tensor | None,
    weight: torch.Tensor,
    table: torch.Tensor,
    indices: torch.Tensor,
    eps: float,
    gate: int,
    shift: int,
    scale: int,
    quantize: bool,
    eager_rounding: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s, n = x.shape
    residual = y is not None
    x_out = torch.empty_like(x) if residual else x.new_empty((0, n))
    h, scales = _outputs(x, n, quantize)
    block, warps = _launch(n)
    wrap_triton(_norm_modulate_kernel)[(s,)](
        x, y if residual else x, weight, table, indices, x_out, h, scales, n, table.stride(0), eps,
        GATE=gate, SHIFT=shift, SCALE=scale, RESIDUAL=residual, QUANT=quantize, ROUND=eager_rounding, BLOCK=block,
        DTYPE=_TL_DTYPES[x.dtype], num_warps=warps,
    )  # fmt: skip
    return x_out, h, scales


@triton_op("h3serve::swiglu", mutates_args={})
def swiglu_op(f: torch.Tensor, quantize: bool, eager_rounding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s, two_f = f.shape
    n = two_f // 2
    h, scales = _outputs(f, n, quantize)
    block, warps = _launch(n)
    wrap_triton(_swiglu_kernel)[(s,)](
        f, h, scales, n, QUANT=quantize, ROUND=eager_rounding, BLOCK=block, DTYPE=_TL_DTYPES[f.dtype], num_warps=warps
    )
    return h, scales


@triton_op("h3serve::quantize_rows", mutates_args={})
def quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s, n = x.shape
    q, scales = _outputs(x, n, True)
    block, warps = _launch(n)
    wrap_triton(_quantize_rows_kernel)[(s,)](x, q, scales, n, BLOCK=block, DTYPE=_TL_DTYPES[x.dtype], num_warps=warps)
    return q, scales
