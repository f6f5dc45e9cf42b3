"""The benchmarks' profile names on the CPU: bench/dit_step.py measures FA4 only where it runs (leaving it out, or
refusing an `--only` that names it, with the reason), and bench/render.py builds a profile under any attention backend,
by `--attention` or a `+ATTENTION` name, with old names meaning what they meant. A few seconds; the two refusals run
the scripts themselves, up to their early exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import dit_step
import render
from lib import variants

from h3serve.accel import fa4
from h3serve.accel.profile import Attention, Profile

FA4_RUNS_HERE = torch.cuda.is_available() and fa4.missing() is None


def script(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, str(REPO / "bench" / name), *args], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


# ---- dit_step.py ---------------------------------------------------------------------------------------------------


def test_fa4_is_a_measured_attention_at_the_engines_two_executions():
    assert "FA4" in variants.ATTENTIONS
    for linear in ("BF16", "CUTLASS"):
        measured = {e for e in variants.EXECUTIONS if variants.wanted(linear, "FA4", e)}
        assert measured == ({"eager", "compile", "compile-fp32accum"} if linear == "CUTLASS" else {"eager", "compile"})
    profile = variants.profile("FA4", "compile", "CUTLASS")
    assert (profile.attention, profile.execution, profile.linear) == ("FA4", "compile", "CUTLASS")
    assert variants.profile("FA4", "eager", "BF16").attention == Attention.FA4  # explicit: never turned into another


def test_the_tiny_dry_run_leaves_fa4_out_with_the_reason_and_nothing_else():
    skipped = dit_step.skipped_attentions(set(variants.ATTENTIONS) | {"diffusers"}, "cpu")
    assert list(skipped) == ["FA4"] and "CUDA GPU" in skipped["FA4"] and "--tiny" in skipped["FA4"]
    others = ["CUDNN_ATTN+compile+BF16", "TORCH_SDPA+eager+BF16", "diffusers+none"]
    assert dit_step.only_refusal(others, tiny=True) is None


@pytest.mark.skipif(FA4_RUNS_HERE, reason="FA4 runs on this machine: a GPU run would measure it")
def test_a_gpu_run_without_fa4_leaves_it_out_for_fa4s_own_reason():
    assert dit_step.skipped_attentions({"FA4", "CUDNN_ATTN"}, "cuda") == {"FA4": fa4.missing("cuda")}
    assert dit_step.only_refusal(["FA4+compile+CUTLASS"], tiny=False) == f"--only FA4+compile+CUTLASS: {fa4.missing()}"


def test_only_naming_fa4_in_a_tiny_run_stops_before_anything_is_built(tmp_path):
    out = tmp_path / "dit_step.json"
    done = script("dit_step.py", "--tiny", "--only", "TORCH_SDPA+eager+BF16,FA4+compile+BF16", "--out", str(out))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "--only FA4+compile+BF16: attention FA4 needs a CUDA GPU" in done.stderr
    assert not out.exists()  # nothing measured, nothing written


# ---- render.py -----------------------------------------------------------------------------------------------------


def test_render_names_without_an_attention_mean_what_they_meant():
    runs = render.runs(list(render.PROFILES))
    assert [r.key for r in runs] == list(render.PROFILES)
    assert {r.profile.attention for r in runs} == {Attention.CUDNN_ATTN}
    assert runs[2].profile == Profile(device="cuda", dtype="bfloat16", vae_autocast="float16", attention="CUDNN_ATTN",
                                      execution="compile", linear="CUTLASS", text_linear="BF16")  # fmt: skip


def test_render_takes_the_attention_from_the_flag_or_the_name_in_profile_order():
    runs = render.runs(["compile+CUTLASS+FA4", "compile+CUTLASS", "compile+FA4", "compile+CUDNN_ATTN", "compile"])
    assert [(r.key, r.base, r.attention) for r in runs] == [
        ("compile+FA4", "compile", "FA4"),
        ("compile", "compile", "CUDNN_ATTN"),  # named twice, run once
        ("compile+CUTLASS+FA4", "compile+CUTLASS", "FA4"),  # after the BF16 ones: quantization is in place
        ("compile+CUTLASS", "compile+CUTLASS", "CUDNN_ATTN"),
    ]
    fa4_cutlass = runs[2].profile
    assert (fa4_cutlass.attention, fa4_cutlass.execution, fa4_cutlass.linear) == ("FA4", "compile", "CUTLASS")
    by_flag = render.runs(["compile+CUTLASS+text CUTLASS", "eager+TORCH_SDPA"], "CUDNN_FP8")
    assert [(r.key, r.attention) for r in by_flag] == [
        ("eager+TORCH_SDPA", "TORCH_SDPA"),
        ("compile+CUTLASS+text CUTLASS+CUDNN_FP8", "CUDNN_FP8"),
    ]
    auto = {r.key: r.profile.attention for r in render.runs(["eager", "compile+CUTLASS"], "auto")}
    assert auto == {"eager+auto": "CUDNN_ATTN", "compile+CUTLASS+auto": "auto"}  # eager's is chosen at once


@pytest.mark.parametrize(
    ("name", "words"),
    [("compile+FA5", "unknown attention 'FA5'"), ("compile+BF16", "unknown attention 'BF16'"),
     ("fast+FA4", "unknown profile 'fast+FA4'"), ("CUTLASS", "unknown profile 'CUTLASS'")],
)  # fmt: skip
def test_render_refuses_an_unknown_name_naming_what_is_allowed(name, words):
    with pytest.raises(ValueError, match=r"allowed: .*FA4") as err:
        render.runs([name])
    assert words in str(err.value)


@pytest.mark.skipif(FA4_RUNS_HERE, reason="FA4 runs on this machine: the script would build and render")
def test_render_refuses_fa4_it_cannot_run_before_building_any_weight(tmp_path):
    out = tmp_path / "render.json"
    done = script("render.py", "--profiles", "compile,compile+CUTLASS+FA4", "--out", str(out))
    assert done.returncode == 2, done.stdout + done.stderr
    if torch.cuda.is_available():  # the cuDNN profile passes; FA4's own reason stops the script
        assert f"profile compile+CUTLASS+FA4: {fa4.missing()}" in done.stderr
    else:  # the first profile already needs the CUDA this machine has not
        assert "profile compile: device 'cuda': CUDA is not available" in done.stderr
    assert not out.exists()
