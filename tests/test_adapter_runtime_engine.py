"""Run-time adapters through the engine (tiny model, CPU): a request without one is bit for bit a server without
adapters declared; with one (or two, or one that changes AdaLN) close to the same adapters merged at load, its
trained sampler the request's default; AdaLN tables made once per adapter set and found again; every refusal names
the field, the index and what is allowed; the settings refuse a bad declaration before anything loads; a render
split over two workers applies the adapters as one process does."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from adapter_fixtures import write_adapter
from h3serve.accel.profile import Profile
from h3serve.checkpoint.adapters import read_adapter
from h3serve.checkpoint.adapters.library import AdapterLibrary, Declaration
from h3serve.model.tiny import TINY_DIT
from h3serve.parallel.workers import ParallelEngine, WorkerSpec
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields
from h3serve.pipeline.rules import RequestError
from h3serve.settings import SettingsError, load_settings

CPU = Profile.for_device("cpu")
PROMPT = "a red fox in fresh snow"
FOUR_STEP = "minimax_h3_fl2v_turbo_4step_v1.0_768p.safetensors"  # LightX2V's name: 5 points, shift 6


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    (root / "style").mkdir()
    (root / "larry").mkdir()
    return {
        "turbo": write_adapter(root / FOUR_STEP, "lightx2v-diffusers", TINY_DIT, rank=4, seed=1),
        "style": write_adapter(root / "style", "comfyui-fused", TINY_DIT, rank=4, seed=2),
        "larry": write_adapter(root / "larry", "native", TINY_DIT, rank=8, seed=3),  # touches AdaLN
    }


@pytest.fixture(scope="module")
def declaration(paths):
    return Declaration(tuple((n, p, 0.5 if n == "style" else 1.0) for n, p in paths.items()), 2**30, 2)


@pytest.fixture(scope="module")
def engine(declaration):
    return Engine.load(None, CPU, library=declaration.open(TINY_DIT))


@pytest.fixture(scope="module")
def plain():
    return Engine.load(None, CPU)


def fields(**kw) -> RequestFields:
    return RequestFields(PROMPT, seed=3, steps=kw.pop("steps", 5), **kw)


def test_a_request_without_adapters_is_the_plain_servers_render_bit_for_bit(engine, plain):
    ours, theirs = engine.render(engine.validate(fields())), plain.render(plain.validate(fields()))
    assert np.array_equal(ours.frames, theirs.frames) and np.array_equal(ours.audio, theirs.audio)
    assert ours.request.adapters == () and ours.timings["adapters"] >= 0.0


@pytest.mark.parametrize("chosen", [[("style", None)], [("turbo", 1.0), ("style", -0.7)], [("larry", 1.5)]])
def test_adapters_at_run_time_render_as_the_same_adapters_merged(engine, paths, chosen):
    request = engine.validate(fields(adapters=chosen))
    scales = {"style": 0.5, "turbo": 1.0, "larry": 1.0}
    assert request.adapters == tuple((n, scales[n] if s is None else s) for n, s in chosen)
    merged = Engine.load(None, CPU, adapters=[read_adapter(paths[n], s, config=TINY_DIT) for n, s in request.adapters])
    want = merged.render(merged.validate(fields()))
    got = engine.render(request)
    plain = engine.render(engine.validate(fields()))
    frames = np.abs(got.frames.astype(int) - want.frames.astype(int))
    moved = np.abs(plain.frames.astype(int) - want.frames.astype(int))
    # float32: a rounding here and there
    assert frames.max() <= 1 and frames.mean() < 1e-3, (frames.max(), frames.mean())
    assert moved.mean() > 10 * max(frames.mean(), 1e-4)  # the adapter moved the render far more than that
    assert np.abs(got.audio - want.audio).max() < 1e-5


def test_an_adapters_trained_sampler_is_the_default_of_a_request_that_names_it(engine):
    request = engine.validate(RequestFields(PROMPT, adapters=[("turbo", None)]))
    assert (request.steps, request.video_shift) == (5, 6.0)  # the file's name: 4 steps, 768p
    own = engine.validate(RequestFields(PROMPT, steps=9, adapters=[("turbo", None)]))
    assert own.steps == 9
    assert engine.validate(RequestFields(PROMPT)).steps == engine.admission.sampler.steps == 50


def test_adaln_tables_are_made_once_per_adapter_set_and_found_again(engine):
    tables = engine.tables["fl2va"]
    for chosen in ([("larry", 1.0)], [("larry", 0.5)], [("style", 1.0)], []):
        engine.render(engine.validate(fields(adapters=chosen)))
    keys = {key[2] for key in tables._cache}
    assert {(("larry", 1.0),), (("larry", 0.5),), ()} <= keys
    assert (("style", 1.0),) not in keys  # no AdaLN in it: the plain tables serve
    made = dict(tables._cache)
    engine.render(engine.validate(fields(adapters=[("larry", 0.5)])))
    assert all(tables._cache[k] is v for k, v in made.items() if k in tables._cache)
    assert set(tables._cache) <= set(made)


@pytest.mark.parametrize(
    ("asked", "index", "message"),
    [
        ([("other", None)], 0, r'adapters\[0\] "other" is not declared here; declared: turbo, style, larry'),
        ([("turbo", None), ("turbo", 0.5)], 1, "turbo is named twice"),
        ([("style", 9.0)], 0, r"style's scale must be within -4..4 and not 0 \(leave the adapter out .*\), got 9"),
        ([("style", 0)], 0, "and not 0"),
        ([("style", float("nan"))], 0, "must be a finite number"),
        (
            [("turbo", 1), ("style", 1), ("larry", 1)],
            None,
            r"at most 2 at once on this server \(H3_ADAPTER_MAX_ACTIVE .*got 3",
        ),
    ],
)
def test_each_refusal_names_the_field_the_index_and_what_is_allowed(engine, asked, index, message):
    with pytest.raises(RequestError, match=message) as err:
        engine.validate(fields(adapters=asked))
    assert err.value.field == "adapters" and err.value.index == index


def test_a_server_without_declared_adapters_refuses_a_request_naming_one(plain):
    with pytest.raises(RequestError, match=r"declares none to apply per request .*H3_ADAPTERS"):
        plain.validate(fields(adapters=[("turbo", None)]))


def test_the_settings_refuse_a_bad_declaration_before_anything_loads(paths, tmp_path):
    good = f"turbo={paths['turbo']}"
    cases = {
        "turbo": "write NAME=PATH[:SCALE]",
        f"-x={paths['turbo']}": 'adapter name "-x"',
        f"{good},turbo={paths['style']}": '"turbo" is declared twice',
        f"turbo={paths['turbo']}:0": "scale 0 must be within -4 and 4, and not 0",
        f"turbo={paths['turbo']}:5": "scale 5 must be within",
        f"turbo={tmp_path / 'missing.safetensors'}": "turbo: ",
    }
    for value, message in cases.items():
        with pytest.raises(SettingsError, match=re.escape(message)):
            load_settings(env={"H3_ADAPTERS": value}, check_profile=False)
    with pytest.raises(SettingsError, match=r"H3_ADAPTER_MAX_ACTIVE.*given, but H3_ADAPTERS declares no adapters"):
        load_settings(env={"H3_ADAPTER_MAX_ACTIVE": "3"}, check_profile=False)
    settings = load_settings(env={"H3_ADAPTERS": f"{good}:0.8", "H3_ADAPTER_MAX_ACTIVE": "3"}, check_profile=False)
    declaration = settings.adapter_declaration()
    assert declaration.adapters == (("turbo", paths["turbo"], 0.8),) and declaration.max_active == 3


def test_a_split_render_applies_the_adapters_as_one_process_does(declaration):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs: the one-process render's bits (tests/test_parallel.py)
    try:
        one = Engine.load(None, CPU, library=declaration.open(TINY_DIT))
        request = fields(num_frames=22, adapters=[("turbo", 1.0), ("larry", 0.5)])
        want = one.render(one.validate(request))
    finally:
        torch.set_num_threads(threads)
    split = ParallelEngine(WorkerSpec(None, CPU, 2, cpu_threads=1, declaration=declaration))
    try:
        assert split.admission.catalog.names == ("turbo", "style", "larry")
        got = split.render(split.validate(request))
    finally:
        split.close()
    assert np.array_equal(got.frames, want.frames) and np.array_equal(got.audio, want.audio)


def test_a_library_refuses_an_adapter_larger_than_its_cache(paths):
    with pytest.raises(ValueError, match=r"the adapter cache holds 0.00 GiB: raise it"):
        AdapterLibrary([("turbo", paths["turbo"], 1.0)], TINY_DIT, 1024, 1)


def test_the_memory_plan_counts_the_buffers_the_engine_makes(engine):
    from h3serve.pipeline.budget import tiny_budget
    from h3serve.startup import with_adapters

    budget = with_adapters(tiny_budget(CPU, "fl2va"), engine.library, TINY_DIT, CPU, "fl2va")
    made = sum(runtime.buffer_bytes for runtime in engine.runtime.values())
    assert made > 0 and budget.device["adapter buffers"] * 2**30 == pytest.approx(made, rel=1e-12)


def test_streamed_blocks_carry_their_adapters_and_render_as_resident_ones(engine, declaration):
    from h3serve.pipeline.placement import Placement

    placement = Placement(dit_streamed=(0, 1), dit_blocks=2, slots=1)  # every block streams through one slot
    streamed = Engine.load(None, CPU, placement=placement, library=declaration.open(TINY_DIT))
    for chosen in ([("larry", 1.0), ("turbo", 0.5)], [], [("style", 2.0)]):
        want = engine.render(engine.validate(fields(adapters=chosen)))
        got = streamed.render(streamed.validate(fields(adapters=chosen)))
        assert np.array_equal(got.frames, want.frames) and np.array_equal(got.audio, want.audio), chosen


def test_the_cli_applies_a_declared_adapter_and_names_a_refused_one_by_its_flag(paths, tmp_path):
    import subprocess
    import sys

    env = {"H3_ADAPTERS": f"turbo={paths['turbo']},style={paths['style']}:0.5", "PATH": "/usr/bin:/bin"}
    base = [sys.executable, "-m", "h3serve.cli", "render", PROMPT, "--steps", "3", "--no-progress"]
    done = subprocess.run([*base, "-o", str(tmp_path / "a.mp4"), "--apply", "style", "--apply", "turbo:0.25"],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "adapter at run time: style at scale 0.5" in done.stderr
    assert "adapters style:0.5, turbo:0.25 applied in" in done.stdout + done.stderr
    refused = subprocess.run([*base, "-o", str(tmp_path / "b.mp4"), "--apply", "other"], env=env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert refused.returncode != 0 and '--apply other: "other" is not declared here' in refused.stderr
    assert not (tmp_path / "b.mp4").exists()
