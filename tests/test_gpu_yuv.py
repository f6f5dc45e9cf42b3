"""The encoder's frames made on the GPU (`media.yuv.rgb_to_i420` where the decode runs, `pipeline.decode.to_host`
through page-locked memory): bit for bit the host's conversion at the released default request's size, and a render
on CUDA streamed into its MP4 is byte for byte the MP4 of its frames written whole (converted on the host).

Marked `gpu`: skipped without CUDA (the CPU machines and CI), run on the GPU machine with `pytest -m gpu`. What they
buy: bench/encode.py.
"""

from __future__ import annotations

import pytest
import torch

from h3serve.accel.profile import Profile
from h3serve.media.mp4 import Mp4Writer, write_mp4
from h3serve.media.yuv import rgb_to_i420
from h3serve.pipeline.context import RenderContext
from h3serve.pipeline.decode import to_host
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_gpu_conversion_is_the_hosts_bit_for_bit_at_the_default_size():
    g = torch.Generator("cuda").manual_seed(0)
    noise = torch.randint(0, 256, (9, 768, 1344, 3), generator=g, device="cuda", dtype=torch.uint8)
    ramp = torch.arange(1344, device="cuda").remainder(256).to(torch.uint8).expand(9, 768, 1344)
    for frames in (
        noise,
        torch.stack([ramp, ramp.flip(-1), ramp.transpose(1, 2)[:, :768, :768].repeat(1, 1, 2)[..., :1344]], -1),
    ):
        on_gpu = to_host(rgb_to_i420(frames))
        on_host = rgb_to_i420(frames.cpu()).numpy()
        assert on_gpu.shape == (9, 1152, 1344) and (on_gpu == on_host).all()


def test_a_render_on_cuda_streamed_into_its_mp4_is_the_mp4_of_its_frames_written_whole(tmp_path):
    engine = Engine.load(None, Profile.for_device("cuda"))
    request = engine.validate(RequestFields("a tram crosses a bridge in the rain", steps=3, seed=5, num_frames=56))
    whole = engine.render(request)
    writer = Mp4Writer(tmp_path / "streamed.mp4")
    engine.render(request, RenderContext(frames_to=writer))
    writer.finish()
    write_mp4(tmp_path / "whole.mp4", whole.frames, whole.audio, fps=whole.fps, sample_rate=whole.sample_rate)
    assert (tmp_path / "streamed.mp4").read_bytes() == (tmp_path / "whole.mp4").read_bytes()
