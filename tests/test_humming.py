"""The HUMMING linear backend (h3serve.accel.humming): what runs without the package or a GPU (the refusals, the
quantization, the float32 reference, the block replacement), and, marked `gpu`, its GEMM where Humming can run."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from h3serve.accel import humming as hm
from h3serve.accel.linear import FP8, Fp8Linear, block_linears, quantize_weight


def _linear(k: int = 96, n: int = 64, seed: int = 0, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias)


def test_the_module_imports_and_refuses_cleanly_without_the_package():
    """In a fresh interpreter where `import humming` fails, the module still imports and names the package."""
    code = (
        "import sys; sys.modules['humming'] = None\n"
        "import torch\n"
        "from h3serve.accel import humming as hm\n"
        "assert 'humming' not in sys.modules or sys.modules['humming'] is None\n"
        "print(hm._import_error())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "humming-kernels==0.1.20" in out and "pip install" in out and "import failed" in out, out


def test_a_missing_package_is_named_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "humming", None)  # makes `import humming` raise ImportError
    message = hm._import_error()
    assert message.startswith("HUMMING needs the optional package humming-kernels==0.1.20"), message
    assert "h3serve[humming]" in message and "import failed: ModuleNotFoundError" in message


def test_another_humming_version_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "humming", types.SimpleNamespace(__version__="0.2.0", __file__="/x/humming"))
    message = hm._import_error()
    assert "0.1.20" in message and "found 0.2.0" in message, message


def test_the_pinned_version_is_accepted(monkeypatch):
    monkeypatch.setitem(sys.modules, "humming", types.SimpleNamespace(__version__="0.1.20", __file__="/x/humming"))
    assert hm._import_error() is None


def test_check_refuses_the_cpu_and_names_what_is_allowed():
    message = hm.available(torch.device("cpu"))
    assert message == "linear HUMMING needs a CUDA device (allowed on cpu: BF16)"
    with pytest.raises(ValueError, match=r"linear HUMMING needs a CUDA device \(allowed on cpu: BF16\)"):
        hm.check(torch.device("cpu"))
    with pytest.raises(ValueError, match="text_linear HUMMING needs a CUDA device"):
        hm.check("cpu", kind="text_linear")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_default_device_is_refused():
    message = hm.available()
    assert message is not None and "CUDA is not available" in message and "BF16" in message
    with pytest.raises(ValueError, match="HUMMING needs a CUDA device"):
        hm.check("cuda")


def test_weights_are_bitwise_cutlass_and_the_reference_is_cutlass_reference():
    linear = _linear()
    fp8, hl = Fp8Linear.from_linear(linear), hm.HummingLinear.from_linear(linear)
    q, scale = quantize_weight(linear.weight)
    assert hl.weight.dtype == FP8 and hl.scale.shape == (1, 64) and not hl.prepared
    assert torch.equal(hl.weight.view(torch.uint8), fp8.weight.view(torch.uint8))
    assert torch.equal(hl.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(hl.scale, fp8.scale) and torch.equal(hl.scale, scale)
    for x in (torch.randn(7, 3, 96), torch.randn(5, 96).to(torch.bfloat16)):
        reference = hl.reference(x)
        assert reference.shape == (*x.shape[:-1], 64) and reference.dtype == x.dtype
        assert torch.equal(reference, fp8.reference(x))
    x = torch.randn(11, 96)
    error = ((hl.reference(x) - linear(x)).norm() / linear(x).norm()).item()
    assert 1e-3 < error < 5e-2, error  # FP8 rounding: visible, small


def test_a_bias_is_refused():
    with pytest.raises(ValueError, match="no bias in H3"):
        hm.HummingLinear.from_linear(_linear(bias=True))


def test_bad_buffers_are_refused():
    q, scale = quantize_weight(_linear().weight)
    with pytest.raises(ValueError, match="weight must be a 2-D"):
        hm.HummingLinear(q.float(), scale)
    with pytest.raises(ValueError, match=r"scale must be float32 of shape \(1, 64\)"):
        hm.HummingLinear(q, scale.t())


def test_an_unprepared_layer_refuses_to_run_and_cannot_prepare_on_the_cpu():
    hl = hm.HummingLinear.from_linear(_linear())
    with pytest.raises(RuntimeError, match="not prepared"):
        hl(torch.randn(2, 96).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="needs the e4m3 weight on a CUDA device"):
        hl.prepare()


def test_quantize_blocks_replaces_every_block_linear_once_and_frees_the_bf16_weights():
    from h3serve.model.dit import H3DiT
    from h3serve.model.tiny import TINY_DIT

    dit = H3DiT(TINY_DIT).to(torch.bfloat16)
    blocks = len(dit.blocks) + len(dit.token_refiner.blocks)
    weights = {n: m.weight.clone() for n, m in dit.named_modules() if n.endswith(("qkv_proj", "fc2"))}
    assert not hm.is_humming(dit)
    assert hm.quantize_blocks(dit) == 4 * blocks
    assert hm.is_humming(dit)
    humming = {n: m for n, m in dit.named_modules() if isinstance(m, hm.HummingLinear)}
    assert len(humming) == 4 * blocks
    assert all(isinstance(getattr(parent, leaf), hm.HummingLinear) for _, parent, leaf in block_linears(dit))
    # No BF16 copy of a block linear's weight is left in the model: only the e4m3 weight and its scales.
    state = dit.state_dict()
    assert all(state[f"{name}.weight"].dtype == FP8 for name in humming)
    assert all(state[f"{name}.scale"].dtype == torch.float32 for name in humming)
    for name, weight in weights.items():
        q, scale = quantize_weight(weight)
        assert torch.equal(humming[name].weight.view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(humming[name].scale, scale), name
    assert hm.quantize_blocks(dit) == 0  # already replaced: nothing left to do


def test_cutlass_block_linears_are_converted_with_the_same_bytes():
    """A DiT loaded through Fp8LoadHook (or quantized for CUTLASS) converts without a BF16 detour."""
    from h3serve.accel.linear import quantize_blocks
    from h3serve.model.dit import H3DiT
    from h3serve.model.tiny import TINY_DIT

    dit = H3DiT(TINY_DIT).to(torch.bfloat16)
    quantize_blocks(dit)
    fp8 = {n: (m.weight.clone(), m.scale.clone()) for n, m in dit.named_modules() if isinstance(m, Fp8Linear)}
    assert len(fp8) > 0 and hm.quantize_blocks(dit) == len(fp8)
    modules = dict(dit.named_modules())
    for name, (weight, scale) in fp8.items():
        assert isinstance(modules[name], hm.HummingLinear), name
        assert torch.equal(modules[name].weight.view(torch.uint8), weight.view(torch.uint8)), name
        assert torch.equal(modules[name].scale, scale), name


def test_quantize_blocks_refuses_a_model_without_block_linears():
    with pytest.raises(ValueError, match="no block linears"):
        hm.quantize_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)))


# ---- on the GPU, where Humming runs -------------------------------------------------------------------------------


def _humming_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    missing = hm.available()
    if missing is not None:
        pytest.skip(missing)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_humming_gemm_is_close_to_its_reference_deterministic_and_batch_invariant():
    _humming_or_skip()
    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 768, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    hl = hm.HummingLinear.from_linear(linear, keep_fp8=True)
    assert hl.prepared and hl.humming_weight.is_cuda
    x = torch.randn(2, 300, 512, device="cuda").to(torch.bfloat16)
    y = hl(x)
    assert y.shape == (2, 300, 768) and y.dtype == torch.bfloat16
    reference = hl.reference(x.float())
    error = ((y.float() - reference).norm() / reference.norm()).item()
    assert error < 1e-2, error
    assert torch.equal(hl(x), y)
    rows, full = x.reshape(-1, 512), y.reshape(-1, 768)
    for p in (1, 7, 100, 431):
        assert torch.equal(hl(rows[:p]), full[:p]), p
    assert torch.equal(hl(rows[-50:]), full[-50:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prepare_releases_the_fp8_copy_unless_kept():
    _humming_or_skip()
    linear = torch.nn.Linear(256, 256, bias=False, device="cuda", dtype=torch.bfloat16)
    hl = hm.HummingLinear.from_linear(linear)
    assert hl.prepared and hl.weight is None
    with pytest.raises(RuntimeError, match="keep_fp8"):
        hl.reference(torch.randn(2, 256, device="cuda"))
    with pytest.raises(ValueError, match=r"takes torch\.bfloat16 input"):
        hl(torch.randn(2, 256, device="cuda"))
