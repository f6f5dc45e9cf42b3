"""The Triton source of `h3serve.accel.fused`'s block passes (imported only where Triton is). See `fused` for what
each computes and which reference it is checked against.

Every kernel here is one program per row, with the row either held in registers (read from memory once) or walked
in chunks, whose second and third reads come from L2: which one, and how many warps, is `LAUNCH`, measured per case.
The per-row reductions (the RMSNorm's sum of squares, the FP8 scale's amax) stay within the program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from h3serve.accel.linear import FP8, FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)  # 448, torch.finfo(FP8).max
# `quantize_rows` divides its amax by the Python float 448, which PyTorch's CUDA division does as a product with the
# float32 reciprocal; the same product here gives the same scales.
_INV_FP8_MAX = tl.constexpr(1.0 / 448.0)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x rounded to DTYPE (to nearest even), back in float32: eager's rounding between two ops.

    For bfloat16 the way back is a shift of the bits, not a float extension: with an extension, the compiler narrows
    `round(round(a * b) + c)` to bfloat16 arithmetic and then fuses it into one bfloat16 FMA, which rounds once
    (on the H200 a visible share of a residual add's values came out one unit off eager's: bench/results/README.md)."""
    if DTYPE == tl.bfloat16:  # noqa: SIM300 (the constexpr on the left: its own comparison)
        bits = x.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _scale_of(amax):
    return tl.maximum(amax, 1e-12) * _INV_FP8_MAX


@triton.jit
def _quantize(h, scale, inverse, EXACT: tl.constexpr):
    """e4m3 = clamp(h / scale): an IEEE division as `quantize_rows` (EXACT), else a product with 1 / scale. A NaN
    stays NaN, as torch's clamp keeps it (the GPU's min and max would return the clamp bound instead)."""
    if EXACT:  # noqa: SIM108 (a Triton constexpr branch, kept as a statement)
        q = tl.div_rn(h, scale)
    else:
        q = h * inverse
    return tl.where(q == q, tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX), q).to(tl.float8e4nv)


@triton.jit
def _amax_terms(h, mask, MASKED: tl.constexpr):
    """|h| for a row's amax, the lanes past the row's end set to 0 (MASKED), or left as they are where they hold +0
    already (a row as loaded, `other=0`): there the select would only cost registers (`_quantize_rows_kernel` at its
    launch: 34 -> 44 on sm90, Triton 3.9)."""
    if MASKED:  # noqa: SIM108 (a Triton constexpr branch, kept as a statement)
        a = tl.where(mask, tl.abs(h), 0.0)
    else:
        a = tl.abs(h)
    return a


@triton.jit
def _store_row(h, h_ptr, scale_ptr, row, cols, mask, N, QUANT: tl.constexpr, ROUND: tl.constexpr,
               DTYPE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """A row held in registers, stored in the activations' dtype, or (QUANT) as `quantize_rows` makes it from the
    row rounded to that dtype: its scale, then its e4m3 values."""
    if QUANT:
        h = _round(h, DTYPE)
        scale = _scale_of(tl.max(_amax_terms(h, mask, MASKED), axis=0))
        tl.store(scale_ptr + row, scale)
        tl.store(h_ptr + row * N + cols, _quantize(h, scale, 1.0 / scale, ROUND), mask=mask)
    else:
        tl.store(h_ptr + row * N + cols, h.to(DTYPE), mask=mask)


@triton.jit
def _store_chunks(values: tl.constexpr, args, h_ptr, scale_ptr, row, N, QUANT: tl.constexpr, ROUND: tl.constexpr,
                  CHUNK: tl.constexpr, DTYPE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """A row too wide for registers, made chunk by chunk by `values(args, row, cols, mask, ROUND, DTYPE)` (float32)
    and stored as `_store_row` stores a row: in the activations' dtype, or (QUANT) pass 1 the amax of the row rounded
    to that dtype, then its scale, pass 2 its e4m3 values, each chunk made again (its reads come from L2 then)."""
    if QUANT:
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for c0 in range(0, N, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < N
            h = _round(values(args, row, cols, mask, ROUND, DTYPE), DTYPE)
            amax = tl.maximum(amax, _amax_terms(h, mask, MASKED))
        scale = _scale_of(tl.max(amax, axis=0))
        tl.store(scale_ptr + row, scale)
        for c0 in range(0, N, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < N
            h = _round(values(args, row, cols, mask, ROUND, DTYPE), DTYPE)
            tl.store(h_ptr + row * N + cols, _quantize(h, scale, 1.0 / scale, ROUND), mask=mask)
    else:
        for c0 in range(0, N, CHUNK):
            cols = c0 + tl.arange(0, CHUNK)
            mask = cols < N
            h = values(args, row, cols, mask, ROUND, DTYPE)
            tl.store(h_ptr + row * N + cols, h.to(DTYPE), mask=mask)


@triton.jit
def _store_values(values: tl.constexpr, args, h_ptr, scale_ptr, row, N, QUANT: tl.constexpr, ROUND: tl.constexpr,
                  CHUNK: tl.constexpr, DTYPE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """The row `values` makes (`_store_chunks`), held in registers and made once where it fits (CHUNK >= N)."""
    if CHUNK >= N:
        cols = tl.arange(0, CHUNK)
        mask = cols < N
        h = values(args, row, cols, mask, ROUND, DTYPE)
        _store_row(h, h_ptr, scale_ptr, row, cols, mask, N, QUANT, ROUND, DTYPE, MASKED)
    else:
        _store_chunks(values, args, h_ptr, scale_ptr, row, N, QUANT, ROUND, CHUNK, DTYPE, MASKED)


@triton.jit
def _residual(x_ptr, y_ptr, mod, row, cols, mask, N, GATE: tl.constexpr, RESIDUAL: tl.constexpr,
              ROUND: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """x, or x + gate * y rounded to the activations' dtype (the residual stream as stored)."""
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        y = tl.load(y_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(mod + GATE * N + cols, mask=mask, other=0.0).to(tl.float32)
        if ROUND:  # noqa: SIM108 (a Triton constexpr branch, kept as a statement)
            x = _round(x + _round(gate * y, DTYPE), DTYPE)
        else:
            x = _round(x + gate * y, DTYPE)
    return x


@triton.jit
def _modulate(n, mod, cols, mask, N, SHIFT: tl.constexpr, SCALE: tl.constexpr, ROUND: tl.constexpr,
              DTYPE: tl.constexpr):  # fmt: skip
    """AdaLN modulation of a normalised row n: n * (1 + scale) + shift."""
    shift = tl.load(mod + SHIFT * N + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(mod + SCALE * N + cols, mask=mask, other=0.0).to(tl.float32)
    if ROUND:  # eager's roundings: the norm once, 1 + scale, the product, the sum
        h = _round(_round(_round(n, DTYPE) * _round(1.0 + scale, DTYPE), DTYPE) + shift, DTYPE)
    else:
        h = n * (1.0 + scale) + shift
    return h.to(tl.float32)


@triton.jit
def _modulated(x, rstd, w_ptr, mod, cols, mask, N, SHIFT: tl.constexpr, SCALE: tl.constexpr, ROUND: tl.constexpr,
               DTYPE: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    """The modulated norm of x given its rstd: rms_norm(x) * (1 + scale) + shift (x itself for the norm without
    NORM: rows torch's rms_norm made)."""
    if NORM:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = x * rstd * w
    return _modulate(x, mod, cols, mask, N, SHIFT, SCALE, ROUND, DTYPE)


@triton.jit
def _modulated_chunk(args, row, cols, mask, ROUND: tl.constexpr, DTYPE: tl.constexpr):
    """`_modulated` of the row's residual as `src` holds it: the values `_norm_modulate_kernel` stores in chunks."""
    src, rstd, w_ptr, mod, N, SHIFT, SCALE, NORM = args
    x = tl.load(src + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    return _modulated(x, rstd, w_ptr, mod, cols, mask, N, SHIFT, SCALE, ROUND, DTYPE, NORM)


@triton.jit
def _norm_modulate_kernel(
    x_ptr, y_ptr, w_ptr, table_ptr, idx_ptr, x_out_ptr, h_ptr, scale_ptr, N, table_stride, eps,
    GATE: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr, RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
    ROUND: tl.constexpr, CHUNK: tl.constexpr, DTYPE: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """One row per program. CHUNK >= N: the row is held in registers and read once. Else in chunks: pass 1 the
    residual (stored) and the sum of squares; pass 2 the modulated norm, stored, or (QUANT) its amax; pass 3 (QUANT)
    the e4m3 values (a chunk read again comes from L2). Without NORM (the exact passes' modulation of rows torch's
    rms_norm made; no residual then) no sum is taken: pass 1 is skipped, and the chunking changes no value."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(idx_ptr + row).to(tl.int64)  # this row's modulation row: t_index * 3 + tag
    mod = table_ptr + t * table_stride
    if CHUNK >= N:
        cols = tl.arange(0, CHUNK)
        mask = cols < N
        x = _residual(x_ptr, y_ptr, mod, row, cols, mask, N, GATE, RESIDUAL, ROUND, DTYPE)
        if RESIDUAL:
            tl.store(x_out_ptr + row * N + cols, x.to(DTYPE), mask=mask)
        if NORM:  # noqa: SIM108 (a Triton constexpr branch, kept as a statement)
            rstd = tl.rsqrt((tl.sum(x * x, axis=0) / N + eps).to(tl.float32))
        else:
            rstd = 1.0
        h = _modulated(x, rstd, w_ptr, mod, cols, mask, N, SHIFT, SCALE, ROUND, DTYPE, NORM)
        _store_row(h, h_ptr, scale_ptr, row, cols, mask, N, QUANT, ROUND, DTYPE, True)
    else:
        if NORM:
            acc = tl.zeros((CHUNK,), dtype=tl.float32)
            for c0 in range(0, N, CHUNK):
                cols = c0 + tl.arange(0, CHUNK)
                mask = cols < N
                x = _residual(x_ptr, y_ptr, mod, row, cols, mask, N, GATE, RESIDUAL, ROUND, DTYPE)
                if RESIDUAL:
                    tl.store(x_out_ptr + row * N + cols, x.to(DTYPE), mask=mask)
                acc += x * x
            if RESIDUAL:  # the second pass reads the residual back: every thread's stores done first
                tl.debug_barrier()
            rstd = tl.rsqrt((tl.sum(acc, axis=0) / N + eps).to(tl.float32))
        else:
            rstd = 1.0
        src = x_out_ptr if RESIDUAL else x_ptr  # the residual this program stored (same layout: same threads)
        _store_chunks(_modulated_chunk, (src, rstd, w_ptr, mod, N, SHIFT, SCALE, NORM),
                      h_ptr, scale_ptr, row, N, QUANT, ROUND, CHUNK, DTYPE, True)  # fmt: skip


@triton.jit
def _gated_residual_kernel(
    x_ptr, y_ptr, table_ptr, idx_ptr, out_ptr, N, table_stride,
    GATE: tl.constexpr, CHUNK: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """x + gate * y with eager's roundings, the gate row gathered from the table, one row per program."""
    row = tl.program_id(0).to(tl.int64)
    mod = table_ptr + tl.load(idx_ptr + row).to(tl.int64) * table_stride
    for c0 in range(0, N, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = cols < N
        x = _residual(x_ptr, y_ptr, mod, row, cols, mask, N, GATE, True, True, DTYPE)
        tl.store(out_ptr + row * N + cols, x.to(DTYPE), mask=mask)


@triton.jit
def _swiglu(args, row, cols, mask, ROUND: tl.constexpr, DTYPE: tl.constexpr):
    """A chunk of value * silu(gate), fc1's output row (2F) read as `[gate | value]`."""
    f_ptr, F = args
    gate = tl.load(f_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    value = tl.load(f_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    if ROUND:  # eager: silu = x / (1 + exp(-x)) rounded, then the product
        h = _round(value * _round(tl.div_rn(gate, 1.0 + tl.exp(-gate)), DTYPE), DTYPE)
    else:
        h = value * gate * tl.sigmoid(gate)
    return h.to(tl.float32)


@triton.jit
def _swiglu_kernel(
    f_ptr, h_ptr, scale_ptr, F, QUANT: tl.constexpr, ROUND: tl.constexpr, CHUNK: tl.constexpr, DTYPE: tl.constexpr
):
    """value * silu(gate), one row per program: held in registers (CHUNK >= F), else in chunks (QUANT: pass 1 the
    amax, pass 2 the e4m3 values)."""
    row = tl.program_id(0).to(tl.int64)
    _store_values(_swiglu, (f_ptr, F), h_ptr, scale_ptr, row, F, QUANT, ROUND, CHUNK, DTYPE, True)


@triton.jit
def _loaded(args, row, cols, mask, ROUND: tl.constexpr, DTYPE: tl.constexpr):
    """A chunk of the row as it is: `_quantize_rows_kernel`'s values (ROUND and DTYPE unread)."""
    x_ptr, N = args
    return tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, N, CHUNK: tl.constexpr):
    """`quantize_rows` exactly: the row held in registers (CHUNK >= N), else pass 1 the amax, pass 2 the values. The
    values are float32 as loaded (DTYPE float32: no rounding), quantized by an IEEE division (ROUND)."""
    row = tl.program_id(0).to(tl.int64)
    _store_values(_loaded, (x_ptr, N), q_ptr, scale_ptr, row, N, True, True, CHUNK, tl.float32, False)


# Each pass's chunk width and warps, (CHUNK, num_warps), per case: the fastest of bench/fused_passes.py's choices at
# the released widths on the H200, or within 1.5% of it (the fused-passes runs in bench/results/README.md; a CHUNK
# of at least the row holds it in registers and reads it once). "swiglu" (bfloat16 out) runs in the eager passes
# only (under compile the BF16 gate is Inductor's, at its traffic floor). Fixed, not autotuned: the chunking decides
# the reduction order, so a render must not depend on what a tuner picked in this process.
LAUNCH = {
    "norm_modulate": (2048, 8),
    "norm_modulate+residual": (2048, 8),
    "norm_modulate+fp8": (8192, 4),
    "norm_modulate+residual+fp8": (1024, 4),
    "swiglu": (2048, 8),
    "swiglu+fp8": (16384, 16),
    "quantize_rows": (1024, 4),
    "modulate": (2048, 8),
    "modulate+fp8": (1024, 4),
    "gated_residual": (4096, 8),
}


def case(op: str, residual: bool = False, quantize: bool = False) -> str:
    """The `LAUNCH` key of a call."""
    return op + ("+residual" if residual else "") + ("+fp8" if quantize else "")


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
    # The kernels address rows as row * width: dense rows (a no-op for what the block passes them).
    x, weight, table = x.contiguous(), weight.contiguous(), table.contiguous()
    y = None if y is None else y.contiguous()
    s, n = x.shape
    residual = y is not None
    x_out = torch.empty_like(x) if residual else x.new_empty((0, n))
    h, scales = _outputs(x, n, quantize)
    chunk, warps = LAUNCH[case("norm_modulate", residual, quantize)]
    wrap_triton(_norm_modulate_kernel)[(s,)](
        x, y if residual else x, weight, table, indices, x_out, h, scales, n, table.stride(0), eps,
        GATE=gate, SHIFT=shift, SCALE=scale, RESIDUAL=residual, QUANT=quantize, ROUND=eager_rounding, CHUNK=chunk,
        DTYPE=_TL_DTYPES[x.dtype], NORM=True, num_warps=warps,
    )  # fmt: skip
    return x_out, h, scales


@triton_op("h3serve::swiglu", mutates_args={})
def swiglu_op(f: torch.Tensor, quantize: bool, eager_rounding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    f = f.contiguous()
    s, two_f = f.shape
    n = two_f // 2
    h, scales = _outputs(f, n, quantize)
    chunk, warps = LAUNCH[case("swiglu", quantize=quantize)]
    wrap_triton(_swiglu_kernel)[(s,)](
        f, h, scales, n, QUANT=quantize, ROUND=eager_rounding, CHUNK=chunk, DTYPE=_TL_DTYPES[f.dtype], num_warps=warps
    )
    return h, scales


@triton_op("h3serve::quantize_rows", mutates_args={})
def quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    s, n = x.shape
    q, scales = _outputs(x, n, True)
    chunk, warps = LAUNCH["quantize_rows"]
    wrap_triton(_quantize_rows_kernel)[(s,)](x, q, scales, n, CHUNK=chunk, num_warps=warps)
    return q, scales


@triton_op("h3serve::modulate", mutates_args={})
def modulate_op(
    n: torch.Tensor, table: torch.Tensor, indices: torch.Tensor, shift: int, scale: int, quantize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    n, table = n.contiguous(), table.contiguous()
    s, width = n.shape
    h, scales = _outputs(n, width, quantize)
    chunk, warps = LAUNCH[case("modulate", quantize=quantize)]
    wrap_triton(_norm_modulate_kernel)[(s,)](
        n, n, n, table, indices, n, h, scales, width, table.stride(0), 0.0,
        GATE=0, SHIFT=shift, SCALE=scale, RESIDUAL=False, QUANT=quantize, ROUND=True, CHUNK=chunk,
        DTYPE=_TL_DTYPES[n.dtype], NORM=False, num_warps=warps,
    )  # fmt: skip
    return h, scales


@triton_op("h3serve::gated_residual", mutates_args={})
def gated_residual_op(
    x: torch.Tensor, y: torch.Tensor, table: torch.Tensor, indices: torch.Tensor, gate: int
) -> torch.Tensor:
    x, y, table = x.contiguous(), y.contiguous(), table.contiguous()
    s, n = x.shape
    out = torch.empty_like(x)
    chunk, warps = LAUNCH["gated_residual"]
    wrap_triton(_gated_residual_kernel)[(s,)](
        x, y, table, indices, out, n, table.stride(0),
        GATE=gate, CHUNK=chunk, DTYPE=_TL_DTYPES[x.dtype], num_warps=warps,
    )  # fmt: skip
    return out
