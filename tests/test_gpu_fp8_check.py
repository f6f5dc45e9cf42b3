"""The FP8 GEMM self-test and the EPILOGUE scaling on the GPU: the self-test passes with ROWWISE within its time
budget, EPILOGUE is ROWWISE within bfloat16 rounding at the DiT's block shapes, and an EPILOGUE linear compiles whole
with Inductor.

Marked `gpu`: skipped without CUDA (the CPU machines and CI), run on the GPU machine with `pytest -m gpu -s` (the
self-test's time and result are printed). The CPU side, and the selection with broken kernels: tests/test_fp8_check.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from h3serve.accel.fp8_check import TOLERANCE, self_test, shapes_for
from h3serve.accel.linear import Fp8Linear, Fp8Scaling, quantize_rows, quantize_weight
from h3serve.accel.profile import FP8_CAPABILITY
from h3serve.config import DiTConfig
from h3serve.pipeline.request import RequestFields

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < FP8_CAPABILITY,
        reason="needs FP8 tensor cores (sm89 or newer)",
    ),
]
BUDGET_S = 2.0  # the self-test's time at start (after CUDA's own initialisation), on an H200
# EPILOGUE against ROWWISE, bf16 outputs: the same float32 product up to the scales' rounding order (and possibly
# another GEMM kernel's summation order), each rounded to bfloat16: the two roundings of nearly equal values differ by
# an ulp where they differ at all, ~2.4e-3 relative if every element did (two independent bf16 roundings).
EPILOGUE_VS_ROWWISE = 5e-3


@pytest.fixture(scope="module")
def device() -> torch.device:
    device = torch.device("cuda")
    torch.zeros(1, device=device).sum().item()  # CUDA's context, outside the measured time
    return device


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_self_test_passes_with_rowwise_within_its_budget(device):
    result = self_test(device)
    print(f"\n{torch.cuda.get_device_name(device)}: {result.describe()}")
    assert result.choice is Fp8Scaling.ROWWISE, result.describe()
    assert result.results == {"ROWWISE": "ok", "EPILOGUE": "ok"}, result.describe()
    assert result.seconds < BUDGET_S, result.describe()
    # again, warm: what a restart in a process that already ran kernels pays
    start = time.perf_counter()
    again = self_test(device)
    print(f"warm: {again.describe()} ({time.perf_counter() - start:.2f} s wall)")
    assert again.choice is Fp8Scaling.ROWWISE


@pytest.mark.parametrize("m", [537, 6435])
def test_epilogue_is_rowwise_within_bf16_rounding_at_the_block_shapes(device, m):
    gen = torch.Generator(device=device).manual_seed(m)
    for _, k, n in shapes_for(DiTConfig(), rows=(m,)):
        x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
        layer = Fp8Linear(*quantize_weight(w), None)
        q, scale = quantize_rows(x)
        rowwise = layer.matmul_rows(q, scale, torch.bfloat16)
        layer.scaling = Fp8Scaling.EPILOGUE
        epilogue = layer.matmul_rows(q, scale, torch.bfloat16)
        assert epilogue.dtype == torch.bfloat16 and epilogue.shape == (m, n)
        assert torch.isfinite(epilogue).all()
        err = _rel(epilogue, rowwise)
        reference = layer.reference(x)
        print(f"M={m} K={k} N={n}: EPILOGUE vs ROWWISE {err:.2e}, vs reference {_rel(epilogue, reference):.2e}")
        assert err < EPILOGUE_VS_ROWWISE, (k, n, err)
        assert _rel(epilogue, reference) < TOLERANCE and _rel(rowwise, reference) < TOLERANCE


def test_an_epilogue_block_linear_compiles_whole_and_matches_eager(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    cfg = DiTConfig()
    gen = torch.Generator(device=device).manual_seed(0)
    linear = torch.nn.Linear(cfg.hidden_size, 3 * cfg.inner_dim, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen, device=device) * 0.02)
    layer = Fp8Linear.from_linear(linear)  # the fused QKV
    layer.scaling = Fp8Scaling.EPILOGUE
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    with torch.no_grad():
        for m in (537, 6435, 1001):
            x = torch.randn(m, cfg.hidden_size, generator=gen, device=device, dtype=torch.bfloat16)
            out, eager = compiled(x), layer(x)
            assert out.dtype == torch.bfloat16 and out.shape == eager.shape
            assert _rel(out, eager) < EPILOGUE_VS_ROWWISE, m  # Inductor fuses the scales and the cast
    assert counter.frame_count == 1  # one graph for every row count
    torch._dynamo.reset()


def test_resolve_chooses_on_the_device_and_the_engine_runs_the_choice(device):
    """`resolve` turns auto into the self-test's choice (ROWWISE on an H200); a named scaling is tested alone and
    kept; the engine's FP8 linears then run it (`accel.apply`)."""
    from h3serve.accel.fp8_check import resolve
    from h3serve.accel.profile import Profile
    from h3serve.pipeline.engine import Engine

    auto = Profile.for_device("cuda", execution="eager")
    chosen, result = resolve(auto)
    assert chosen.fp8_scaling == "ROWWISE" and result is not None and result.choice is Fp8Scaling.ROWWISE
    forced, result = resolve(Profile.for_device("cuda", execution="eager", fp8_scaling="EPILOGUE"))
    assert forced.fp8_scaling == "EPILOGUE" and list(result.results) == ["EPILOGUE"]
    engine = Engine.load(None, forced)
    layers = [m for m in engine.components.dit.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.scaling is Fp8Scaling.EPILOGUE for m in layers)
    frames = engine.render(engine.validate(RequestFields("a fox", steps=3, seed=1))).frames
    rowwise = Engine.load(None, chosen)
    assert all(m.scaling is Fp8Scaling.ROWWISE for m in rowwise.components.dit.modules() if isinstance(m, Fp8Linear))
    other = rowwise.render(rowwise.validate(RequestFields("a fox", steps=3, seed=1))).frames
    assert frames.shape == other.shape  # both render; their numbers differ by FP8 GEMM rounding at most
