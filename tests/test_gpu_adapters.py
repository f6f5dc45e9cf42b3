"""Run-time adapters on a GPU (tiny model): compiled with CUTLASS FP8 linears (the wrappers take the fused passes'
quantized rows, the delta in the base's own wide GEMM) or BF16 ones, and over HUMMING's eager linears: a request
without one is bit for bit the server without adapters declared; with one, close to the adapter merged before
quantization; alternating adapters and none after the warmup's variants (one per number of adapters applied)
compiles nothing more; blocks streamed from page-locked memory render as resident ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adapter_fixtures import write_adapter
from h3serve.accel.profile import Profile
from h3serve.checkpoint.adapters import read_adapter
from h3serve.checkpoint.adapters.library import Declaration
from h3serve.model.tiny import TINY_DIT
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.placement import Placement
from h3serve.pipeline.request import RequestFields

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT = "a red fox in fresh snow"


@pytest.fixture(scope="module")
def declaration(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for name in ("a", "b"):
        (root / name).mkdir()
    paths = {
        "a": write_adapter(root / "a", "lightx2v-diffusers", TINY_DIT, rank=8, seed=1),
        "b": write_adapter(root / "b", "native", TINY_DIT, rank=8, seed=2),  # AdaLN too
    }
    return Declaration(tuple((n, p, 1.0) for n, p in paths.items()), 2**30, 2)


def fields(adapters=()) -> RequestFields:
    return RequestFields(PROMPT, seed=5, steps=5, adapters=adapters)


@pytest.mark.parametrize(("linear", "execution"), [("CUTLASS", "compile"), ("BF16", "compile"), ("HUMMING", "eager")])
def test_adapters_at_run_time_are_plain_without_one_and_near_merged_with_one(declaration, linear, execution):
    if linear == "HUMMING":
        from h3serve.accel.humming import available

        if available() is not None:
            pytest.skip(f"HUMMING: {available()}")
    profile = Profile.for_device("cuda", execution=execution, linear=linear)
    plain = Engine.load(None, profile)
    want_plain = plain.render(plain.validate(fields()))
    adapter = read_adapter(declaration.adapters[0][1], config=TINY_DIT)
    merged = Engine.load(None, profile, adapters=[adapter])
    want_a = merged.render(merged.validate(fields()))
    del plain, merged
    torch._dynamo.reset()
    engine = Engine.load(None, profile, library=declaration.open(TINY_DIT, pin=True))
    none = engine.render(engine.validate(fields()))
    assert np.array_equal(none.frames, want_plain.frames) and np.array_equal(none.audio, want_plain.audio)
    got = engine.render(engine.validate(fields([("a", None)])))
    diff = np.abs(got.frames.astype(int) - want_a.frames.astype(int))
    moved = np.abs(want_plain.frames.astype(int) - want_a.frames.astype(int))
    assert diff.mean() < moved.mean() / 4, (diff.mean(), moved.mean())  # FP8 or BF16 rounding, not the adapter
    engine.render(engine.validate(fields([("b", 0.5)])))
    engine.render(engine.validate(fields([("a", 1.0), ("b", 0.5)])))  # as the warmup: each count's width compiled
    before = engine.compiled.recompiles if engine.compiled is not None else 0
    for chosen in ([("a", 1.0)], [], [("b", 1.0), ("a", 0.3)], [("b", 2.0)], []):
        engine.render(engine.validate(fields(chosen)))
    assert (engine.compiled.recompiles if engine.compiled is not None else 0) == before
    again = engine.render(engine.validate(fields([("a", None)])))
    assert np.array_equal(again.frames, got.frames)


@pytest.mark.parametrize("linear", ["BF16", "CUTLASS"])
def test_streamed_blocks_with_adapters_render_as_resident_ones(declaration, linear):
    """BF16: streamed blocks carry the same delta as resident ones, bit for bit. CUTLASS: resident blocks take the
    delta into the base's own FP8 GEMM (the wide way), streamed ones beside it (an FP8 down projection, an addmm):
    without an adapter bit for bit, with one close (far closer than the adapter's own effect)."""
    profile = Profile.for_device("cuda", execution="eager", linear=linear)
    resident = Engine.load(None, profile, library=declaration.open(TINY_DIT, pin=True))
    placement = Placement(dit_streamed=(0, 1), dit_blocks=2, slots=1)
    streamed = Engine.load(None, profile, placement=placement, library=declaration.open(TINY_DIT, pin=True))
    plain = resident.render(resident.validate(fields()))
    for chosen in ([("a", 1.0), ("b", 0.5)], []):
        want = resident.render(resident.validate(fields(chosen)))
        got = streamed.render(streamed.validate(fields(chosen)))
        if linear == "BF16" or not chosen:
            assert np.array_equal(got.frames, want.frames) and np.array_equal(got.audio, want.audio), chosen
            continue
        diff = np.abs(got.frames.astype(int) - want.frames.astype(int)).mean()
        moved = np.abs(plain.frames.astype(int) - want.frames.astype(int)).mean()
        assert diff < moved / 4, (diff, moved)
