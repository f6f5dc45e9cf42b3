"""Acceleration seams on the CPU: the attention-kernel registry, the fixed-shape modulation table, and regional
compilation with no recompiles across steps and requests (counted, not assumed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.accel import attention
from h3serve.accel.compile import compile_repeated_blocks
from h3serve.config import MAX_TIMESTEPS, NUM_MODALITIES
from h3serve.model import ops
from h3serve.model.dit import TABLE_ROWS
from h3serve.pipeline.engine import Engine, Profile


@pytest.fixture
def engine() -> Engine:
    return Engine.load(None, Profile())


def _requests(engine: Engine):
    """Requests that differ in everything a compiled block could specialise on: prompt length, task, keyframe
    count, canvas and frame count (so the row count S), and the number of distinct timesteps per step."""
    key = Image.new("RGB", (64, 48), (200, 40, 10))
    return [
        engine.validate("a fox", steps=4, seed=1),
        engine.validate(
            "a much longer prompt: a red fox runs through fresh snow under a low winter moon, wind in the pines",
            task="i2va",
            keyframes=[key],
            width=256,
            height=128,
            num_frames=39,
            steps=3,
            seed=2,
        ),
        engine.validate("first and last", task="fl2va", keyframes=[key, key], width=160, height=96, steps=3, seed=3),
    ]


def test_regional_compile_compiles_two_graphs_and_never_recompiles(engine):
    """aot_eager runs Dynamo's tracing and guards (where recompiles come from) without Inductor's code generation,
    which takes most of a minute per graph on this CPU; GPU runs use Inductor (bench/dit_step.py counts there)."""
    requests = _requests(engine)
    eager = [engine.render(r) for r in requests]
    counter = compile_repeated_blocks(engine.components.dit, backend="aot_eager")
    compiled = [engine.render(r) for r in requests]
    assert counter.graphs == 2, counter.compiles  # Block and RefinerBlock, compiled once each
    assert counter.recompiles == 0, counter.compiles
    for a, b in zip(eager, compiled, strict=True):
        np.testing.assert_array_equal(a.frames, b.frames)
        np.testing.assert_array_equal(a.audio, b.audio)


def test_compile_refuses_a_model_without_repeated_blocks():
    with pytest.raises(ValueError, match="no repeated blocks"):
        compile_repeated_blocks(torch.nn.Linear(2, 2))


def test_every_attention_call_goes_through_the_chosen_kernel(engine):
    """The DiT (blocks and refiner), the video decoder and the audio VAE all attend through `ops.attention`, so the
    kernel set once at start is the one that runs everywhere."""
    calls: list[tuple[int, ...]] = []

    def counting(q, k, v, causal):
        calls.append(tuple(q.shape))
        return ops.sdpa(q, k, v, causal)

    request = engine.validate("a fox", steps=3, seed=1)
    reference = engine.render(request)
    ops.use_attention_kernel(counting)
    try:
        result = engine.render(request)
    finally:
        attention.use("TORCH_SDPA")
    dit = engine.components.dit
    forwards = request.steps - 1
    assert len(calls) >= len(dit.token_refiner.blocks) + forwards * len(dit.blocks) + 1  # + the decoders' layers
    np.testing.assert_array_equal(result.frames, reference.frames)


def test_attention_registry_refuses_what_the_device_cannot_run():
    with pytest.raises(ValueError, match="must be one of TORCH_SDPA, CUDNN_ATTN"):
        attention.check("FLASH4", torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDNN_ATTN needs a CUDA device"):
        attention.check("CUDNN_ATTN", torch.device("cpu"))
    attention.check("TORCH_SDPA", torch.device("cpu"))


def test_engine_sets_the_profile_kernel_at_start():
    ops.use_attention_kernel(attention.cudnn_sdpa)  # as a previous engine in this process might have left it
    Engine.load(None, Profile())
    assert ops._kernel is ops.sdpa


def test_modulation_table_has_a_fixed_shape_and_zero_padding(engine):
    dit = engine.components.dit
    block = dit.blocks[0]
    tables = []
    for m in range(1, MAX_TIMESTEPS + 1):
        temb = dit.time_embedder(torch.linspace(0.1, 0.9, m))
        table = block.modulation(temb, dit.compute_dtype)
        assert table.shape == (TABLE_ROWS, 6 * dit.config.hidden_size)
        assert torch.all(table[m * NUM_MODALITIES :] == 0)
        tables.append(table)
    # The first timestep's rows do not depend on which other timesteps share the forward.
    torch.testing.assert_close(tables[0][:NUM_MODALITIES], tables[2][:NUM_MODALITIES], rtol=0, atol=1e-6)


def test_compute_dtype_is_the_norms_not_a_linear_weights(engine):
    dit = engine.components.dit
    assert dit.compute_dtype == torch.float32
    with torch.no_grad():
        dit.blocks[0].attn.qkv_proj.weight.data = dit.blocks[0].attn.qkv_proj.weight.data.to(torch.float64)
    assert dit.compute_dtype == torch.float32  # a linear layer's storage does not decide the activations' dtype
