"""The Triton kernels (accel/triton_block.py, accel/triton_qk_norm_rope.py, accel/triton_decoder.py) against their
reference ops on the CPU, under Triton's interpreter, on small shapes: the GPU parity tests' checks
(tests/test_fused.py, tests/test_fused_block.py, tests/test_gpu_decode.py), kernel by kernel, where the interpreter
computes what the GPU does. The decoder's norms are held bit for bit to torch's CUDA reduction order, written out
here (`torch_cuda_rstd`); its two libdevice calls are numpy's under the interpreter (`triton_decoder._INTERPRET`).

Not collected by the suite (the name is not test_*): tests/test_triton_interpreter.py runs this file in a process of
its own with TRITON_INTERPRET=1, which Triton reads when it is imported and which turns every Triton kernel of the
process into numpy, so it must not leak into the rest of the suite.

What the interpreter computes decides what is compared (measured with Triton 3.9.0):

* float32 and float16: numpy's IEEE arithmetic and casts, so each rounding a kernel makes where eager makes one is
  checked exactly. Where the kernel does the reference's operations, the outputs are equal bit for bit, as on the GPU;
  where it takes a sum of its own (an RMSNorm's), within the GPU tests' bounds or tighter ones.
* bfloat16: the interpreter narrows float32 to bfloat16 by truncation, not to nearest even (half of random values
  one unit low; Triton's debugging guide: bfloat16 is not supported), so no bfloat16 kernel output can be eager's
  here. float16 stands in for it: the kernels round through one helper, `_round`, whose bfloat16 branch (a shift of
  the bits) is checked alone against the interpreter's own cast. bfloat16 numerics are the GPU tests'.
* e4m3: the interpreter's float32 -> e4m3 cast is not the GPU's either (ties away from zero, and a rounding up into
  the next binade lost when the exponent is odd, which halves the value: 2.2% of random values differ from torch's
  cast; NaN becomes 384). So a kernel's e4m3 bytes are compared with the same cast of the reference's float32
  quotients (`interpreted_e4m3`): the scale, the division, the clamp and the rounding to the activations' dtype
  before them bit for bit, the cast itself on the GPU only. For the same reason the NaN test (a NaN stays NaN through
  the quantizing passes) is GPU-only.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "these cases run under Triton's interpreter: TRITON_INTERPRET=1 (tests/test_triton_interpreter.py)"
    )

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from h3serve.accel import fused, triton_block
from h3serve.accel.linear import FP8, FP8_MAX, quantize_rows
from h3serve.accel.triton_block import _round
from h3serve.accel.triton_qk_norm_rope import ROUND_NORM, qk_norm_rope_fused
from h3serve.config import DiTConfig
from h3serve.model import ops
from h3serve.model.dit import MODULATIONS, TABLE_ROWS
from test_fused import inputs as qk_inputs

EXACT = (torch.float32, torch.float16)  # the dtypes the interpreter rounds as the GPU does
HIDDEN, FFN = DiTConfig().hidden_size, DiTConfig().ffn_hidden_size


def shapes(op: str, released: int) -> list[tuple[int, int]]:
    """(rows, width) cases that take each of `op`'s launch cases (`triton_block.LAUNCH`) down both of its paths: the
    released model's width, 300 (within every CHUNK: the row held in registers) and, where the released width is not,
    one past every CHUNK (the row in chunks, the last one ragged; two rows, as it is there for its path)."""
    chunks = [chunk for case, (chunk, _) in triton_block.LAUNCH.items() if case.split("+")[0] == op]
    assert min(chunks) > 300
    cases = [(8, released), (8, 300)]
    return cases if released > max(chunks) else [*cases, (2, max(chunks) + 300)]


# A row's scale is its amax times the float32 reciprocal of 448 in the kernels, which is how CUDA's quantize_rows
# divides by 448 (`triton_block._INV_FP8_MAX`); the CPU's division is a unit of the last place away on some rows.
INV_FP8_MAX = torch.tensor(1 / FP8_MAX, dtype=torch.float32)


def unit(dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s values in [1, 2)."""
    return {torch.float32: 2**-23, torch.float16: 2**-10}[dtype]


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many values of their dtype (float16 or float32) lie between got and want: units in the last place."""
    bits = {torch.float16: (torch.int16, 0x7FFF), torch.float32: (torch.int32, 0x7FFFFFFF)}
    int_dtype, magnitude = bits[want.dtype]

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.view(int_dtype).long()
        return torch.where(i < 0, -(i & magnitude), i)  # sign and magnitude -> one integer line, -0 = +0

    return (ordered(got) - ordered(want)).abs()


def mod_inputs(s: int, n: int, dtype: torch.dtype, seed: int = 0):
    """x, y (S, N), a norm weight, a padded modulation table and per-row indices into its used rows."""
    g = torch.Generator().manual_seed(seed)
    x, y = ((torch.randn(s, n, generator=g) * 2).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    table = (torch.randn(TABLE_ROWS, len(MODULATIONS) * n, generator=g) * 0.3).to(dtype)
    idx = torch.randint(0, 6, (s,), generator=g)  # two timesteps' rows, as a keyframe request has
    return x, y, w, table, idx


def assert_ulps(got: torch.Tensor, want: torch.Tensor, *, max_ulps: int, frac: float, what: str) -> None:
    """At most `max_ulps` units in the last place apart, on all but `frac` of the values (as the GPU tests count for
    bfloat16: a shift cancelling a product makes a small value whose unit is far below the product's)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    apart = ulps(got, want)
    far = (apart > max_ulps).float().mean().item()
    print(f"{what}: {(apart > 0).float().mean():.2e} differ, at most {apart.max()} ulps, {far:.2e} beyond {max_ulps}")
    assert far <= frac, what


@triton.jit
def _e4m3_kernel(x_ptr, q_ptr, n, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(q_ptr + cols, tl.load(x_ptr + cols, mask=cols < n).to(tl.float8e4nv), mask=cols < n)


def interpreted_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3 by the interpreter's cast, the one each kernel's e4m3 store makes here."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8)
    _e4m3_kernel[(triton.cdiv(x.numel(), 1024),)](x, q, x.numel(), BLOCK=1024)
    return q


def interpreted_quantize_rows(h: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(h)` as CUDA computes it, the e4m3 cast the interpreter's; `scales` instead of h's own."""
    if scales is None:
        scales = h.float().abs().amax(1, keepdim=True).clamp(min=1e-12) * INV_FP8_MAX
    return interpreted_e4m3((h.float() / scales).clamp(-FP8_MAX, FP8_MAX)), scales


def dequantized(quantized: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    q, scales = quantized
    return q.double() * scales


def assert_quantized(got: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, *, frac: float, what: str) -> None:
    """A kernel's (e4m3 rows, scales) against `h`, the reference's rows before `quantize_rows`.

    Scales: the amax of h's rows times float32(1/448), equal when h is the kernel's own bit for bit (`frac` 0), else
    within a few units of h's dtype (the amax of a row whose sum was the kernel's). Values: the interpreter's cast of
    h / scale (the kernel's scale, so that the values are compared, not the scale twice) clamped to +-448, byte for
    byte, on all but `frac` of them (where a value of h is a rounding step off the kernel's)."""
    q, scales = got
    assert q.dtype == FP8 and scales.shape == (h.shape[0], 1) and scales.dtype == torch.float32
    _, want_scales = interpreted_quantize_rows(h)
    if frac == 0:
        assert torch.equal(scales, want_scales), what
    else:  # the amax of a row whose sum was the kernel's: 4 units of h's dtype (GPU: 2e-2)
        torch.testing.assert_close(scales, want_scales, rtol=4 * unit(h.dtype), atol=0)
    want, _ = interpreted_quantize_rows(h, scales)
    differ = (q.view(torch.uint8) != want.view(torch.uint8)).float().mean().item()
    print(f"{what}: {differ:.2e} of e4m3 values differ")
    assert differ <= frac, what


# ---- the interpreter's roundings --------------------------------------------------------------------------------


@triton.jit
def _round_kernel(x_ptr, round_ptr, cast_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols, mask=cols < n)
    tl.store(round_ptr + cols, _round(x, DTYPE), mask=cols < n)
    tl.store(cast_ptr + cols, x.to(DTYPE).to(tl.float32), mask=cols < n)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy's, on purpose
def test_round_is_the_cast_and_float16_is_eager_rounding():
    """`_round`'s bfloat16 branch (back through the bits) is the cast there and back, and the interpreter rounds to
    float16 as torch does: what the float16 cases below rest on."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=g) * 10.0 ** torch.randint(-9, 6, (5000,), generator=g)  # subnormals to overflow
    x[:4] = torch.tensor([0.0, -0.0, 1 + 2**-11, 1 + 3 * 2**-11])  # ties to even in float16
    for dtype, tl_dtype in ((torch.bfloat16, tl.bfloat16), (torch.float16, tl.float16)):
        rounded, cast = torch.empty_like(x), torch.empty_like(x)
        _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, rounded, cast, x.numel(), DTYPE=tl_dtype, BLOCK=1024)
        assert torch.equal(rounded.view(torch.int32), cast.view(torch.int32)), dtype
        if dtype == torch.float16:
            assert torch.equal(rounded, x.half().float())


# ---- qk RMSNorm + rotary ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("s", "h", "d", "r"), [(128, 4, 128, 96), (37, 3, 64, 64), (33, 2, 32, 12)])
@pytest.mark.parametrize("dtype", EXACT, ids=str)
def test_qk_norm_rope_kernel_against_its_reference(s, h, d, r, dtype):
    q, k, qw, kw, cos, sin = qk_inputs(s, h, d, r, dtype)
    want = ops.qk_norm_rope_reference(q, k, qw, kw, 1e-5, cos, sin)
    got = qk_norm_rope_fused(q, k, qw, kw, 1e-5, cos.float(), sin.float(), round_norm=ROUND_NORM)
    for ref, out in zip(want, got, strict=True):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        diff = (out.double() - ref.double()).abs()
        relative = (diff.norm() / ref.double().norm()).item()
        # The eager ops' roundings, but the norm's sum and rsqrt are the kernel's: a rounding step apart on some
        # values, which the rotation's products and sum can carry to a few units.
        if dtype == torch.float32:  # the GPU test's bounds (H200: at most 9.5e-7; here 4.8e-7)
            assert diff.max() <= 4e-6 and relative <= 1e-6, f"max {diff.max():.3g}, relative {relative:.2e}"
        else:  # the GPU's bfloat16 bounds, 1e-4 of the values apart and 1e-2 relative, and 4 units on all but 1e-4
            # of them (a rotation's sum that cancels makes a small value); here 7.6e-5 differ, by 4 units at most
            assert_ulps(out, ref, max_ulps=4, frac=1e-4, what=f"qk float16 {s}x{h}x{d} R={r}")
            assert (diff > 0).float().mean() <= 1e-4 and relative <= 1e-2, f"relative {relative:.2e}"
    # The exact pass (the eager profile's): torch's rms_norm, then the kernel's rotary alone: bit for bit.
    normed = F.rms_norm(q, (d,), qw, 1e-5), F.rms_norm(k, (d,), kw, 1e-5)
    exact = qk_norm_rope_fused(*normed, qw, kw, 1e-5, cos.float(), sin.float(), norm=False)
    assert all(torch.equal(a, b) for a, b in zip(exact, want, strict=True))


# ---- the block passes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize(("s", "n"), shapes("norm_modulate", HIDDEN))
@pytest.mark.parametrize("dtype", EXACT, ids=str)
def test_norm_modulate_kernel_against_its_reference(dtype, s, n, residual, quantize):
    x, y, w, table, idx = mod_inputs(s, n, dtype)
    args = (x, y if residual else None, w, table, idx, 1e-6, 2, 3, 4)
    want_x, want_h, _ = fused.norm_modulate_reference(*args, False)
    got = triton_block.norm_modulate_op(*args, quantize, True)
    if residual:  # x + gate * y, two roundings, the reference's own
        assert torch.equal(got[0], want_x)
    else:
        assert got[0].numel() == 0
    # The norm's sum and rsqrt are the kernel's: a rounding step on some values, which the modulation carries.
    if quantize:  # GPU: 1e-4 of the e4m3 values apart (H200: 4.1e-7); here none
        assert_quantized(got[1:], want_h, frac=1e-4, what=f"norm_modulate e4m3 {dtype} {n}")
    elif dtype == torch.float16:  # the GPU's bound: 4 units on all but 1e-4 of the values (here 4.7e-5 differ)
        assert_ulps(got[1], want_h, max_ulps=4, frac=1e-4, what=f"norm_modulate {dtype} {n}")
    else:  # float32's units are too fine for a count of values (10-30% differ): 8 units of the value, or of 1 where
        # a shift cancels the product (the terms are of unit scale; here at most 4)
        torch.testing.assert_close(got[1], want_h, rtol=8 * 2**-23, atol=8 * 2**-23)
    # float32 intermediates (the FP8 profile's): the GPU test's relative bounds, against the reference's values or
    # their e4m3 rows (here at most 5.1e-4 and 1.5e-2 in float16, 8e-8 and 4.1e-4 in float32).
    loose = triton_block.norm_modulate_op(*args, quantize, False)
    if quantize:
        out, ref = loose[1].double() * loose[2], dequantized(interpreted_quantize_rows(want_h))
    else:
        out, ref = loose[1].double(), want_h.double()
    assert ((out - ref).norm() / ref.norm()).item() <= (1e-2 if not quantize else 4e-2)


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize(("s", "n"), shapes("swiglu", FFN))
@pytest.mark.parametrize("dtype", EXACT, ids=str)
def test_swiglu_kernel_against_its_reference(dtype, s, n, quantize):
    f = (torch.randn(s, 2 * n, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    want, _ = fused.swiglu_reference(f, False)
    got = triton_block.swiglu_op(f, quantize, True)
    # Eager's two roundings (GPU: equal). The kernel's exp is numpy's and the CPU reference's is ATen's vectorized
    # one, a unit of float32 apart on some values: a few float32 units of the result (here at most 4), and the SiLU's
    # float16 rounding moved on a few values, by a unit, which the product makes two at most (here 1.6e-4 of them,
    # none in e4m3).
    if quantize:
        assert_quantized(got, want, frac=1e-3 if dtype == torch.float16 else 1e-4, what=f"swiglu e4m3 {dtype} {n}")
    elif dtype == torch.float32:
        assert_ulps(got[0], want, max_ulps=4, frac=0, what=f"swiglu {dtype} {n}")
    else:
        assert_ulps(got[0], want, max_ulps=2, frac=0, what=f"swiglu {dtype} {n}")
        assert (got[0] != want).float().mean() <= 1e-3


@pytest.mark.parametrize(("s", "n"), shapes("quantize_rows", HIDDEN))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_quantize_rows_kernel_is_quantize_rows(dtype, s, n):
    """No rounding to the activations' dtype in this one: loads and float32 only, exact for bfloat16 too."""
    x = (torch.randn(s, n, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    got = triton_block.quantize_rows_op(x)
    assert_quantized(got, x, frac=0, what=f"quantize_rows {dtype} {n}")
    _, scales = quantize_rows(x)  # the CPU's division: a unit of float32 at most
    torch.testing.assert_close(got[1], scales, rtol=2**-23, atol=0)


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize(("s", "n"), shapes("modulate", HIDDEN))
@pytest.mark.parametrize("dtype", EXACT, ids=str)
def test_modulate_and_gated_residual_kernels_are_their_references(dtype, s, n, quantize):
    """No sum in either: eager's roundings give eager's values, every one (as on the GPU)."""
    x, y, w, table, idx = mod_inputs(s, n, dtype)
    normed = F.rms_norm(x, (n,), w, 1e-6)
    want, _ = fused.modulate_reference(normed, table, idx, 3, 4, False)
    got = triton_block.modulate_op(normed, table, idx, 3, 4, quantize)
    if quantize:
        assert_quantized(got, want, frac=0, what=f"modulate e4m3 {dtype} {n}")
    else:
        assert torch.equal(got[0], want)
    gated = triton_block.gated_residual_op(x, y, table, idx, 2)
    assert torch.equal(gated, fused.gated_residual_reference(x, y, table, idx, 2))


# ---- the passes as the block calls them -------------------------------------------------------------------------

PASS_OPS = {field.name: getattr(triton_block, f"{field.name}_op") for field in dataclasses.fields(fused.BlockPasses)}


def test_each_op_takes_its_pass_signature():
    """Each op's registered schema takes its pass's parameters (`fused.BlockPasses`' Protocols), names and order:
    `block_forward` calls an op by the names it calls the reference by."""
    hints = typing.get_type_hints(fused.BlockPasses)
    for name, op in PASS_OPS.items():
        schema = [argument.name for argument in getattr(torch.ops.h3serve, name).default._schema.arguments]
        assert schema == list(inspect.signature(hints[name].__call__).parameters)[1:], name
        assert getattr(fused.BlockPasses.from_kernels(PASS_OPS), name) is op


@pytest.mark.parametrize("composition", [fused.exact_passes, fused.compile_passes])
@pytest.mark.parametrize("dtype", EXACT, ids=str)
def test_the_block_over_the_kernels(dtype, composition):
    """`block_forward` over the ops (`BlockPasses.from_kernels`, each called by keyword) against `Block.forward`: the
    exact passes' only difference is the SwiGLU's exp (numpy's here, ATen's in the reference: a float32 unit on some
    values), the compiled passes' the norm's sum too (`test_norm_modulate_kernel_against_its_reference`)."""
    from h3serve.model.dit import H3DiT
    from h3serve.model.tiny import TINY_DIT, randomize

    dit = randomize(H3DiT(TINY_DIT), seed=3, keep=("rope.inv_freq",)).to(dtype).eval().requires_grad_(False)
    block = dit.blocks[1]
    g = torch.Generator().manual_seed(0)
    hidden, d = TINY_DIT.hidden_size, TINY_DIT.attention_head_dim
    x = (torch.randn(45, hidden, generator=g) * 2).to(dtype)
    table = (torch.randn(TABLE_ROWS, len(MODULATIONS) * hidden, generator=g) * 0.3).to(dtype)
    indices = torch.randint(0, 6, (45,), generator=g)
    rope = ops.rotary_table(torch.rand(45, (d * 3 // 4) // 2, generator=g) * 30)
    passes = composition(fused.BlockPasses.from_kernels(PASS_OPS))
    with torch.no_grad():
        want = block(x, table, indices, rope)
        got = fused.block_forward(block, x, table, indices, rope, passes, eager_rounding=True)
    assert got.dtype == want.dtype and got.shape == want.shape
    relative = ((got.double() - want.double()).norm() / want.double().norm()).item()
    print(f"block over the kernels, {composition.__name__} {dtype}: relative {relative:.2e}")
    assert relative <= (1e-6 if dtype == torch.float32 else 1e-3)  # here at most 3.5e-8 and 0


# ---- FP8 attention's passes (accel/triton_fp8_attention.py) ------------------------------------------------------


@pytest.mark.parametrize("rows", [5, 64, 150])  # within one block, one block exactly, three blocks the last ragged
@pytest.mark.parametrize("dtype", EXACT, ids=str)
def test_fp8_attention_passes_against_torchs_ops(dtype, rows):
    """The statistics pass and the quantizing pass over (B, H, S, D) views as a block hands them (q, k contiguous
    rows, v a slice of the fused projection), against `fp8_attention.quantize_ops`: the amax, maxima and minima
    exact, the sums within float32's reordering, the e4m3 bytes as the interpreter's cast of the same products."""
    from h3serve.accel import fp8_attention, triton_fp8_attention

    g = torch.Generator().manual_seed(9)
    heads, d = 3, 16
    fused_rows = (torch.randn(rows, 3 * heads * d, generator=g) * 2).to(dtype)
    fused_rows[:, heads * d :] += (torch.randn(2 * heads * d, generator=g) * 4).to(dtype)  # k and v offsets
    q, k, v = (t.unflatten(-1, (heads, d))[None].transpose(1, 2) for t in fused_rows.chunk(3, dim=-1))
    q, k = q.contiguous(), k.contiguous()
    qa, k_stats, v_stats = triton_fp8_attention.stats(q, k, v)
    assert torch.equal(qa.amax(dim=(0, 2)), q.float().abs().amax(dim=(0, 2, 3)))
    for x, st in ((k, k_stats), (v, v_stats)):
        assert torch.equal(st[1].amax(dim=2), x.float().amax(dim=2))
        assert torch.equal(st[2].amin(dim=2), x.float().amin(dim=2))
        torch.testing.assert_close(st[0].sum(dim=2) / rows, x.float().mean(dim=2), rtol=1e-6, atol=1e-6)
    # the scales from the partials are the ops' scales (the shifted amax a rounding of the subtraction apart)
    got = fp8_attention._quantize_fused(q, k, v)
    want = fp8_attention.quantize_ops(q, k, v)
    for name in ("q", "k", "v", "descale", "v_mean"):
        torch.testing.assert_close(getattr(got[3], name), getattr(want[3], name), rtol=1e-6, atol=1e-6)
    # the bytes: each operand less its mean, times its head's scale (the kernel's own), saturated, then the cast
    s = got[3]
    k_mean = k_stats[0].sum(dim=2)[:, :, None, :] / rows
    head = lambda t: t[None, :, None, None]  # noqa: E731
    products = [q.float() * head(s.q), (k.float() - k_mean) * head(s.k), (v.float() - s.v_mean) * head(s.v)]
    for a, product in zip(got[:3], products, strict=True):
        assert a.dtype == FP8 and a.shape == q.shape and a.transpose(1, 2).is_contiguous()
        expected = interpreted_e4m3(product.clamp(-FP8_MAX, FP8_MAX).transpose(1, 2)).transpose(1, 2)
        assert torch.equal(a.view(torch.uint8), expected.view(torch.uint8)), f"{dtype} {rows}"


# ---- the video decoder's passes (accel/triton_decoder.py) ------------------------------------------------------------
def torch_cuda_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row's 1 / rms as torch's CUDA rms_norm adds it up (`vectorized_layer_norm_kernel`: 128 threads, thread t
    reading the 4-channel vectors t, t + 128, ... and adding each square with one fused multiply-add in channel order;
    the 32 lanes of each warp halving, then the 4 warps; an IEEE mean), written out here so that the kernel's order is
    held to it. The reciprocal square root is the interpreter's 1 / sqrt (the GPU's is CUDA's rsqrtf, which the GPU
    tier holds to torch itself)."""
    from triton.runtime.interpreter import _interpreter

    rows = x.float().reshape(-1, x.shape[-1]).numpy()
    m, n = rows.shape
    lanes = min(128, n // 4)
    acc = np.zeros((m, lanes), np.float32)
    for j in range(n // (4 * lanes)):
        for e in range(4):
            v = np.ascontiguousarray(rows[:, (j * lanes + np.arange(lanes)) * 4 + e])
            acc = _interpreter.fma_fp32(v, v, acc)
    warps = max(1, lanes // 32)
    s = acc.reshape(m, warps, lanes // warps)
    while s.shape[2] > 1:  # lane l takes lane l + half, within each warp
        s = s[:, :, : s.shape[2] // 2] + s[:, :, s.shape[2] // 2 :]
    s = s[:, :, 0]
    while s.shape[1] > 1:  # warp w takes warp w + half
        s = s[:, : s.shape[1] // 2] + s[:, s.shape[1] // 2 :]
    rstd = np.float32(1) / np.sqrt(s[:, 0] / np.float32(n) + np.float32(eps))
    return torch.from_numpy(rstd).reshape(*x.shape[:-1], 1)


def decoder_rows(s: int, n: int, seed: int) -> torch.Tensor:
    """s rows of n channels whose scales span four decades (the sums round in many places)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, s, n, generator=g) * torch.logspace(-2, 2, s)[None, :, None]


@pytest.mark.parametrize("n", [2048, 256, 64])  # the released blocks' width; two warps' worth; a head's
@pytest.mark.parametrize("stream", [torch.float32, torch.float16])  # the first block's norm reads float16
def test_the_decoder_norm_adds_in_torchs_order(n, stream):
    from h3serve.accel import triton_decoder

    x = decoder_rows(37, n, seed=n).to(stream)  # 37 rows: the last program's rows part masked
    w = 1 + 0.3 * torch.randn(n, generator=torch.Generator().manual_seed(1))
    got = triton_decoder.norm(x, w, 1e-5)
    want = w * (torch_cuda_rstd(x, 1e-5) * x.float())
    assert got.dtype == torch.float32 and torch.equal(got, want), (n, stream)
    # and close to torch's own CPU norm, which adds in another order
    assert_ulps(got, F.rms_norm(x.float(), (n,), w, 1e-5), max_ulps=8, frac=0.0, what=f"norm {n}")


def test_the_decoder_residual_norm_is_the_add_then_the_norm():
    from h3serve.accel import triton_decoder
    from h3serve.model.video_vae import REFERENCE_PASSES

    x = decoder_rows(37, 2048, seed=2)
    g = torch.Generator().manual_seed(3)
    y = torch.randn(1, 37, 2048, generator=g).to(torch.float16)
    scale, w = 0.1 * torch.randn(2048, generator=g), 1 + 0.3 * torch.randn(2048, generator=g)
    stream, normed = triton_decoder.residual_norm(x, y, scale, w, 1e-5)
    want = REFERENCE_PASSES.residual(x, y, scale)
    assert stream.dtype == torch.float32 and torch.equal(stream, want)
    assert torch.equal(normed, w * (torch_cuda_rstd(want, 1e-5) * want))
    assert torch.equal(triton_decoder.residual(x, y, scale), want)


@pytest.mark.parametrize("dtype", EXACT)
def test_the_decoder_qk_pass_is_the_norm_then_the_rotary(dtype):
    """q and k read in place from the fused projection's rows (per head [q k v]), normed in torch's order, rounded,
    rotated on the leading 48 of 64 channels as `apply_rotary` rounds: bit for bit; a contiguous copy the same."""
    from h3serve.accel import triton_decoder
    from h3serve.model.ops import apply_rotary, rotary_table

    s, heads = 9, 3
    qkv = decoder_rows(s * heads, 192, seed=4).view(1, s, heads, 192).to(dtype)
    q, k = qkv[..., :64], qkv[..., 64:128]
    cos, sin = rotary_table(torch.randn(s, 24, generator=torch.Generator().manual_seed(5)) * 3)
    want = [apply_rotary((torch_cuda_rstd(t, 1e-5) * t.float()).to(dtype), cos, sin) for t in (q, k)]
    for got in (
        triton_decoder.qk(q, k, 1e-5, cos, sin),
        triton_decoder.qk(q.contiguous(), k.contiguous(), 1e-5, cos, sin),
    ):
        assert all(a.dtype == dtype and a.is_contiguous() and torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_decoder_swiglu_pass():
    """up * silu(gate), silu as g / (1 + exp(-g)): numpy's exp here against torch's CPU silu, within a unit of
    float16 (the GPU tier holds libdevice's expf to torch's CUDA silu bit for bit)."""
    from h3serve.accel import triton_decoder
    from h3serve.model.video_vae import REFERENCE_PASSES

    f = (torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(6)) * 3).to(torch.float16)
    assert_ulps(triton_decoder.swiglu(f), REFERENCE_PASSES.swiglu(f), max_ulps=1, frac=0.0, what="swiglu")
