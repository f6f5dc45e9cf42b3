"""The video decoder's Triton passes (`accel.vae.decoder_passes`) on the GPU: each bit for bit its plain reference at
the released decoder's widths under float16 (and bfloat16), and a whole decode with them bit for bit the decode
before issue 41 (`bench/lib/decode_before.py`) under the engine's float16 autocast.

Marked `gpu`: skipped without CUDA (the CPU machines and CI), run on the GPU machine with `pytest -m gpu`. What they
buy: bench/decode.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from h3serve.model.ops import rotary_table
from h3serve.model.video_vae import REFERENCE_PASSES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

S, HEADS, HEAD_DIM, DIM, HIDDEN = 1797, 32, 64, 2048, 8192  # a released decode tile: 7 x 16 x 16 latents + 5 tokens


@pytest.fixture(scope="module")
def fast():
    from h3serve.accel.vae import decoder_passes

    return decoder_passes()


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_each_pass_is_bitwise_its_reference(fast, dtype):
    x32, y = randn(1, S, DIM, scale=4.0), randn(1, S, DIM, dtype=dtype, scale=2.0, seed=1)
    scale = randn(DIM, scale=0.1, seed=2)
    for x in (x32, x32.to(dtype)):  # the first block's stream is the embedding's dtype
        want = REFERENCE_PASSES.residual(x, y, scale)
        got = fast.residual(x, y, scale)
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    f = randn(1, S, 2 * HIDDEN, dtype=dtype, scale=3.0, seed=3)
    assert torch.equal(fast.swiglu(f), REFERENCE_PASSES.swiglu(f))
    qkv = randn(1, S, HEADS, 3 * HEAD_DIM, dtype=dtype, scale=3.0, seed=4)
    q, k = qkv[..., :HEAD_DIM], qkv[..., HEAD_DIM : 2 * HEAD_DIM]  # the projection's views, as the block has them
    angles = randn(S, 24, scale=3.0, seed=5)
    cos, sin = rotary_table(angles)  # R = 48 of 64: 16 channels pass through
    want_q, want_k = REFERENCE_PASSES.qk(q, k, 1e-5, cos, sin)
    got_q, got_k = fast.qk(q, k, 1e-5, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_a_decode_with_the_passes_is_bitwise_the_decode_before(fast):
    from lib.decode_before import decode_before

    from h3serve.accel import attention
    from h3serve.accel.profile import Attention
    from h3serve.accel.vae import decoder_weights_to, set_decoder_passes
    from h3serve.model.video_vae import VideoVAE, VideoVAEConfig

    cfg = VideoVAEConfig(
        block_out_channels=(32, 32), layers_per_block=1, spatial_downsample_factors=(2, 2),
        temporal_downsample_factors=(2, 2), decoder_num_layers=3, decoder_num_attention_heads=4,
        decoder_attention_head_dim=64, latents_mean=[0.0] * 24, latents_std=[1.0] * 24, tile_size=32,
        tile_overlap_min=8,
    )  # fmt: skip
    torch.manual_seed(0)
    vae = VideoVAE(cfg).cuda().eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.2 * torch.randn_like(p))
    decoder_weights_to(vae, torch.float16)
    attention.set_kernel(vae, Attention.CUDNN_ATTN)
    z = randn(1, 24, 12, 14, 18, seed=6)  # two windows, 3 x 3 tiles
    before = decode_before(vae, z, torch.float16)
    set_decoder_passes(vae, fast)
    now = vae.decode(z, autocast_dtype=torch.float16)
    assert torch.equal(now, before)
