"""CUDNN_FP8 on the GPU: cuDNN's FP8 SDPA against the float32 emulation of the same quantized computation, bitwise
reruns, the design against naive scales, and the backend inside a fullgraph compile without recompiles.

Marked `gpu`: skipped without CUDA, or without the cuDNN frontend (`pip install 'h3serve[fp8-attention]'`); run on the
GPU machine with `pytest -m gpu`. The profiles with the tiny model: tests/test_gpu_profiles.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the naive scales: a benchmark's variant

from lib.variants import naive_sdpa

from h3serve.accel import fp8_attention
from h3serve.accel.attention import cudnn_sdpa
from h3serve.accel.fp8_attention import E4M3, E4M3_MAX, fp8_sdpa, quantize, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _fp8_attention():
    missing = fp8_attention.missing()
    if missing is not None:
        pytest.skip(missing)


def _qkv(rows: int, heads: int = 4, d: int = 128, key_offset: float = 0.0, seed: int = 0):
    """bfloat16 q, k, v as a DiT block hands them to its kernel: (1, H, S, D) views of (S, H, D) rows, v a slice of
    the fused projection's output; heads of different sizes, keys with an optional shared per-head offset."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(rows, 3, heads, d, generator=gen, device="cuda")
    size = torch.tensor([0.25, 1.0, 3.0, 0.5], device="cuda")[:heads, None]
    q, k, v = qkv[:, 0] * size.flip(0), qkv[:, 1] * size, qkv[:, 2] * size
    k = k + key_offset * torch.randn(1, heads, d, generator=gen, device="cuda")
    fused = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1).to(torch.bfloat16)  # (S, 3 H D)
    q, k, v = (t.unflatten(-1, (heads, d)) for t in fused.chunk(3, dim=-1))
    return q.contiguous()[None].transpose(1, 2), k.contiguous()[None].transpose(1, 2), v[None].transpose(1, 2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(("rows", "d"), [(17, 128), (640, 128), (2049, 128), (300, 16)])
def test_the_kernel_matches_the_float32_emulation_of_the_same_quantized_computation(rows, d):
    q8, k8, v8, scales = quantize(*_qkv(rows, d=d, key_offset=2.0))
    got = torch.ops.h3serve.cudnn_fp8_sdpa(q8, k8, v8, scales.descale)
    assert got.dtype == E4M3 and got.shape == q8.shape and got.transpose(1, 2).is_contiguous()
    want = reference(q8, k8, v8, scales.descale)
    want8 = want.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float()  # the kernel's output rounding
    err = _rel(got.float(), want8)
    print(f"rows {rows} d {d}: relative difference to the emulation {err:.2e}, emulation's own rounding "
          f"{_rel(want8, want):.2e}")  # fmt: skip
    # What is left is the kernel's running maximum (its probabilities are rounded against a smaller max early on)
    # and its summation order.
    assert err < 3e-2


def test_the_triton_passes_quantize_as_torchs_ops_do():
    q, k, v = _qkv(3001, key_offset=2.0)
    assert fp8_attention.fused(q, k, v)
    fused, ops = quantize(q, k, v), fp8_attention.quantize_ops(q, k, v)
    for name in ("q", "k", "v", "descale", "v_mean"):  # the means' sums run in another order: close, not bitwise
        torch.testing.assert_close(getattr(fused[3], name), getattr(ops[3], name), rtol=1e-5, atol=1e-6)
    for a, b in zip(fused[:3], ops[:3], strict=True):
        assert a.shape == b.shape and a.transpose(1, 2).is_contiguous()
        diff = (a.float() - b.float()).abs()
        # a value on a rounding boundary may land one e4m3 step (1/8 of its power of two) away
        assert (diff <= b.float().abs() / 8 + 2**-9).all() and (diff > 0).float().mean() < 1e-3


def test_reruns_are_bitwise_identical_and_close_to_bf16_attention():
    q, k, v = _qkv(4097, key_offset=2.0)
    one, two = fp8_sdpa(q, k, v, False), fp8_sdpa(q, k, v, False)
    assert one.dtype == torch.bfloat16 and torch.equal(one, two)
    exact = cudnn_sdpa(q, k, v, False)
    design, naive = _rel(one, exact), _rel(naive_sdpa(q, k, v, False), exact)
    print(f"relative error against bf16: design {design:.4f}, naive {naive:.4f}")
    assert design < 0.1 and design < naive


def test_the_backend_compiles_fullgraph_without_recompiles_across_row_counts():
    from h3serve.accel.compile import GraphCounter

    counter = GraphCounter("inductor")
    compiled = torch.compile(lambda q, k, v: fp8_sdpa(q, k, v, False), fullgraph=True, backend=counter)
    for rows in (700, 511, 1300):
        q, k, v = _qkv(rows, key_offset=2.0)
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)
        got, again = compiled(q, k, v), compiled(q, k, v)
        assert torch.equal(got, again)
        # Inductor's scale arithmetic may round differently from eager's: close, not bitwise.
        assert _rel(got, fp8_sdpa(q, k, v, False)) < 2e-2
    assert counter.graphs == 1 and counter.recompiles == 0, counter.compiles
