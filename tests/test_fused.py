"""The fused qk-RMSNorm + rotary kernel against its reference op (`ops.qk_norm_rope_reference`), and the seam it
plugs into. The reference's arithmetic is checked on the CPU against the formula in float64; the Triton kernel, which
needs a CUDA device, against the reference on random data of the DiT's shapes (marked `gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3serve.accel import fused
from h3serve.model import ops
from h3serve.model.dit import H3DiT
from h3serve.model.tiny import TINY_DIT, tiny_dit


def inputs(s: int, h: int, d: int, r: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """q, k as views of one fused QKV projection (row stride 3*H*D), the weights, and a rotary table of R."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(s, 3 * h * d, generator=g) * 3).to(dtype).to(device)
    q, k, _ = (t.unflatten(-1, (h, d)) for t in qkv.chunk(3, dim=-1))
    qw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(device)
    kw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(device)
    angles = torch.rand(s, r // 2, generator=g) * 40
    cos, sin = ops.rotary_table(angles)
    return q, k, qw, kw, cos.to(device), sin.to(device)


def formula(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RMSNorm then rotate-half on the leading R channels, in float64 from the written-out definition."""
    x, w, cos, sin = x.double(), w.double(), cos.double(), sin.double()
    n = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    r = cos.shape[-1]
    out = n.clone()
    for c in range(r // 2):
        a, b = n[..., c], n[..., c + r // 2]
        out[..., c] = a * cos[:, None, c] - b * sin[:, None, c]
        out[..., c + r // 2] = b * cos[:, None, c + r // 2] + a * sin[:, None, c + r // 2]
    return out


def test_reference_is_the_formula():
    q, k, qw, kw, cos, sin = inputs(7, 3, 16, 12, torch.float32)
    rq, rk = ops.qk_norm_rope_reference(q, k, qw, kw, 1e-5, cos, sin)
    torch.testing.assert_close(rq.double(), formula(q, qw, 1e-5, cos, sin), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rk.double(), formula(k, kw, 1e-5, cos, sin), rtol=1e-5, atol=1e-5)
    # the channels past R are normalised, not rotated
    torch.testing.assert_close(rq[..., 12:], F.rms_norm(q, (16,), qw, 1e-5)[..., 12:])


def test_the_dit_attention_goes_through_the_seam():
    """Every rotary attention call of the DiT runs the kernel its attention modules hold (`Attention.qk_kernel`);
    the refiner (no RoPE) does not; another DiT keeps its own."""
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return ops.qk_norm_rope_reference(*args)

    dit = tiny_dit()
    assert isinstance(dit, H3DiT)
    from h3serve.pipeline.layout import MediaGeometry, build_layout
    from h3serve.pipeline.sampling import bind_model

    layout = build_layout([1] * 5, MediaGeometry.from_pixels(64, 64, 22), ())
    model = bind_model(dit, layout, torch.randn(5, TINY_DIT.text_dim))
    video = torch.randn(layout.num_video_rows, TINY_DIT.video_patch_dim)
    audio = torch.randn(layout.num_audio_rows, TINY_DIT.audio_latents_dim)
    t, idx = layout.timestep_plan(0.3, 0.4)
    expected = model(video, audio, t, idx, 0)
    from h3serve.model.dit import Attention

    for module in dit.modules():
        if isinstance(module, Attention):
            module.qk_kernel = spy
    got = model(video, audio, t, idx, 0)
    assert len(calls) == TINY_DIT.num_layers and all(c[0] == layout.token_tags.numel() for c in calls)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    other = tiny_dit()
    bind_model(other, layout, torch.randn(5, TINY_DIT.text_dim))(video, audio, t, idx, 0)
    assert len(calls) == TINY_DIT.num_layers  # the other model's attention kept the reference


def test_the_fused_kernels_are_refused_without_cuda_or_triton(monkeypatch):
    fused.triton_kernels.cache_clear()
    monkeypatch.setattr(fused, "available", lambda: False)
    with pytest.raises(ValueError, match="need a CUDA device and Triton"):
        fused.triton_kernels()
    fused.triton_kernels.cache_clear()


@pytest.mark.parametrize(
    ("s", "h", "d", "r"), [(6435, 4, 128, 96), (37, 3, 128, 96), (100, 2, 64, 64), (33, 2, 32, 12)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
def test_fused_equals_the_reference(s, h, d, r, dtype):
    if not (torch.cuda.is_available() and fused.available()):
        pytest.skip("needs a CUDA GPU and Triton")
    kernel = fused.qk_kernel(fused.triton_kernels(), exact=False)
    q, k, qw, kw, cos, sin = inputs(s, h, d, r, dtype, "cuda")
    rq, rk = ops.qk_norm_rope_reference(q, k, qw, kw, 1e-5, cos, sin)
    fq, fk = kernel(q, k, qw, kw, 1e-5, cos, sin)
    from h3serve.accel.triton_qk_norm_rope import ROUND_NORM, qk_norm_rope_fused

    other = qk_norm_rope_fused(q, k, qw, kw, 1e-5, cos, sin, round_norm=not ROUND_NORM)  # not chosen, for the log
    for name, (a, b) in (("chosen", (fq, fk)), (f"round_norm={not ROUND_NORM}", other)):
        for ref, got in ((rq, a), (rk, b)):
            diff = (got.float() - ref.float()).abs()
            print(f"{name} {dtype} {s}x{h}x{d} R={r}: {(diff > 0).float().mean():.2e} differ, max {diff.max():.3g}")
    for ref, got in ((rq, fq), (rk, fk)):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        diff = (got.float() - ref.float()).abs()
        # The eager ops' roundings, but the norm's reduction order and rsqrt are ours: a rounding step apart on some
        # values, which the rotation's products and sum can carry to a few units of the last place (measured on the
        # H200: bfloat16 at most 0.0078 on values up to about 4, on 2.7e-6 of them; float32 at most 9.5e-7).
        bf16 = dtype == torch.bfloat16
        assert diff.max() <= (0.0625 if bf16 else 4e-6), f"max {diff.max():.3g}"
        assert not bf16 or (diff > 0).float().mean() <= 1e-4, f"{(diff > 0).float().mean():.2e} of values differ"
        relative = (diff.norm() / ref.float().norm()).item()
        assert relative <= (1e-2 if bf16 else 1e-6), f"relative error {relative:.2e}"


@pytest.mark.gpu
def test_fused_under_compile_matches_and_does_not_recompile():
    if not (torch.cuda.is_available() and fused.available()):
        pytest.skip("needs a CUDA GPU and Triton")
    from h3serve.accel.compile import GraphCounter

    q, k, qw, kw, cos, sin = inputs(300, 4, 128, 96, torch.bfloat16, "cuda")
    counter = GraphCounter("inductor")
    compiled = torch.compile(fused.qk_kernel(fused.triton_kernels(), exact=False), fullgraph=True, backend=counter)
    for s in (300, 211):
        args = [t[:s] for t in (q, k)] + [qw, kw, 1e-5] + [t[:s] for t in (cos, sin)]
        for t in (args[0], args[1], args[5], args[6]):
            torch._dynamo.mark_dynamic(t, 0)
        got, again = compiled(*args), compiled(*args)
        assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))  # deterministic
        want = ops.qk_norm_rope_reference(*args)
        for a, b in zip(got, want, strict=True):  # Inductor launches the kernel with its own settings: not bitwise
            diff = (a.float() - b.float()).abs()  # the eager launch, but within the parity test's bounds
            assert diff.max() <= 0.0625 and (diff.norm() / b.float().norm()).item() <= 1e-2, f"max {diff.max():.3g}"
    assert counter.graphs == 1 and counter.recompiles == 0, counter.compiles
