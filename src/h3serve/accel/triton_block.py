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
_FP8_MAX = tl.constexpr(448.0)  # torch.finfo(FP8).max, as accel.linear.FP8_MAX
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _quantize(h, scale):
    """e4m3 = clamp(h / scale) with an IEEE division, as `accel.linear.quantize_rows`."""
    return tl.minimum(tl.maximum(tl.div_rn(h, scale), -_FP8_MAX), _FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _scale_of(amax):
    return tl.div_rn(tl.maximum(amax, 1e-12), _FP8_MAX)


@triton.jit
def _norm_modulate_chunk(
    x_ptr, y_ptr, w_ptr, mod, x_out_ptr, row, cols, mask, rstd, N,
    GATE: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr, RESIDUAL: tl.constexpr, ROUND: tl.constexpr,
    DTYPE: tl.constexpr, READ_BACK: tl.constexpr,
):  # fmt: skip
    """One chunk of a row: x (after the residual add, as stored), and, given rstd, the modulated norm h."""
    if RESIDUAL and READ_BACK:  # the residual this program stored in its first pass (same layout: same threads)
        x = tl.load(x_out_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL:  # x + gate * y
            y = tl.load(y_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            gate = tl.load(mod + GATE * N + cols, mask=mask, other=0.0).to(tl.float32)
            if ROUND:  # noqa: SIM108 (a Triton constexpr branch, kept as a statement)
                x = _round(x + _round(gate * y, DTYPE), DTYPE)
            else:
                x = _round(x + gate * y, DTYPE)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(mod + SHIFT * N + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(mod + SCALE * N + cols, mask=mask, other=0.0).to(tl.float32)
    if ROUND:  # eager's roundings: the norm (x * rstd * w) once, 1 + scale, the product, the sum
        h = _round(_round(_round(x * rstd * w, DTYPE) * _round(1.0 + scale, DTYPE), DTYPE) + shift, DTYPE)
    else:
        h = x * rstd * w * (1.0 + scale) + shift
    return x, h


@triton.jit
def _norm_modulate_kernel(
    x_ptr, y_ptr, w_ptr, table_ptr, idx_ptr, x_out_ptr, h_ptr, scale_ptr, N, table_stride, eps,
    GATE: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr, RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
    ROUND: tl.constexpr, CHUNK: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """One row per program, in chunks of CHUNK columns: pass 1 the residual (stored) and the sum of squares; pass 2
    the modulated norm, stored, or (QUANT) its amax; pass 3 (QUANT) the e4m3 values. A chunk re-read is an L2 hit."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(idx_ptr + row).to(tl.int64)  # this row's modulation row: t_index * 3 + tag
    mod = table_ptr + t * table_stride
    acc = tl.zeros((CHUNK,), dtype=tl.float32)
    for c0 in range(0, N, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL:
            y = tl.load(y_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            gate = tl.load(mod + GATE * N + cols, mask=mask, other=0.0).to(tl.float32)
            if ROUND:  # noqa: SIM108 (a Triton constexpr branch, kept as a statement)
                x = _round(x + _round(gate * y, DTYPE), DTYPE)
            else:
                x = _round(x + gate * y, DTYPE)
            tl.store(x_out_ptr + row * N + cols, x.to(DTYPE), mask=mask)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    for c0 in range(0, N, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < N
        _, h = _norm_modulate_chunk(x_ptr, y_ptr, w_ptr, mod, x_out_ptr, row, cols, mask, rstd, N, GATE, SHIFT,
                                    SCALE, RESIDUAL, ROUND, DTYPE, True)  # fmt: skip
        if QUANT:  # the row as the reference quantizes it: rounded to the activations' dtype
            amax = tl.maximum(amax, tl.where(mask, tl.abs(_round(h, DTYPE)), 0.0))
        else:
            tl.store(h_ptr + row * N + cols, h.to(DTYPE), mask=mask)
    if QUANT:
        scale = _scale_of(tl.max(amax, axis=0))
        tl.store(scale_ptr + row, scale)
        for c0 in range(0, N, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < N
            _, h = _norm_modulate_chunk(x_ptr, y_ptr, w_ptr, mod, x_out_ptr, row, cols, mask, rstd, N, GATE, SHIFT,
                                        SCALE, RESIDUAL, ROUND, DTYPE, True)  # fmt: skip
            tl.store(h_ptr + row * N + cols, _quantize(_round(h, DTYPE), scale), mask=mask)


@triton.jit
def _swiglu_chunk(f_ptr, row, cols, mask, F, ROUND: tl.constexpr, DTYPE: tl.constexpr):
    gate = tl.load(f_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    value = tl.load(f_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.div_rn(gate, 1.0 + tl.exp(-gate))
    if ROUND:  # eager: silu rounded, then the product
        return _round(value * _round(silu, DTYPE), DTYPE)
    return value * silu


@triton.jit
def _swiglu_kernel(
    f_ptr, h_ptr, scale_ptr, F, QUANT: tl.constexpr, ROUND: tl.constexpr, CHUNK: tl.constexpr, DTYPE: tl.constexpr
):
    """value * silu(gate), one row per program in chunks; QUANT: pass 1 the amax, pass 2 the e4m3 values."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    for c0 in range(0, F, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < F
        h = _swiglu_chunk(f_ptr, row, cols, mask, F, ROUND, DTYPE)
        if QUANT:
            amax = tl.maximum(amax, tl.where(mask, tl.abs(_round(h, DTYPE)), 0.0))
        else:
            tl.store(h_ptr + row * F + cols, h.to(DTYPE), mask=mask)
    if QUANT:
        scale = _scale_of(tl.max(amax, axis=0))
        tl.store(scale_ptr + row, scale)
        for c0 in range(0, F, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < F
            h = _round(_swiglu_chunk(f_ptr, row, cols, mask, F, ROUND, DTYPE), DTYPE)
            tl.store(h_ptr + row * F + cols, _quantize(h, scale), mask=mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, N, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    for c0 in range(0, N, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = _scale_of(tl.max(amax, axis=0))
    tl.store(scale_ptr + row, scale)
    for c0 in range(0, N, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * N + cols, _quantize(x, scale), mask=cols < N)


# Each pass's chunk width and warps: (CHUNK, num_warps), chosen by `bench/fused_passes.py` on the H200 (a CHUNK of
# at least the row is one pass over memory with the row held in registers). Fixed, not autotuned: the chunking
# decides the reduction order, so a render must not depend on what a tuner picked in this process.
LAUNCH = {"norm_modulate": (2048, 8), "swiglu": (2048, 8), "quantize_rows": (2048, 8)}


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
    chunk, warps = LAUNCH["norm_modulate"]
    wrap_triton(_norm_modulate_kernel)[(s,)](
        x, y if residual else x, weight, table, indices, x_out, h, scales, n, table.stride(0), eps,
        GATE=gate, SHIFT=shift, SCALE=scale, RESIDUAL=residual, QUANT=quantize, ROUND=eager_rounding, CHUNK=chunk,
        DTYPE=_TL_DTYPES[x.dtype], num_warps=warps,
    )  # fmt: skip
    return x_out, h, scales


@triton_op("h3serve::swiglu", mutates_args={})
def swiglu_op(f: torch.Tensor, quantize: bool, eager_rounding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s, two_f = f.shape
    n = two_f // 2
    h, scales = _outputs(f, n, quantize)
    chunk, warps = LAUNCH["swiglu"]
    wrap_triton(_swiglu_kernel)[(s,)](
        f, h, scales, n, QUANT=quantize, ROUND=eager_rounding, CHUNK=chunk, DTYPE=_TL_DTYPES[f.dtype], num_warps=warps
    )
    return h, scales


@triton_op("h3serve::quantize_rows", mutates_args={})
def quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s, n = x.shape
    q, scales = _outputs(x, n, True)
    chunk, warps = LAUNCH["quantize_rows"]
    wrap_triton(_quantize_rows_kernel)[(s,)](x, q, scales, n, CHUNK=chunk, num_warps=warps)
    return q, scales
