"""One start-up path: `check --preflight`, `serve` and `render` refuse the same bad setting with the same line, naming
the same setting, before any weight loads (each a real process, as an operator runs them)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter_fixtures import write_adapter
from h3serve import startup
from h3serve.config import NUM_BLOCK_MODULATIONS, NUM_MODALITIES, TINY_DIT
from h3serve.errors import SettingError, label
from h3serve.settings import load_settings
from service_fixtures import free_port


def run(*argv: str, env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """`h3serve ARGV` in a fresh process; its exit code and its last stderr line. A start that was not refused would
    serve forever: the timeout ends the test then."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("H3_")} | env
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from h3serve.cli import main; sys.exit(main(sys.argv[1:]))", *argv],
        env=full,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    return proc.returncode, lines[-1] if lines else ""


def refusals(tmp_path: Path, env: dict[str, str]) -> dict[str, tuple[int, str]]:
    out = tmp_path / "out"
    serve = ("--output-dir", str(out), "--api-port", str(free_port()))
    return {
        "check --preflight": run("check", "--preflight", *serve, env=env, cwd=tmp_path),
        "serve": run("serve", *serve, env=env, cwd=tmp_path),
        "render": run("render", "a fox", "-o", str(tmp_path / "fox.mp4"), "--no-progress", env=env, cwd=tmp_path),
    }


def other_width_adapter(folder: Path) -> Path:
    """An adapter made for a DiT 16 wider than the tiny one: it recognises as an adapter, and does not fit."""
    hidden = TINY_DIT.hidden_size + 16
    wider = dataclasses.replace(
        TINY_DIT,
        hidden_size=hidden,
        adaln_out_features=NUM_BLOCK_MODULATIONS * NUM_MODALITIES * hidden,
        final_adaln_out_features=2 * hidden,
    )
    return write_adapter(folder / "wider.safetensors", "native", wider)


CASES = {
    # the tiny DiT's 4 heads do not divide by 3
    "gpus the heads do not divide": ({"H3_DEVICE": "cpu", "H3_NUM_GPUS": "3"}, "num_gpus", "allowed: 1, 2, 4"),
    "an adapter that does not fit": ({"H3_DEVICE": "cpu"}, "lora", "wider.safetensors"),
    "a CUDA-only backend on a CPU": (
        {"H3_DEVICE": "cpu", "H3_DIFFUSION_ATTENTION_BACKEND": "CUDNN_ATTN"},
        "diffusion_attention_backend",
        "CUDNN_ATTN",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_every_command_refuses_a_bad_setting_with_the_same_line(case, tmp_path):
    env, setting, detail = CASES[case]
    if setting == "lora":
        env = env | {"H3_LORA": str(other_width_adapter(tmp_path))}
    results = refusals(tmp_path, env)
    codes = {command: code for command, (code, _) in results.items()}
    lines = {command: line for command, (_, line) in results.items()}
    assert set(codes.values()) == {1}, results
    assert len(set(lines.values())) == 1, lines  # the same words from each
    line = lines["render"]
    assert label(setting) in line and detail in line, line
    assert not (tmp_path / "fox.mp4").exists() and not list(tmp_path.glob("*.mp4*"))


def test_the_plan_raises_the_setting_as_data(tmp_path):
    settings = load_settings(env={"H3_DEVICE": "cpu", "H3_NUM_GPUS": "3"}, check_profile=False)
    with pytest.raises(SettingError) as err:
        startup.plan(settings, settings.task_type)
    assert err.value.setting == "num_gpus" and str(err.value).startswith("H3_NUM_GPUS (--num-gpus): 3: ")
    ok = load_settings(env={"H3_DEVICE": "cpu", "H3_NUM_GPUS": "2"}, check_profile=False)
    plan = startup.plan(ok, ok.task_type)
    assert plan.profile is None and plan.folder is None and plan.dit_config == TINY_DIT
    with pytest.raises(ValueError, match="preflighted"):  # launching what the machine was not asked about
        startup.launch(plan)


def test_the_plan_admits_what_the_loaded_engine_admits():
    """The plan's admission (used by `render` before any weight loads) is the one the engine builds after."""
    from h3serve.pipeline.engine import Engine

    settings = load_settings(env={"H3_DEVICE": "cpu"}, config_file=None, check_profile=True)
    plan = startup.preflight(startup.plan(settings, "fl2va"), say=lambda line: None)
    engine = startup.launch(plan)
    assert isinstance(engine, Engine)
    assert engine.admission == plan.admission
    engine.close()  # one process: nothing to stop, and still part of the interface


def interface(protocol: type) -> set[str]:
    """The members a Protocol declares: its annotated attributes, properties and methods."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {
        n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }
    return names


def test_both_engines_implement_the_render_engine_interface():
    """The service, the CLI and the warmup are typed against `RenderEngine`: the one-process engine has every member,
    and so does the several-GPU engine's class (its instances are tested with their workers in test_parallel)."""
    from h3serve.parallel.workers import ParallelEngine
    from h3serve.pipeline.engine import Engine, RenderEngine

    members = interface(RenderEngine)
    assert {"render", "validate", "close", "problem", "num_gpus", "admission", "profile"} <= members
    engine = Engine.load(None, load_settings(env={"H3_DEVICE": "cpu"}).profile())
    assert [m for m in sorted(members) if not hasattr(engine, m)] == []
    assert engine.num_gpus == 1 and engine.problem is None
    instance_only = {"profile", "placement"}  # set in __init__ from the spec
    assert [m for m in sorted(members - instance_only) if not hasattr(ParallelEngine, m)] == []
