"""Every profile on the GPU with the tiny model: deterministic, and close to the exact profile (BF16 eager).

Marked `gpu`: skipped without CUDA (the CPU machines and CI), run on the GPU machine with `pytest -m gpu`; the FA4
rows also where FA4 cannot run (`fa4.missing()`).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from h3serve.accel import fa4
from h3serve.accel.profile import Profile
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
FA4_MISSING = fa4.missing()  # why FA4 cannot run here (below sm90, not installed), or None


def with_fa4(*values):
    """A parameter row that runs FA4: skipped with FA4_MISSING's reason where FA4 cannot run."""
    return pytest.param(*values, marks=() if FA4_MISSING is None else pytest.mark.skip(reason=FA4_MISSING))


PROFILES = [
    *itertools.product(("TORCH_SDPA", "CUDNN_ATTN"), ("eager", "compile"), ("BF16", "CUTLASS")),
    ("CUDNN_ATTN", "eager", "HUMMING"),  # eager only; needs humming-kernels (the profile refuses clearly without)
    # FP8 attention (needs the cuDNN frontend: the profile refuses clearly without)
    *itertools.product(("CUDNN_FP8",), ("eager", "compile"), ("BF16", "CUTLASS")),
    # FA4: exact attention, so CUDNN_ATTN's bounds
    *(with_fa4("FA4", *row) for row in itertools.product(("eager", "compile"), ("BF16", "CUTLASS"))),
    ("auto", "compile", "CUTLASS"),  # the CUDA default: FA4 or CUDNN_ATTN, as the engine resolves it on this GPU
]
# Relative difference to the exact profile's float output the tiny random model may show: compile reorders bf16
# arithmetic; FP8 rounds every block GEMM's operands.
TOLERANCE = {"BF16": 5e-2, "CUTLASS": 2e-1, "HUMMING": 2e-1}
FP8_ATTENTION_TOLERANCE = 2.5e-1  # FP8 attention rounds q, k, v and the probabilities too


def _render(profile: Profile):
    torch._dynamo.reset()
    engine = Engine.load(None, profile)
    request = engine.validate(RequestFields("a red fox runs through fresh snow", num_frames=39, steps=6, seed=42))
    return engine.render(request), engine.render(request), engine


@pytest.fixture(scope="module")
def exact():
    return _render(Profile.for_device("cuda", attention="TORCH_SDPA", execution="eager", linear="BF16"))[0]


@pytest.mark.parametrize(("attention", "execution", "linear"), PROFILES)
def test_profile_is_deterministic_and_close_to_the_exact_profile(exact, attention, execution, linear):
    one, two, engine = _render(Profile.for_device("cuda", attention=attention, execution=execution, linear=linear))
    np.testing.assert_array_equal(one.frames, two.frames)
    np.testing.assert_array_equal(one.audio, two.audio)
    if execution == "compile":
        assert engine.compiled.recompiles == 0
    audio_err = np.linalg.norm(one.audio - exact.audio) / np.linalg.norm(exact.audio)
    frames_err = np.abs(one.frames.astype(np.float32) - exact.frames.astype(np.float32)).mean() / 255
    tolerance = FP8_ATTENTION_TOLERANCE if attention == "CUDNN_FP8" else TOLERANCE[linear]
    print(f"{engine.profile.attention} {execution} {linear}: audio {audio_err:.3e}, frames {frames_err:.3e}")
    assert audio_err < tolerance, audio_err
    assert frames_err < tolerance, frames_err


def test_decoder_weights_in_float16_decode_bitwise_as_float32_weights_under_cuda_autocast():
    from h3serve.accel.vae import decoder_weights_to
    from h3serve.model.tiny import TINY_SEED, TINY_VIDEO_VAE, randomize
    from h3serve.model.video_vae import VideoVAE
    from h3serve.pipeline.video_decode import decode

    vae = randomize(VideoVAE(TINY_VIDEO_VAE), TINY_SEED + 1).cuda()
    z = torch.randn(1, TINY_VIDEO_VAE.latent_channels, 3, 4, 6, generator=torch.Generator().manual_seed(0)).cuda()
    expected = decode(vae, z, autocast_dtype=torch.float16)
    assert decoder_weights_to(vae, torch.float16) > 0
    assert torch.equal(decode(vae, z, autocast_dtype=torch.float16), expected)
