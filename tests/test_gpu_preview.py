"""Previews on the GPU with the tiny model (`pipeline.preview`): a compiled render (and an eager one) with a preview
every two forwards (the first after one) is bitwise the render without, the previews come where asked, and the compile
gains no graph.

Marked `gpu`: skipped without CUDA (the CPU machines and CI), run on the GPU machine with `pytest -m gpu`. The
full-size measurement: `bench/render.py --preview-every`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3serve.accel.profile import Profile
from h3serve.pipeline.context import RenderContext
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT = "a red fox runs through fresh snow"


@pytest.mark.parametrize("execution", ["eager", "compile"])
def test_a_render_with_previews_is_bitwise_the_render_without(execution):
    torch._dynamo.reset()
    profile = Profile.for_device("cuda", attention="CUDNN_ATTN", execution=execution, linear="BF16")
    engine = Engine.load(None, profile)
    plain = engine.render(engine.validate(RequestFields(PROMPT, num_frames=39, steps=8, seed=42)))
    graphs = engine.compiled.graphs if engine.compiled is not None else 0
    previews = []
    request = engine.validate(RequestFields(PROMPT, num_frames=39, steps=8, seed=42, preview_every=2))
    shown = engine.render(request, RenderContext(on_preview=previews.append))
    np.testing.assert_array_equal(plain.frames, shown.frames)
    np.testing.assert_array_equal(plain.audio, shown.audio)
    assert [p.forward for p in previews] == [1, 3, 5] and all(p.png.startswith(b"\x89PNG") for p in previews)
    if engine.compiled is not None:
        assert engine.compiled.graphs == graphs and engine.compiled.recompiles == 0
