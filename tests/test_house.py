"""The house's structure: no import cycle, no process-wide kernel state, two engines in one process that never disturb
each other, one profile value and one settings vocabulary for every command."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from h3serve.accel.profile import DEFAULTS, Attention, Execution, Linear, Profile, ProfileError, check
from h3serve.cli import main
from h3serve.media.mp4 import encode_mp4
from h3serve.pipeline.request import RequestFields

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "h3serve"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Every h3serve module's imports of other h3serve modules, at any depth of the file (function-level and
    type-checking imports included: a lazy import is still a dependency)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                # `from pkg import sub` imports the module pkg.sub when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "h3serve.pipeline.engine" in graph and "h3serve.accel.profile" in graph["h3serve.settings"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


BENCH = Path(__file__).resolve().parents[1] / "bench"
TESTS = Path(__file__).resolve().parent


def _imported(path: Path) -> set[str]:
    """The absolute module names a file imports, at any depth (a lazy import is still a dependency)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def bench_graph() -> dict[str, set[str]]:
    """bench/'s modules and their imports of each other: the scripts as top-level modules (bench/ is no package; a
    script's sys.path[0] is bench/), `lib` and its modules as a package."""
    modules = {p.stem: p for p in BENCH.glob("*.py")}
    modules |= {".".join(p.relative_to(BENCH).with_suffix("").parts).removesuffix(".__init__"): p
                for p in (BENCH / "lib").rglob("*.py")}  # fmt: skip
    return {name: {m for m in _imported(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_cycle_in_bench_and_no_bench_module_imports_the_tests():
    graph = bench_graph()
    assert "lib.split" in graph["dit_step"] and "lib.variants" in graph["lib.split"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
    fixtures = {p.stem for p in TESTS.glob("*.py")}
    files = [*BENCH.glob("*.py"), *(BENCH / "lib").rglob("*.py")]
    from_tests = {f"{p.relative_to(BENCH)}: {m}" for p in files for m in _imported(p) if m.split(".")[0] in fixtures}
    assert from_tests == set()
    assert [str(p.relative_to(BENCH)) for p in files if "sys.path.insert" in p.read_text(encoding="utf-8")] == []


# The layers, lowest first: a module imports only from its own layer or below (the data flow of docs/design.md).
LAYERS = (
    ("h3serve.vocab", "h3serve.config", "h3serve.errors", "h3serve.files", "h3serve"),
    ("h3serve.model", "h3serve.media"),
    ("h3serve.checkpoint",),  # reads checkpoints into model/'s architecture; accel's load hooks come in as values
    ("h3serve.accel",),
    ("h3serve.pipeline",),
    ("h3serve.parallel",),
    ("h3serve.settings", "h3serve.settings_doc"),
    ("h3serve.startup",),
    ("h3serve.service", "h3serve.accept"),
    ("h3serve.cli",),
)


def _layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or (n != "h3serve" and module.startswith(n + ".")) for n in names):
            return i
    raise AssertionError(f"{module} is in no layer")


def test_imports_follow_the_layers():
    graph = import_graph()
    upward = [f"{a} -> {b}" for a, edges in graph.items() for b in edges if _layer(b) > _layer(a)]
    assert upward == []
    assert _layer("h3serve.model.dit") < _layer("h3serve.checkpoint.dit") < _layer("h3serve.accel.apply")
    assert _layer("h3serve.accel.apply") < _layer("h3serve.pipeline.engine")


def test_no_global_statement_and_no_kernel_setter_in_the_package():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            if re.match(r"\s*global\s", line) or re.search(r"def use_\w*kernel", line):
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert offenders == []


# ---- the profile as a value ---------------------------------------------------------------------------------------


def test_a_cuda_profile_is_a_value_built_anywhere_and_checked_against_the_machine_apart():
    profile = Profile.for_device("cuda")
    assert (profile.attention, profile.execution, profile.linear) == (
        Attention.AUTO,  # FA4 or CUDNN_ATTN: the start asks the device (`accel.attention.resolve`)
        Execution.COMPILE,
        Linear.CUTLASS,
    )
    assert profile.as_dict()["linear"] == "CUTLASS" and profile.quantized_linears and profile.adaln_off_device
    if not torch.cuda.is_available():
        with pytest.raises(ProfileError) as err:
            check(profile)
        assert err.value.setting == "device" and "CUDA is not available" in str(err.value)


@pytest.mark.parametrize(
    ("values", "setting", "words"),
    [
        ({"device": "cuda", "linear": "HUMMING"}, "linear", "eager only"),
        ({"device": "cuda", "dtype": "float32"}, "attention", "no float32 kernel"),
        ({"device": "cpu", "attention": "CUDNN_ATTN"}, "attention", "allowed on cpu: TORCH_SDPA"),
        ({"device": "cpu", "linear": "FP4"}, "linear", "one of BF16, CUTLASS, HUMMING"),
        ({"device": "tpu"}, "device", "'cpu' or 'cuda[:N]'"),
    ],
)
def test_each_profile_rule_is_a_profile_error_naming_its_setting(values, setting, words):
    device = values.pop("device")
    with pytest.raises(ProfileError) as err:
        Profile.for_device(device, **values)
    assert err.value.setting == setting and words in str(err.value)


def test_the_defaults_table_covers_every_backend_field_for_every_device():
    for device, defaults in DEFAULTS.items():
        profile = Profile.for_device(device)
        assert {k: getattr(profile, k) for k in defaults} == defaults


# ---- two engines in one process -----------------------------------------------------------------------------------

PROMPT = "a red fox runs through fresh snow"


def _mp4(engine, seed: int) -> bytes:
    request = engine.validate(RequestFields(PROMPT, steps=3, seed=seed))
    result = engine.render(request)
    buffer = io.BytesIO()
    encode_mp4(buffer, result.frames, result.audio, fps=result.fps, sample_rate=result.sample_rate)
    return buffer.getvalue()


def _engine(dtype: str, step_cache: bool):
    from h3serve.accel.stepcache import parse_cache_config
    from h3serve.pipeline.engine import Engine

    config = '{"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "max_warmup_steps": 1, "residual_diff_threshold": 0.5}'
    cache = parse_cache_config(config) if step_cache else None
    return Engine.load(None, Profile.for_device("cpu", dtype=dtype), step_cache=cache)


ALONE = """
import io, sys
sys.path.insert(0, {tests!r})
from test_house import _engine, _mp4
sys.stdout.buffer.write(_mp4(_engine({dtype!r}, {cache!r}), 1))
"""


def _alone(dtype: str, step_cache: bool) -> bytes:
    code = ALONE.format(tests=str(Path(__file__).parent), dtype=dtype, cache=step_cache)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout


def test_two_engines_with_different_profiles_render_alternately_as_each_renders_alone():
    first = _engine("float32", step_cache=False)
    a_alone = _mp4(first, 1)
    second = _engine("bfloat16", step_cache=True)  # another dtype, and a step cache in its block stack
    b = [_mp4(second, 1)]
    a = [_mp4(first, 1)]
    b.append(_mp4(second, 1))
    a.append(_mp4(first, 1))
    assert a == [a_alone, a_alone] and b[0] == b[1]
    assert b[0] != a_alone  # the two profiles do differ, so equal bytes above mean something
    assert b[0] == _alone("bfloat16", True)  # the second engine, alone in a fresh process
    dit = first.components.dit
    assert "block_stack" not in dit.__dict__ or not dit.block_stack.wrappers  # the cache is the second's only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_cuda_engines_with_different_kernels_keep_their_own_numbers():
    """The state that was process-wide (attention kernel, qk pass, block passes): a compiled cuDNN CUTLASS engine and
    an eager SDPA BF16 engine, alternately, each as it renders alone."""
    from h3serve.pipeline.engine import Engine

    fast = Profile.for_device("cuda")
    exact = Profile.for_device("cuda", attention="TORCH_SDPA", execution="eager", linear="BF16")
    first = Engine.load(None, exact)
    alone = _frames(first)
    second = Engine.load(None, fast)
    other = _frames(second)
    assert np.array_equal(_frames(first), alone) and np.array_equal(_frames(second), other)
    assert not np.array_equal(alone, other)


def _frames(engine) -> np.ndarray:
    return engine.render(engine.validate(RequestFields(PROMPT, steps=3, seed=1))).frames


# ---- one settings vocabulary --------------------------------------------------------------------------------------


def test_render_reads_the_h3_environment_and_says_so_in_its_header(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("H3_DTYPE", "bfloat16")
    out = tmp_path / "fox.mp4"
    assert main(["render", PROMPT, "-o", str(out), "--steps", "2", "--no-progress"]) == 0
    header = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("h3serve: "))
    assert "dtype=bfloat16" in header and "2 grid points (1 DiT forward)" in header, header


def test_render_refuses_an_unknown_h3_variable_and_a_bad_value_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("H3_EXECUTION_MOD", "eager")
    monkeypatch.setenv("H3_LINEAR_BACKEND", "FP4")
    out = tmp_path / "fox.mp4"
    assert main(["render", PROMPT, "-o", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "H3_EXECUTION_MOD: not an h3serve setting" in err
    assert "H3_LINEAR_BACKEND (--linear-backend)" in err and "'HUMMING'" in err
    assert not out.exists()


def test_render_takes_serve_flag_names_and_its_old_names_and_refuses_humming_without_cuda(tmp_path, capsys):
    out = tmp_path / "fox.mp4"
    for flag in ("--linear-backend", "--linear"):
        assert main(["render", PROMPT, "-o", str(out), flag, "HUMMING", "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert "H3_LINEAR_BACKEND (--linear-backend): linear HUMMING" in err, err
    assert not out.exists()


def test_render_and_serve_share_the_engine_flags():
    from h3serve.cli import build_parser
    from h3serve.errors import NO_FLAG
    from h3serve.settings import ENGINE_FIELDS, flag_name

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    render_flags = {s for a in sub["render"]._actions for s in a.option_strings}
    serve_flags = {s for a in sub["serve"]._actions for s in a.option_strings}
    engine_flags = {flag_name(f) for f in ENGINE_FIELDS if f not in NO_FLAG}  # a key is never a flag (ps shows it)
    assert engine_flags <= render_flags and engine_flags <= serve_flags
    assert "--node-key" not in render_flags | serve_flags
    assert {"--attention", "--execution", "--linear", "--threads"} <= render_flags


def test_help_lists_the_allowed_values_from_the_profile_enums():
    code = "from h3serve.cli import main; main(['render', '--help'])"
    text = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}
    ).stdout
    assert "auto|CUDNN_ATTN|CUDNN_FP8|FA4|TORCH_SDPA" in text
    assert "BF16|CUTLASS|HUMMING" in text and "compile|eager" in text
