"""The FP8 GEMM's two scalings (`accel.linear.Fp8Scaling`) and the start-up self-test that picks one
(`accel.fp8_check`), on the CPU.

The real kernels are tested where this torch runs `torch._scaled_mm` with e4m3 operands on the CPU (skipped, with the
reason, where it does not); the self-test's selection logic is tested whatever the CPU supports, with a correct kernel
emulated in float32 and deliberately broken ones injected (`self_test(matmul=...)`). On the GPU:
tests/test_gpu_fp8_check.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3serve.accel.fp8_check import (
    DIT_ROWS,
    REFERENCE_ROWS,
    TAIL_ROWS,
    TOLERANCE,
    default_shapes,
    reference_rows,
    self_test,
    shapes_for,
    text_encoder_shapes,
)
from h3serve.accel.linear import (
    Fp8Linear,
    Fp8Scaling,
    quantize_blocks,
    quantize_rows,
    quantize_text_encoder,
    set_scaling,
)
from h3serve.config import DiTConfig
from h3serve.model.tiny import TINY_DIT, tiny_dit, tiny_qwen3vl

REPO = Path(__file__).resolve().parents[1]
ROWWISE, EPILOGUE = Fp8Scaling.ROWWISE, Fp8Scaling.EPILOGUE
# Small shapes of the tiny DiT's block linears (K, N multiples of 16, as the CUDA kernels require), even and odd M.
SHAPES = shapes_for(TINY_DIT, rows=(16, 37, 64))


def _cpu_runs(scaling: Fp8Scaling) -> str | None:
    """None if this torch's CPU `_scaled_mm` runs the scaling, else why not."""
    layer = _layer(64, 48)
    q, scale = quantize_rows(torch.randn(5, 64, dtype=torch.bfloat16))
    layer.scaling = scaling
    try:
        layer.matmul_rows(q, scale, torch.bfloat16)
    except (RuntimeError, NotImplementedError) as err:
        return f"torch._scaled_mm with {scaling} scales does not run on this CPU build: {err}"
    return None


@pytest.fixture(params=list(Fp8Scaling))
def scaling(request) -> Fp8Scaling:
    why = _cpu_runs(request.param)
    if why is not None:
        pytest.skip(why)
    return request.param


def _layer(k: int, n: int, bias: bool = False, seed: int = 0) -> Fp8Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(n, generator=gen))
    return Fp8Linear.from_linear(linear)


def _rows(m: int, k: int, seed: int = 1) -> torch.Tensor:
    """(m, k) bfloat16 activations whose rows differ in magnitude (2^-4 .. 2^4), as the self-test's do."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * torch.exp2(torch.rand(m, 1, generator=gen) * 8 - 4)).bfloat16()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- the two scalings ---------------------------------------------------------------------------------------------


def test_the_cpu_build_runs_scaled_mm_as_the_self_test_finds():
    """What this torch's CPU `_scaled_mm` runs (recorded in the output), and the self-test agreeing with it."""
    runs = {s: _cpu_runs(s) is None for s in Fp8Scaling}
    print("CPU torch._scaled_mm e4m3:", {s.value: ok for s, ok in runs.items()}, torch.__version__)
    result = self_test("cpu", SHAPES[:4])
    assert {name: why == "ok" for name, why in result.results.items()} == {s.value: ok for s, ok in runs.items()}
    assert result.choice == next((s for s in Fp8Scaling if runs[s]), None)


def test_rowwise_is_bitwise_todays_scaled_mm_call():
    if (why := _cpu_runs(ROWWISE)) is not None:
        pytest.skip(why)
    layer = _layer(96, 64, bias=True)
    q, scale = quantize_rows(_rows(37, 96))
    assert layer.scaling is ROWWISE  # the default
    assert layer.fast_accum  # the served GEMM's (bench/lib/variants.py measures a subclass without it)
    direct = torch._scaled_mm(
        q, layer.weight.t(), scale_a=scale, scale_b=layer.scale, out_dtype=torch.bfloat16, use_fast_accum=True
    )
    assert torch.equal(layer.matmul_rows(q, scale, torch.bfloat16), direct + layer.bias)


def test_epilogue_is_rowwise_up_to_float32_rounding_and_both_are_the_reference():
    for s in Fp8Scaling:
        if (why := _cpu_runs(s)) is not None:
            pytest.skip(why)
    layer = _layer(96, 64, bias=True)
    x = _rows(2 * 37, 96).unflatten(0, (2, 37))  # (2, 37, 96): forward flattens the leading dims
    q, scale = quantize_rows(x.flatten(0, 1))
    out = {}
    for s in Fp8Scaling:
        layer.scaling = s
        out[s] = layer(x), layer.matmul_rows(q, scale, torch.float32)
    # float32 output: the same product in another rounding order (the kernels may also sum in another order), so
    # each element within float32 summation's bound, K * eps * sum |terms|, of the other's (bias excluded)
    terms = (q.float().abs() * scale) @ (layer.weight.float().abs() * layer.scale.t()).t()  # (M, N)
    diff = (out[EPILOGUE][1] - out[ROWWISE][1]).abs()
    assert torch.all(diff <= 96 * torch.finfo(torch.float32).eps * (terms + layer.bias.abs())), diff.max()
    assert _rel(out[EPILOGUE][1], out[ROWWISE][1]) < 1e-5
    # bfloat16 output: where the rounding order flips a bf16 rounding, one ulp (2^-8 relative) at most
    bf16_row, bf16_epi = out[ROWWISE][0].float(), out[EPILOGUE][0].float()
    assert torch.all((bf16_epi - bf16_row).abs() <= 2**-7 * bf16_row.abs() + 1e-6)
    # Fp8Linear.reference is the float32 reference of both (it rounds to the input's dtype, as forward does)
    exact = (q.float() * scale) @ (layer.weight.float() * layer.scale.t()).t() + layer.bias.float()
    for s in Fp8Scaling:
        assert _rel(out[s][0], exact.unflatten(0, (2, 37))) < 4e-3, s  # bf16 rounding of the output (~2e-3)
        assert _rel(out[s][1], exact) < 1e-5, s
        assert _rel(layer.reference(x), out[s][0]) < 4e-3, s


def test_epilogue_compiles_whole_and_a_scaling_change_recompiles(scaling):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    layer = _layer(64, 48)
    layer.scaling = scaling
    counter = CompileCounterWithBackend("aot_eager")  # the trace, not Inductor (GPU: tests/test_gpu_fp8_check.py)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    with torch.no_grad():
        for m in (37, 5, 129):
            x = _rows(m, 64)
            assert torch.equal(compiled(x), layer(x))
        assert counter.frame_count == 1
        other = next(s for s in Fp8Scaling if s != scaling)
        if _cpu_runs(other) is None:
            layer.scaling = other  # a plain attribute Dynamo guards on: the other branch is another graph
            assert torch.equal(compiled(x), layer(x)) and counter.frame_count == 2
    torch._dynamo.reset()


def test_set_scaling_sets_every_fp8_linear_of_a_dit_and_of_a_text_encoder():
    dit = tiny_dit(dtype=torch.bfloat16)
    quantize_blocks(dit)
    layers = [m for m in dit.modules() if isinstance(m, Fp8Linear)]
    blocks = TINY_DIT.num_layers + TINY_DIT.token_refiner_num_layers
    assert len(layers) == 4 * blocks and all(m.scaling is ROWWISE for m in layers)
    keys = set(dit.state_dict())
    assert set_scaling(dit, "EPILOGUE") == len(layers)
    assert all(m.scaling is EPILOGUE for m in layers)
    assert set(dit.state_dict()) == keys  # the unit scale is in no state dict: a checkpoint loads as before
    assert set_scaling(dit, ROWWISE) == len(layers) and all(m.scaling is ROWWISE for m in layers)

    text = torch.nn.ModuleDict({"model": tiny_qwen3vl(vision=False, dtype=torch.bfloat16)})  # TextEncoder's layout
    count = quantize_text_encoder(text)
    assert set_scaling(text, EPILOGUE) == count > 0
    assert all(m.scaling is EPILOGUE for m in text.modules() if isinstance(m, Fp8Linear))
    assert set_scaling(torch.nn.Linear(4, 4), EPILOGUE) == 0


def test_scaling_refuses_unknown_names_and_epilogue_on_meta_placeholders():
    layer = _layer(64, 48)
    with pytest.raises(ValueError, match="scaling must be one of ROWWISE, EPILOGUE, got 'COLWISE'"):
        set_scaling(layer, "COLWISE")
    with pytest.raises(ValueError, match="scaling must be one of"):
        layer.scaling = "rowwise"
    assert layer.scaling is ROWWISE
    with torch.device("meta"):
        placeholder = Fp8Linear(torch.empty(48, 64, dtype=torch.float8_e4m3fn), torch.empty(1, 48), None)
    placeholder.scaling = ROWWISE  # what a load hook's placeholders are: fine
    with pytest.raises(ValueError, match="on meta"):
        placeholder.scaling = EPILOGUE
    assert placeholder.scaling is ROWWISE and "unit_scale" not in dict(placeholder.named_buffers())


def test_the_unit_scale_is_made_once_and_follows_the_module():
    layer = _layer(64, 48)
    layer.scaling = EPILOGUE
    unit = layer.unit_scale
    assert unit.dtype == torch.float32 and unit.shape == () and unit.item() == 1.0
    layer.scaling = ROWWISE
    layer.scaling = EPILOGUE
    assert layer.unit_scale is unit  # not remade
    assert layer.to(torch.device("meta")).unit_scale.is_meta  # a buffer: it moves with the module


# ---- the self-test ------------------------------------------------------------------------------------------------


def _emulated(layer: Fp8Linear, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A correct FP8 GEMM in float32 (what either scaling computes), so the selection runs on any CPU."""
    return ((q.float() @ layer.weight.float().t()) * scale * layer.scale).to(torch.bfloat16)


def _broken(breaks: Fp8Scaling, how, calls: dict | None = None):
    """The emulated kernel, with `how(layer, q, scale, y)` in place of its result under the scaling `breaks`."""

    def matmul(layer: Fp8Linear, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if calls is not None:
            calls[layer.scaling] = calls.get(layer.scaling, 0) + 1
        y = _emulated(layer, q, scale)
        return how(layer, q, scale, y) if layer.scaling is breaks else y

    return matmul


def _not_supported(layer, q, scale, y):
    raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmul( ...)`\nmore lines")


def _odd(garbage):
    """Garbage only where M is odd, the output as it is otherwise."""
    return lambda layer, q, scale, y: garbage(layer, q, scale, y) if q.shape[0] % 2 else y


def _random(layer, q, scale, y):
    return torch.randn_like(y)


def _last_row_zero(layer, q, scale, y):  # a partial last tile never written
    y = y.clone()
    y[-1] = 0
    return y


def _one_nan(layer, q, scale, y):
    y = y.clone()
    y[q.shape[0] // 2, 3] = float("nan")
    return y


def _row_scales_ignored(layer, q, scale, y):
    return ((q.float() @ layer.weight.float().t()) * layer.scale).to(torch.bfloat16)


def test_an_emulated_correct_kernel_passes_with_the_first_scaling_in_order():
    result = self_test("cpu", SHAPES, matmul=_emulated)
    assert result.choice is ROWWISE and result.results == {"ROWWISE": "ok", "EPILOGUE": "ok"}
    result = self_test("cpu", SHAPES, scalings=("EPILOGUE", "ROWWISE"), matmul=_emulated)
    assert result.choice is EPILOGUE and list(result.results) == ["EPILOGUE", "ROWWISE"]
    assert self_test("cpu", SHAPES, scalings=(EPILOGUE,), matmul=_emulated).results == {"EPILOGUE": "ok"}
    assert 0 < result.seconds < 60
    assert result.describe().startswith("FP8 GEMM self-test: EPILOGUE in ")


def test_rowwise_not_supported_picks_epilogue_and_records_why():
    calls: dict = {}
    result = self_test("cpu", SHAPES, matmul=_broken(ROWWISE, _not_supported, calls))
    assert result.choice is EPILOGUE and result.results["EPILOGUE"] == "ok"
    first = SHAPES[0]
    assert result.results["ROWWISE"] == (
        f"M={first[0]} K={first[1]} N={first[2]}: RuntimeError: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling "
        "`cublasLtMatmul( ...)`"
    )
    assert calls == {ROWWISE: 1, EPILOGUE: len(SHAPES)}  # a failed scaling is not run again
    line = result.describe()
    assert "EPILOGUE" in line and "CUBLAS_STATUS_NOT_SUPPORTED" in line and "\n" not in line


@pytest.mark.parametrize(
    ("garbage", "why"),
    [
        (_random, "relative error"),
        (_last_row_zero, "relative error"),
        (_one_nan, "non-finite output (1 of"),
        (_row_scales_ignored, "relative error"),
    ],
)
def test_rowwise_garbage_at_odd_m_only_picks_epilogue_and_names_the_shape(garbage, why):
    result = self_test("cpu", SHAPES, matmul=_broken(ROWWISE, _odd(garbage)))
    assert result.choice is EPILOGUE and result.results["EPILOGUE"] == "ok"
    reason = result.results["ROWWISE"]
    assert reason.startswith(f"M=37 K={SHAPES[0][1]} N={SHAPES[0][2]}: ") and why in reason, reason  # M=16 passed
    if why == "relative error":
        measured = float(reason.split("relative error ")[1].split(" ")[0])
        assert measured > TOLERANCE and f"> {TOLERANCE:g}" in reason


def test_garbage_in_one_tile_inside_a_large_m_is_found_by_the_sampled_rows():
    m = 2 * (REFERENCE_ROWS + TAIL_ROWS) + 1  # sampled, not compared whole

    def tile(layer, q, scale, y):
        y = y.clone()
        y[REFERENCE_ROWS : REFERENCE_ROWS + 64] = 0  # one 64-row tile
        return y

    result = self_test("cpu", [(m, 48, 64)], matmul=_broken(ROWWISE, tile))
    assert result.choice is EPILOGUE and "relative error" in result.results["ROWWISE"]


def test_both_broken_is_no_choice_with_both_reasons_and_nothing_raised():
    def both(layer, q, scale):
        if layer.scaling is ROWWISE:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        if q.shape[0] % 2:
            return torch.zeros(q.shape[0], layer.out_features, dtype=torch.bfloat16)
        return _emulated(layer, q, scale)

    result = self_test("cpu", SHAPES, matmul=both)
    assert result.choice is None
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in result.results["ROWWISE"]
    assert result.results["EPILOGUE"].startswith("M=37 ") and "relative error 1 >" in result.results["EPILOGUE"]
    assert result.describe().startswith("FP8 GEMM self-test: no scaling passed in ")
    assert "ROWWISE: " in result.describe() and "EPILOGUE: " in result.describe()


def test_any_failure_of_a_kernel_is_a_result():
    def odd(layer, q, scale):
        if layer.scaling is ROWWISE:
            raise ValueError("not the exception anyone expects")
        return _emulated(layer, q, scale)[:, :-1]  # a wrong shape

    result = self_test("cpu", SHAPES[:1], matmul=odd)
    assert result.choice is None
    assert result.results["ROWWISE"].endswith("ValueError: not the exception anyone expects")
    assert result.results["EPILOGUE"].endswith(f"output of shape ({SHAPES[0][0]}, {SHAPES[0][2] - 1})")
    # operands that cannot be made (a device without kernels): every scaling failed, nothing raised
    result = self_test("meta", SHAPES[:1])
    assert result.choice is None and all("making the operands" in why for why in result.results.values())
    with pytest.raises(ValueError, match="scaling must be one of"):
        self_test("cpu", SHAPES[:1], scalings=("COLUMNWISE",))


# ---- the shapes ---------------------------------------------------------------------------------------------------


def test_the_shapes_are_the_dit_block_linears_at_odd_row_counts():
    cfg = DiTConfig()
    shapes = shapes_for(cfg)
    assert {(k, n) for _, k, n in shapes} == {(5376, 21504), (7168, 5376), (5376, 28672), (14336, 5376)}
    assert sorted({m for m, _, _ in shapes}) == sorted(DIT_ROWS) and all(m % 2 for m in DIT_ROWS)
    assert 38247 in DIT_ROWS and 6435 in DIT_ROWS  # the default request's and the reference's packed rows
    tiny = {(k, n) for _, k, n in shapes_for(TINY_DIT, rows=(3,))}
    dit = tiny_dit()
    block = dit.blocks[0]
    assert tiny == {tuple(reversed(lin.weight.shape)) for lin in (block.attn.qkv_proj, block.attn.out_proj,
                                                                  block.mlp.fc1, block.mlp.fc2)}  # fmt: skip
    assert default_shapes() == shapes + text_encoder_shapes()
    assert all(k % 16 == 0 and n % 16 == 0 for _, k, n in default_shapes())  # what FP8 GEMMs need


def test_the_text_encoder_shapes_are_the_released_text_encoders():
    text = json.loads((REPO / "tests/data/reference/FL2VA/text_encoder/config.json").read_text())["text_config"]
    released = text_encoder_shapes(
        hidden=text["hidden_size"],
        intermediate=text["intermediate_size"],
        heads=text["num_attention_heads"],
        kv_heads=text["num_key_value_heads"],
        head_dim=text["head_dim"],
    )
    assert released == text_encoder_shapes()
    assert {(k, n) for _, k, n in released} == {
        (5120, 8192), (5120, 1024), (8192, 5120), (5120, 25600), (25600, 5120)
    }  # fmt: skip
    # every decoder-layer linear of the tiny text encoder is one of its shapes
    tiny = tiny_qwen3vl(vision=False).config.text_config
    shapes = text_encoder_shapes(
        (1,), hidden=tiny.hidden_size, intermediate=tiny.intermediate_size, heads=tiny.num_attention_heads,
        kv_heads=tiny.num_key_value_heads, head_dim=tiny.head_dim,
    )  # fmt: skip
    layer = tiny_qwen3vl(vision=False).language_model.layers[0]
    linears = {tuple(reversed(m.weight.shape)) for m in layer.modules() if isinstance(m, torch.nn.Linear)}
    assert linears == {(k, n) for _, k, n in shapes}


def test_the_reference_rows_cover_every_tile_and_the_tail():
    assert torch.equal(reference_rows(537), torch.arange(537))
    for m in (6435, 38247):
        rows = reference_rows(m)
        gaps = rows[1:] - rows[:-1]
        assert rows[0] == 0 and torch.all(gaps >= 1)
        assert len(rows) <= REFERENCE_ROWS + TAIL_ROWS + 1
        assert torch.equal(rows[-TAIL_ROWS:], torch.arange(m - TAIL_ROWS, m))
        assert gaps.max() <= 32, m  # every 64-row tile has two sampled rows or more


# ---- the benchmark's variant --------------------------------------------------------------------------------------


def test_dit_step_times_cutlass_epilogue_beside_cutlass_on_the_same_weights(tmp_path):
    """bench/dit_step.py's CPU dry run (`--tiny`) with the CUTLASS_EPILOGUE linear named: both FP8 scalings measured
    in one run, each against the peer; nothing of it without `--only`."""
    pytest.importorskip("diffusers")
    for s in Fp8Scaling:
        if (why := _cpu_runs(s)) is not None:
            pytest.skip(why)
    out = tmp_path / "dit_step.json"
    names = ["TORCH_SDPA+eager+BF16", "TORCH_SDPA+eager+CUTLASS", "TORCH_SDPA+eager+CUTLASS_EPILOGUE"]
    subprocess.run(
        [sys.executable, str(REPO / "bench/dit_step.py"), "--tiny", "--warmup", "0", "--iters", "1",
         "--only", ",".join([*names, "diffusers+eager"]), "--out", str(out)],
        check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )  # fmt: skip
    profiles = json.loads(out.read_text())["profiles"]
    assert set(profiles) == {*names, "diffusers+eager"}
    for name in names:
        assert "error" not in profiles[name], profiles[name]
    rowwise, epilogue = profiles[names[1]], profiles[names[2]]
    for key in ("rel_err_video_vs_peer_eager", "rel_err_audio_vs_peer_eager"):
        assert 0 < epilogue[key] < 0.2 and abs(epilogue[key] - rowwise[key]) < 0.1 * rowwise[key], key


def test_the_fp8_scaling_setting_is_checked_before_anything_loads(tmp_path):
    """H3_FP8_SCALING: auto, ROWWISE or EPILOGUE, and only with a CUTLASS linear; off CUDA nothing is self-tested."""
    from h3serve.accel.fp8_check import resolve
    from h3serve.accel.profile import Profile
    from h3serve.settings import SettingsError, load_settings

    env = {"H3_OUTPUT_DIR": str(tmp_path), "H3_DEVICE": "cpu"}
    with pytest.raises(SettingsError) as err:
        load_settings(env=env | {"H3_FP8_SCALING": "EPILOGUE"})
    assert "H3_FP8_SCALING (--fp8-scaling): fp8_scaling EPILOGUE applies to CUTLASS linears" in str(err.value)
    with pytest.raises(SettingsError) as err:
        load_settings(env=env | {"H3_FP8_SCALING": "rowwise"})
    assert "Input should be 'auto', 'EPILOGUE' or 'ROWWISE'" in str(err.value)
    cuda = load_settings(env=env | {"H3_DEVICE": "cuda", "H3_FP8_SCALING": "EPILOGUE"}, check_profile=False)
    assert cuda.profile(ask_hardware=False).fp8_scaling == "EPILOGUE"
    cpu = Profile()
    assert resolve(cpu) == (cpu, None)
