"""The fused block passes (`h3serve.accel.fused.block_forward`): the restructured block against `Block.forward`, bit for
bit, over the reference passes (CPU); each Triton pass against its reference, and the block over the kernels,
eager and compiled, against `Block.forward` (marked `gpu`)."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
import torch
import torch.nn.functional as F

from h3serve.accel import fused
from h3serve.accel.linear import FP8, FP8_MAX, quantize_blocks, quantize_rows
from h3serve.config import DiTConfig
from h3serve.model import ops
from h3serve.model.dit import MODULATIONS, TABLE_ROWS, Block, H3DiT
from h3serve.model.tiny import TINY_DIT, randomize

GPU = pytest.mark.skipif(not (torch.cuda.is_available() and fused.available()), reason="needs a CUDA GPU and Triton")


def kernels():
    return fused.triton_kernels()


def block_inputs(block: Block, s: int, device: str = "cpu", seed: int = 0):
    """x (S, hidden), a padded modulation table, per-row indices into its used rows, and a rotary table."""
    g = torch.Generator().manual_seed(seed)
    hidden = block.norm1.weight.shape[0]
    d = block.attn.q_norm.weight.shape[0]
    x = (torch.randn(s, hidden, generator=g) * 2).to(torch.bfloat16)
    table = (torch.randn(TABLE_ROWS, len(MODULATIONS) * hidden, generator=g) * 0.3).to(torch.bfloat16)
    indices = torch.randint(0, 6, (s,), generator=g)  # two timesteps' rows, as a keyframe request has
    cos, sin = ops.rotary_table(torch.rand(s, (d * 3 // 4) // 2, generator=g) * 30)
    return [t.to(device) for t in (x, table, indices)] + [(cos.to(device), sin.to(device))]


def tiny_blocks(config=TINY_DIT, device: str = "cpu") -> H3DiT:
    dit = randomize(H3DiT(config), seed=3, keep=("rope.inv_freq",))
    return dit.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)


@pytest.mark.parametrize("linear", ["BF16", "CUTLASS"])
def test_the_restructured_block_is_block_forward_bit_for_bit(linear):
    dit = tiny_blocks()
    if linear == "CUTLASS":
        quantize_blocks(dit)  # torch._scaled_mm runs on the CPU too
    block = dit.blocks[1]
    x, table, indices, rope = block_inputs(block, 45)
    with torch.no_grad():
        want = block(x, table, indices, rope)
        got = fused.block_forward(block, x, table, indices, rope, passes=fused.REFERENCES)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("linear", ["BF16", "CUTLASS"])
@pytest.mark.parametrize("composition", [fused.exact_passes, fused.compile_passes])
def test_the_exact_passes_are_block_forward_bit_for_bit(linear, composition):
    """The eager profile's composition (torch's rms_norm between the modulation and gated residual passes, the block's
    last residual and the SwiGLU gate as passes of their own), over the reference passes; on the GPU the same over the
    kernels (`test_the_exact_passes_on_the_gpu_are_the_reference_ops`). The compiled profile's composition (the BF16
    SwiGLU and the last residual the plain ops) too."""
    dit = tiny_blocks()
    if linear == "CUTLASS":
        quantize_blocks(dit)
    block = dit.blocks[1]
    x, table, indices, rope = block_inputs(block, 45)
    with torch.no_grad():
        want = block(x, table, indices, rope)
        got = fused.block_forward(block, x, table, indices, rope, passes=composition(fused.REFERENCES))
    assert torch.equal(got, want)


def test_each_pass_has_one_signature():
    """Every field of `BlockPasses` is typed by its pass's Protocol, whose parameters (names and order: the Triton
    op's schema, tests/interpreted_kernels.py) the reference and the exact composition take; `block_forward` calls
    every pass by those names."""
    hints = typing.get_type_hints(fused.BlockPasses)
    for field in dataclasses.fields(fused.BlockPasses):
        protocol = hints[field.name]
        want = list(inspect.signature(protocol.__call__).parameters)[1:]  # without self
        for passes in (fused.REFERENCES, fused.exact_passes(fused.REFERENCES), fused.compile_passes(fused.REFERENCES)):
            assert list(inspect.signature(getattr(passes, field.name)).parameters) == want, field.name


def test_the_references_compute_what_they_name():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(9, 16, generator=g), torch.randn(9, 16, generator=g)
    w = 1 + 0.1 * torch.randn(16, generator=g)
    table = torch.randn(4, 6 * 16, generator=g)
    idx = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0, 0])
    mod = table.view(4, 6, 16)[idx]  # (rows, chunk, hidden)
    new_x, h, scales = fused.norm_modulate_reference(x, y, w, table, idx, 1e-6, 2, 3, 4, False)
    want_x = x + mod[:, 2] * y
    assert torch.allclose(new_x, want_x)
    norm = want_x / torch.sqrt((want_x**2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(h, norm * (1 + mod[:, 4]) + mod[:, 3], atol=1e-6) and scales.shape == (0, 1)
    _, q, scales = fused.norm_modulate_reference(x, None, w, table, idx, 1e-6, 0, 0, 1, True)
    assert q.dtype == FP8 and scales.shape == (9, 1)
    dequantized = q.float() * scales
    h = F.rms_norm(x, (16,), w, 1e-6) * (1 + mod[:, 1]) + mod[:, 0]
    assert torch.allclose(scales[:, 0], h.abs().amax(-1) / FP8_MAX)
    assert ((dequantized - h).abs() <= h.abs().amax(-1, keepdim=True) / 16).all()  # e4m3: 3 mantissa bits
    f = torch.randn(9, 32, generator=g)
    h, _ = fused.swiglu_reference(f, False)
    assert torch.allclose(h, f[:, 16:] * f[:, :16] * torch.sigmoid(f[:, :16]))
    h, scales = fused.modulate_reference(x, table, idx, 5, 0, False)
    assert torch.allclose(h, x * (1 + mod[:, 0]) + mod[:, 5]) and scales.shape == (0, 1)
    assert torch.allclose(fused.gated_residual_reference(x, y, table, idx, 1), x + mod[:, 1] * y)


def test_compile_takes_the_body_its_block_stack_gives():
    from h3serve.accel.blocks import BlockStack
    from h3serve.accel.compile import compile_repeated_blocks, uncompile_repeated_blocks

    dit = tiny_blocks()
    calls = []

    def forward(block, x, table, indices, rope):
        calls.append(block)
        return fused.block_forward(block, x, table, indices, rope, passes=fused.REFERENCES)

    x, table, indices, rope = block_inputs(dit.blocks[0], 20)
    want = dit.blocks[0](x, table, indices, rope)
    BlockStack.of(dit).set_body(Block, forward)
    counter = compile_repeated_blocks(dit, backend="eager")
    try:
        got = dit.blocks[0](x, table, indices, rope)
    finally:
        uncompile_repeated_blocks(dit)
    assert calls and counter.graphs == 1 and torch.equal(got, want)
    assert BlockStack.of(dit).describe() == "Block: forward"  # the body stays when the compile goes


def test_without_triton_the_blocks_run_the_reference_ops():
    from h3serve.accel.apply import block_passes
    from h3serve.accel.profile import Profile

    for execution in ("eager", "compile"):
        qk, body = block_passes(Profile.for_device("cuda", execution=execution), enabled=False)
        assert qk is ops.qk_norm_rope_reference and body is None


# ---- on the GPU ----------------------------------------------------------------------------------------------------

HIDDEN, FFN = DiTConfig().hidden_size, DiTConfig().ffn_hidden_size  # the released block's widths


def mod_inputs(s: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, y = ((torch.randn(s, n, generator=g) * 2).to(torch.bfloat16).cuda() for _ in range(2))
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16).cuda()
    table = (torch.randn(TABLE_ROWS, 6 * n, generator=g) * 0.3).to(torch.bfloat16).cuda()
    idx = torch.randint(0, 6, (s,), generator=g).cuda()
    return x, y, w, table, idx


def assert_close_rows(got, want, *, max_ulps: float, frac: float, what: str):
    """bf16 activations: at most `max_ulps` units of the last place (relative to each value) apart, on at most `frac`
    of the values."""
    got, want = got.float(), want.float()
    diff = (got - want).abs()
    ulp = want.abs().clamp(min=2**-20) * 2**-7  # bf16 keeps 8 significant bits: a unit is 2^-7 of the value or less
    far = diff > ulp * max_ulps
    print(f"{what}: {(diff > 0).float().mean():.2e} differ, {far.float().mean():.2e} beyond {max_ulps} ulp")
    assert far.float().mean() <= frac, what


def assert_quantized_close(got, want, what: str):
    """(e4m3 rows, scales) against the reference's: scales within a bf16 rounding of the row's amax; values one e4m3
    step of their own apart at most (3 mantissa bits: an eighth of the value, or the subnormal spacing), or 4 scales
    (4/448 of the row's amax) where a modulation's shift cancels the norm's product: one bf16 unit of a product as
    large as the amax is 1.75 scales, several steps of the small result (3.1 steps seen on the H200); on at most 1e-4
    of the values (on the H200: equal scales, 4.1e-7 of the values apart)."""
    (q, s), (rq, rs) = got, want
    assert q.dtype == FP8 and s.shape == rs.shape
    torch.testing.assert_close(s, rs, rtol=2e-2, atol=0)  # a scale moves only when the row's amax rounds differently
    a, b = q.float() * s, rq.float() * rs
    step = torch.maximum(b.abs() / 8, rs * 2**-9)  # one e4m3 step of each value (2^-9: the subnormal spacing)
    step = torch.maximum(step, rs * 4)  # the cancelled values' slack
    diff = (a - b).abs()
    worst = (diff / step).amax(-1).argmax()
    steps = (diff / step)[worst].max().item()
    print(f"{what}: {(q.float() != rq.float()).float().mean():.2e} of e4m3 values differ; worst row {worst.item()}: "
          f"{steps:.3g} steps, {(diff / rs).max().item():.3g} scales at most; scales {s[worst].item():.6g} / "
          f"{rs[worst].item():.6g}")  # fmt: skip
    assert (diff <= step * 1.001).all(), what
    assert (q.float() != rq.float()).float().mean() <= 1e-4, what


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("quantize", [False, True])
def test_norm_modulate_kernel_against_its_reference(residual, quantize):
    x, y, w, table, idx = mod_inputs(6435, HIDDEN)
    args = (x, y if residual else None, w, table, idx, 1e-6, 2, 3, 4, quantize)
    want = fused.norm_modulate_reference(*args)
    got = kernels()["norm_modulate"](*args, True)
    if residual:  # the residual stream: two roundings, the reference's own
        gate = table.chunk(6, dim=-1)[2].index_select(0, idx).float()
        by_hand = (x.float() + (gate * y.float()).to(torch.bfloat16).float()).to(torch.bfloat16)
        print(f"residual: reference = by hand on {(want[0] == by_hand).float().mean():.4f}, kernel = by hand on "
              f"{(got[0] == by_hand).float().mean():.4f}")  # fmt: skip
        assert torch.equal(got[0], want[0])  # the same two roundings (on the H200: no value differs)
    if quantize:
        assert_quantized_close(got[1:], want[1:], "norm_modulate e4m3")
    else:  # the norm's sum and rsqrt are the kernel's: a rounding step on some values, carried by the modulation
        assert_close_rows(got[1], want[1], max_ulps=4, frac=1e-4, what="norm_modulate")  # H200: 3.4e-6 differ
    again = kernels()["norm_modulate"](*args, True)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, again, strict=True))  # deterministic
    loose = kernels()["norm_modulate"](*args, False)  # float32 intermediates (the FP8 profile's)
    ref = want[1].float() if not quantize else want[1].float() * want[2]
    out = loose[1].float() if not quantize else loose[1].float() * loose[2]
    assert ((out - ref).norm() / ref.norm()).item() <= (1e-2 if not quantize else 4e-2)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [False, True])
def test_swiglu_kernel_against_its_reference(quantize):
    g = torch.Generator().manual_seed(5)
    f = (torch.randn(6435, 2 * FFN, generator=g) * 2).to(torch.bfloat16).cuda()
    want = fused.swiglu_reference(f, quantize)
    got = kernels()["swiglu"](f, quantize, True)
    if quantize:
        assert_quantized_close(got, want, "swiglu e4m3")
    else:
        assert torch.equal(got[0], want[0])  # eager's two roundings (on the H200: no value differs)


@GPU
@pytest.mark.gpu
def test_quantize_rows_kernel_is_quantize_rows():
    x = (torch.randn(6435, 7168, generator=torch.Generator().manual_seed(6)) * 3).to(torch.bfloat16).cuda()
    q, s = kernels()["quantize_rows"](x)
    rq, rs = quantize_rows(x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


MID = dataclasses.replace(TINY_DIT, hidden_size=1024, num_attention_heads=8, attention_head_dim=128,
                          ffn_hidden_size=2816, num_layers=2, adaln_out_features=18 * 1024,
                          final_adaln_out_features=2 * 1024, rope_inv_freq_len=16)  # fmt: skip


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("linear", ["BF16", "CUTLASS"])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_fused_block_against_block_forward(linear, compiled):
    from h3serve.accel import attention
    from h3serve.accel.apply import set_block_passes

    dit = tiny_blocks(MID, "cuda")
    attention.set_kernel(dit, "CUDNN_ATTN")
    set_block_passes(dit, fused.qk_kernel(kernels(), exact=False), None)  # the reference and the body share it
    if linear == "CUTLASS":
        quantize_blocks(dit)
    block = dit.blocks[0]
    x, table, indices, rope = block_inputs(block, 3000, "cuda")
    passes = fused.compile_passes(fused.BlockPasses.from_kernels(kernels()))
    fn = fused.block_body(passes, eager_rounding=linear == "BF16")
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    with torch.no_grad():
        want = fused.block_forward(block, x, table, indices, rope, passes=fused.REFERENCES)
        assert torch.equal(want, block(x, table, indices, rope))  # the restructuring, here too
        got, again = fn(block, x, table, indices, rope), fn(block, x, table, indices, rope)
    assert torch.equal(got, again)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    print(f"{linear} compiled={compiled}: relative error {err:.2e} against Block.forward")
    assert err <= (2.5e-3 if linear == "BF16" else 1e-2)  # H200: 3.8e-4 / 1.2e-3 (eager / compiled), 5.1e-3


@GPU
@pytest.mark.gpu
def test_a_non_finite_activation_stays_non_finite_through_the_quantizing_passes():
    """A NaN must reach the output as the reference's does (the decoder refuses non-finite latents), not turn into a
    finite e4m3 value by a clamp."""
    x, _, w, table, idx = mod_inputs(64, HIDDEN)
    x[3, 10] = float("nan")
    f = (torch.randn(64, 2 * FFN, generator=torch.Generator().manual_seed(7)) * 2).to(torch.bfloat16).cuda()
    f[5, 20] = float("nan")
    for got, row in (
        (kernels()["norm_modulate"](x, None, w, table, idx, 1e-6, 0, 0, 1, True, False)[1:], 3),
        (kernels()["swiglu"](f, True, False), 5),
        (kernels()["quantize_rows"](x), 3),
    ):
        q, scales = got
        dequantized = q.float() * scales
        assert not dequantized[row].isfinite().all()
        assert dequantized[row + 1].isfinite().all()


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [False, True])
def test_modulate_and_gated_residual_kernels_are_their_references(quantize):
    """No sum in either: eager's roundings give eager's values, every one."""
    x, y, w, table, idx = mod_inputs(6435, HIDDEN)
    n = F.rms_norm(x, (HIDDEN,), w, 1e-6)
    want = fused.modulate_reference(n, table, idx, 3, 4, quantize)
    got = kernels()["modulate"](n, table, idx, 3, 4, quantize)
    if quantize:
        assert_quantized_close(got, want, "modulate e4m3")
        assert torch.equal(got[1], want[1])  # the scales: the amax of eager's own values
    else:
        assert torch.equal(got[0], want[0])
    assert torch.equal(kernels()["gated_residual"](x, y, table, idx, 2),
                       fused.gated_residual_reference(x, y, table, idx, 2))  # fmt: skip


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize(("s", "h", "d", "r"), [(6435, 56, 128, 96), (37, 3, 64, 64)])
def test_the_exact_qk_pass_is_the_reference(s, h, d, r):
    from tests.test_fused import inputs

    q, k, qw, kw, cos, sin = inputs(s, h, d, r, torch.bfloat16, "cuda")
    want = ops.qk_norm_rope_reference(q, k, qw, kw, 1e-6, cos, sin)
    got = fused.qk_kernel(kernels(), exact=True)(q, k, qw, kw, 1e-6, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def dit_forward(dit: H3DiT, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """One whole forward of a keyframe request at 384x384, 39 frames (about 2,000 rows), two timesteps."""
    from h3serve.pipeline.layout import MediaGeometry, build_layout
    from h3serve.pipeline.sampling import bind_model

    g = torch.Generator().manual_seed(seed)
    cfg = dit.config
    layout = build_layout([1] * 40, MediaGeometry.from_pixels(384, 384, 39), ("first",))
    model = bind_model(dit, layout, torch.randn(40, cfg.text_dim, generator=g))
    video = torch.randn(layout.video_indices.numel(), cfg.video_patch_dim, generator=g).cuda()  # keyframe rows too
    audio = torch.randn(layout.audio_indices.numel(), cfg.audio_latents_dim, generator=g).cuda()
    t, idx = layout.timestep_plan(0.3, 0.4)
    return model(video, audio, t.cuda(), idx.cuda(), 0)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("linear", ["BF16", "CUTLASS"])
def test_the_exact_passes_on_the_gpu_are_the_reference_ops(linear):
    """The eager profile on CUDA (`accel.apply`: the exact passes): a whole DiT forward at the released head layout,
    bit for bit the reference ops' with BF16 linears; with FP8 ones the e4m3 values may differ by a step where the
    reference's own float32 product rounds differently (`assert_quantized_close`), so: close."""
    from h3serve.accel import attention
    from h3serve.accel.apply import block_passes, set_block_passes
    from h3serve.accel.blocks import BlockStack
    from h3serve.accel.profile import Profile

    dit = tiny_blocks(MID, "cuda")
    attention.set_kernel(dit, "CUDNN_ATTN")
    if linear == "CUTLASS":
        quantize_blocks(dit)
    with torch.no_grad():
        want = dit_forward(dit)
        set_block_passes(dit, *block_passes(Profile.for_device("cuda", execution="eager", linear=linear), True))
        BlockStack.of(dit).install(dit)
        assert BlockStack.of(dit).describe() == "Block: block_forward"
        got, again = dit_forward(dit), dit_forward(dit)
    for a, b, c in zip(got, want, again, strict=True):
        assert torch.equal(a, c)
        if linear == "BF16":
            assert torch.equal(a, b)
        else:
            err = ((a.double() - b.double()).norm() / b.double().norm()).item()
            print(f"CUTLASS eager passes against the reference ops: {err:.2e}")
            assert err <= 2e-3
