"""Streamed weights on the GPU with the tiny model (`pipeline.placement`, `accel.offload`): every streamable part
streamed (both DiT blocks through one slot, the text encoder's layers, the video VAE visiting) renders bitwise what the
resident engine renders, eager and compiled (with the resident engine's graphs and no recompile), from page-locked host
memory, holding less on the device.

Marked `gpu`: skipped without CUDA (the CPU machines and CI), run on the GPU machine with `pytest -m gpu`. The
full-size measurement: bench/offload.py.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from h3serve.accel.profile import Profile
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.placement import RESIDENT, Placement
from h3serve.pipeline.request import RequestFields

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STREAMED = Placement(dit_streamed=(0, 1), dit_blocks=2, slots=1, text_streamed=True, video_vae_visits=True)
PROMPT = "a red fox runs through fresh snow"
REQUEST = dict(num_frames=39, steps=6, seed=42)


def _profile(execution: str = "eager", linear: str = "BF16") -> Profile:
    # cuDNN attention named (not auto): no FA4 self-test per engine; the CUDA defaults otherwise (AdaLN weights
    # pinned in host memory).
    return Profile.for_device("cuda", attention="CUDNN_ATTN", execution=execution, linear=linear)


def _render(profile: Profile, placement: Placement):
    torch._dynamo.reset()  # each engine's compile counted from nothing (`GraphCounter`)
    engine = Engine.load(None, profile, placement=placement)
    result = engine.render(engine.validate(RequestFields(PROMPT, **REQUEST)))
    torch.cuda.synchronize()
    return result, engine


def _assert_bitwise(streamed, resident) -> None:
    np.testing.assert_array_equal(streamed.frames, resident.frames)
    np.testing.assert_array_equal(streamed.audio, resident.audio)
    assert streamed.audio.dtype == resident.audio.dtype and streamed.frames.shape == resident.frames.shape


def test_an_eager_render_with_every_part_streamed_is_bitwise_the_resident_render():
    profile = _profile()
    resident, _ = _render(profile, RESIDENT)
    streamed, engine = _render(profile, STREAMED)
    _assert_bitwise(streamed, resident)
    offloaded = engine.offloaded
    # Everything streamed did stream: each DiT block copied in for each forward (one slot, two blocks), the text
    # encoder's layers once, the video VAE visited for the decode (T2VA: no keyframes to encode).
    forwards = engine.validate(RequestFields(PROMPT, **REQUEST)).forwards
    assert offloaded.dits["fl2va"].copies >= 2 * forwards
    assert offloaded.text is not None and offloaded.text.copies >= offloaded.text.num_modules
    assert offloaded.video is not None and offloaded.video.visits == 1


MIXED = Placement(dit_streamed=(1,), dit_blocks=2, slots=2)  # one block resident, one streamed: one compiled code


@pytest.mark.parametrize("placement", [STREAMED, MIXED], ids=["everything", "mixed"])
@pytest.mark.parametrize("linear", ["BF16", "CUTLASS"])
def test_a_compiled_render_with_every_part_streamed_is_bitwise_the_resident_one_with_its_graphs(linear, placement):
    """Mixed: a streamed CUTLASS block's (1, N) FP8 scale kept its strides (1, 1), so it passes the resident block's
    guards (the H200's reference run with 42 of 50 blocks streamed recompiled once before they were kept)."""
    profile = _profile("compile", linear)
    resident, resident_engine = _render(profile, RESIDENT)
    graphs = resident_engine.compiled.graphs
    assert resident_engine.compiled.recompiles == 0
    del resident_engine
    streamed, engine = _render(profile, placement)
    _assert_bitwise(streamed, resident)
    # The ring of slots is where the first render left it.
    again = engine.render(engine.validate(RequestFields(PROMPT, **REQUEST)))
    _assert_bitwise(again, resident)
    assert engine.compiled.recompiles == 0
    assert engine.compiled.graphs == graphs


def _device_bytes(profile: Profile, placement: Placement):
    """What an engine holds on the device after a render (against what was allocated before its load), and the
    engine."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    _, engine = _render(profile, placement)
    gc.collect()
    return torch.cuda.memory_allocated() - base, engine


def test_streamed_weights_wait_in_page_locked_host_memory_and_leave_the_device():
    profile = _profile()
    _render(profile, RESIDENT)  # first: what stays allocated after any render (library workspaces) is in both bases
    streamed_bytes, engine = _device_bytes(profile, STREAMED)
    offloaded = engine.offloaded
    dit, text, video = offloaded.dits["fl2va"], offloaded.text, offloaded.video
    assert text is not None and video is not None
    for host in (*dit.hosts, *text.hosts, video.host):
        assert host.pinned and host.tensor.is_pinned() and host.tensor.device.type == "cpu"
    # Both blocks run on the one slot's tensors, on the device; the visiting VAE is back in host memory after the
    # render.
    for block in engine.components.dit.blocks:
        assert block.norm1.weight is dit.slots[0]["norm1.weight"] and block.norm1.weight.device.type == "cuda"
    assert all(p.device.type == "cpu" for p in engine.components.video_vae.parameters())
    # What left the device: every streamed module less the one slot each stack keeps, and the whole video VAE.
    left = sum((s.num_modules - s.num_slots) * s.bytes_per_module for s in (dit, text)) + video.bytes
    del engine, offloaded, dit, text, video
    resident_bytes, _ = _device_bytes(profile, RESIDENT)
    print(f"on the device: resident {resident_bytes:,} B, streamed {streamed_bytes:,} B; {left:,} B streamed")
    assert streamed_bytes < resident_bytes
    assert resident_bytes - streamed_bytes >= 0.5 * left, (resident_bytes, streamed_bytes, left)
