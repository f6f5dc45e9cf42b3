"""FA4 (FlashAttention-4, `accel.fa4`) on a machine without it: the refusals before any weight loads, `auto`'s
resolution where no hardware decides and what it would choose on each GPU, the op's fake (what a compiled block
traces), and the kernel caches. FA4 itself, on the GPU: tests/test_gpu_fa4.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from h3serve.accel import attention, fa4
from h3serve.accel.profile import Attention, Profile, ProfileError
from h3serve.config import TINY_DIT
from h3serve.errors import label
from h3serve.settings import SettingsError, load_settings
from h3serve.startup import check_attention
from service_fixtures import free_port

INSTALLED = fa4.Machine((9, 0), "4.0.0b36", True)


@pytest.mark.parametrize(
    ("machine", "words"),
    [
        (fa4.Machine(None, None, False), "needs a CUDA GPU"),
        (fa4.Machine((8, 0), "4.0.0b36", True), "needs sm90 or newer, this GPU is sm80"),
        (fa4.Machine((8, 9), None, False), "needs sm90 or newer, this GPU is sm89"),
        (fa4.Machine((9, 0), None, False), "needs flash-attn-4, which is not installed: pip install 'h3serve[fa4]'"),
        (fa4.Machine((9, 0), "4.0.0b36", False), "4.0.0b36 is installed but flash_attn.cute is not importable"),
    ],
)
def test_what_fa4_needs_is_named_with_what_is_allowed(machine, words):
    why = fa4.missing(machine=machine)
    assert why is not None and words in why
    assert why.startswith("attention FA4") and why.endswith("(allowed: CUDNN_ATTN, TORCH_SDPA, auto)")
    # `auto` does not pick FA4 there, and says why in the same words, without the refusal's frame
    reason = fa4.auto_refusal(machine=machine)
    assert reason is not None and words in reason and "allowed" not in reason


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (10, 3)])
def test_auto_picks_fa4_on_hopper_and_datacenter_blackwell_where_it_is_installed(capability):
    machine = fa4.Machine(capability, "4.0.0b36", True)
    assert fa4.missing(machine=machine) is None and fa4.auto_refusal(machine=machine) is None


@pytest.mark.parametrize("capability", [(12, 0), (12, 1), (11, 0)])
def test_auto_keeps_cudnn_where_fa4_runs_but_was_not_measured_and_an_explicit_fa4_still_runs(capability):
    machine = fa4.Machine(capability, "4.0.0b36", True)
    assert fa4.missing(machine=machine) is None  # an explicit FA4 is not refused there
    reason = fa4.auto_refusal(machine=machine)
    assert reason is not None and f"sm{capability[0]}{capability[1]}" in reason and "set attention FA4" in reason


def test_this_machine_has_no_fa4_and_says_so():
    # The CPU suite runs without the package and without a GPU: the facts and the refusal come from this machine.
    facts = fa4.Machine.of()
    assert facts.capability is None if not torch.cuda.is_available() else facts.capability is not None
    if facts.version is None:
        assert fa4.version() is None and not facts.importable
    assert fa4.missing() is not None or torch.cuda.is_available()


# ---- auto, resolved --------------------------------------------------------------------------------------------


def test_the_cuda_default_under_compile_is_auto_and_what_needs_no_hardware_is_resolved_when_built():
    assert Profile.for_device("cuda").attention == Attention.AUTO  # the start asks the device
    assert Profile.for_device("cuda", attention="auto").attention == Attention.AUTO
    # eager is the exact and deterministic profiles' mode: their bits are measured with cuDNN's attention
    assert Profile.for_device("cuda", execution="eager").attention == Attention.CUDNN_ATTN
    assert Profile.for_device("cuda", execution="eager", linear="HUMMING").attention == Attention.CUDNN_ATTN
    assert Profile.for_device("cpu").attention == Attention.TORCH_SDPA
    assert Profile.for_device("cpu", attention="auto").attention == Attention.TORCH_SDPA
    # named backends are kept as named
    assert Profile.for_device("cuda", execution="eager", attention="FA4").attention == Attention.FA4
    assert Profile.for_device("cuda", attention="CUDNN_ATTN").attention == Attention.CUDNN_ATTN


def test_fa4_has_no_float32_kernel_and_no_cpu_kernel():
    with pytest.raises(ProfileError, match="attention FA4 has no float32 kernel") as err:
        Profile.for_device("cuda", dtype="float32", attention="FA4")
    assert err.value.setting == "attention"
    with pytest.raises(ProfileError, match=r"attention FA4 needs a CUDA device \(allowed on cpu: TORCH_SDPA\)") as err:
        Profile.for_device("cpu", attention="FA4")
    assert err.value.setting == "attention"


def test_auto_in_float32_on_cuda_asks_for_an_explicit_choice():
    with pytest.raises(ProfileError, match="no float32 kernel: use dtype bfloat16, or attention TORCH_SDPA"):
        Profile.for_device("cuda", dtype="float32")
    assert Profile.for_device("cuda", dtype="float32", attention="TORCH_SDPA").attention == Attention.TORCH_SDPA


def test_a_setting_of_fa4_on_the_cpu_is_refused_naming_the_variable_and_the_flag():
    env = {"H3_DIFFUSION_ATTENTION_BACKEND": "FA4", "H3_DEVICE": "cpu"}
    with pytest.raises(SettingsError) as err:
        load_settings(env=env, check_profile=False)
    text = str(err.value)
    assert label("diffusion_attention_backend") in text and "needs a CUDA device (allowed on cpu: TORCH_SDPA)" in text
    with pytest.raises(SettingsError, match="'auto', 'CUDNN_ATTN', 'CUDNN_FP8', 'FA4' or 'TORCH_SDPA', got \"FA3\""):
        load_settings(env={"H3_DIFFUSION_ATTENTION_BACKEND": "FA3", "H3_DEVICE": "cpu"}, check_profile=False)
    chosen = load_settings(env={"H3_DIFFUSION_ATTENTION_BACKEND": "auto", "H3_DEVICE": "cpu"}, check_profile=False)
    assert chosen.profile().attention == Attention.TORCH_SDPA


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_check_refuses_fa4_on_cuda_without_a_gpu_before_anything_loads(tmp_path):
    env = {"H3_DIFFUSION_ATTENTION_BACKEND": "FA4", "H3_DEVICE": "cuda", "PATH": "/usr/bin:/bin"}
    env["H3_API_PORT"] = str(free_port())  # not the default 8000, which a user's server may hold
    proc = subprocess.run(
        [sys.executable, "-m", "h3serve.cli", "check", "--preflight", "--output-dir", str(tmp_path / "out")],
        env={**env, "PYTHONPATH": ":".join(sys.path)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "CUDA is not available on this machine" in proc.stderr and label("device") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_resolving_needs_nothing_where_there_is_nothing_to_choose():
    cpu = Profile.for_device("cpu")
    assert attention.resolve(cpu, 128) == (cpu, None)
    assert check_attention(cpu, TINY_DIT) == (cpu, None)
    eager = Profile.for_device("cuda", execution="eager")  # built anywhere; CUDNN_ATTN already, nothing to test
    assert attention.resolve(eager, 128) == (eager, None)


def test_no_kernel_runs_auto():
    assert set(attention.KERNELS) == set(Attention) - {Attention.AUTO}
    with pytest.raises(ValueError, match="attention auto is chosen at start"):
        attention.set_kernel(torch.nn.Module(), "auto")


def test_under_fa4_the_decoders_attention_stays_on_cudnn():
    """FA4 is the DiT's alone: at the video decoder's tiles (32 heads x 64, float16, ~1,300 rows) it ran 0.55x-0.84x
    cuDNN's speed on an H200 (bench/results/2026-12-03-h200-fa4-check.json)."""
    from h3serve.model.tiny import tiny_components

    parts = tiny_components(device="cpu", dtype=torch.float32)
    attention.set_kernel(parts.dit, Attention.FA4)
    attention.set_kernel(parts.video_vae, Attention.FA4)
    attention.set_kernel(parts.audio_vae, Attention.FA4)
    dit_kernels = {m.kernel for m in parts.dit.modules() if isinstance(m, attention.MODULES)}
    other = {m.kernel for vae in (parts.video_vae, parts.audio_vae) for m in vae.modules()
             if isinstance(m, attention.MODULES)}  # fmt: skip
    assert dit_kernels == {fa4.fa4_sdpa} and other == {attention.cudnn_sdpa}


# ---- the op as a compiled block sees it ---------------------------------------------------------------------------


@pytest.mark.parametrize(("batch", "rows", "heads", "dim"), [(1, 6435, 56, 128), (2, 37, 4, 16)])
def test_the_fake_gives_the_kernels_layout_so_the_compiled_block_reads_it_as_cudnns(batch, rows, heads, dim):
    with FakeTensorMode():
        qkv = torch.empty(batch, rows, 3, heads, dim, dtype=torch.bfloat16)  # the fused projection's output
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, S, D) views, as the DiT hands them
        out = fa4.fa4_sdpa(q, k, v, False)
        rows_first = torch.empty(batch, rows, heads, dim, dtype=torch.bfloat16).transpose(1, 2)
    assert out.shape == (batch, heads, rows, dim) and out.dtype == torch.bfloat16
    assert out.stride() == rows_first.stride()  # (B, H, S, D) over (B, S, H, D) memory: out_proj reads it as is


def test_the_self_test_reports_a_failure_instead_of_raising():
    result = fa4.self_test("cpu", 16)  # no FA4 here (or no kernel for a CPU tensor): a result, never an exception
    assert not result.ok and result.why and "failed:" in result.describe()


def test_the_fa4_extra_pins_the_measured_release():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["fa4"] == ["flash-attn-4[cu13]==4.0.0b36"]
    assert "4.0.0b36" in fa4.INSTALL and "h3serve[fa4]" in fa4.INSTALL
    assert fa4.AUTO_MAJORS == (9, 10)
