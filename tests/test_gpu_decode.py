"""The video decoder's Triton passes (`accel.vae.decoder_passes`) on the GPU: each bit for bit its plain reference at
the released decoder's widths under float16 (and bfloat16; the norms also without autocast, and over rows whose
scales span six decades), and a whole decode with them bit for bit the decode
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
from h3serve.pipeline.video_decode import decode, decode_window

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
    for got_q, got_k in (fast.qk(q, k, 1e-5, cos, sin), fast.qk(q.contiguous(), k.contiguous(), 1e-5, cos, sin)):
        assert got_q.is_contiguous() and torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def rows_of_every_scale(n: int, seed: int) -> torch.Tensor:
    """S rows of n channels whose magnitudes span 1e-3 to 1e3 (so the sums of squares round in many places)."""
    return randn(1, S, n, seed=seed) * torch.logspace(-3, 3, S, device="cuda")[None, :, None]


@pytest.mark.parametrize("autocast", [torch.float16, torch.bfloat16, None])
def test_the_norm_passes_are_bitwise_torchs_rms_norm(fast, autocast):
    """The block norms (2048 channels, the weight) and the add before them: what torch's float32 rms_norm gives,
    rounded to the projection's dtype as autocast's cast rounds it (float32 without autocast: the norm itself)."""
    out_dtype = autocast or torch.float32
    weight = 1.0 + randn(DIM, scale=0.3, seed=7)
    scale = randn(DIM, scale=0.1, seed=8)
    with torch.autocast("cuda", dtype=autocast or torch.float16, enabled=autocast is not None):
        for seed in range(3):
            x = rows_of_every_scale(DIM, 10 + seed)
            y = randn(1, S, DIM, dtype=autocast or torch.float32, scale=2.0, seed=20 + seed)
            for stream in (x, x.to(torch.float16)):  # the first block's norm reads the embedding's float16
                got = fast.norm(stream, weight, 1e-5)
                want = REFERENCE_PASSES.norm(stream, weight, 1e-5).to(out_dtype)
                assert got.dtype == out_dtype and torch.equal(got, want), (seed, stream.dtype)
            got_x, got_h = fast.residual_norm(x, y, scale, weight, 1e-5)
            want_x, want_h = REFERENCE_PASSES.residual_norm(x, y, scale, weight, 1e-5)
            assert torch.equal(got_x, want_x) and torch.equal(got_h, want_h.to(out_dtype)), seed


def test_the_qk_norm_is_bitwise_at_every_scale(fast):
    """q and k whose head vectors span six decades, in float16 and float32 (no autocast)."""
    cos, sin = rotary_table(randn(S, 24, scale=3.0, seed=5))
    for dtype in (torch.float16, torch.float32):
        qkv = rows_of_every_scale(HEADS * 3 * HEAD_DIM, 30).view(1, S, HEADS, 3 * HEAD_DIM).to(dtype)
        q, k = qkv[..., :HEAD_DIM], qkv[..., HEAD_DIM : 2 * HEAD_DIM]
        want_q, want_k = REFERENCE_PASSES.qk(q, k, 1e-5, cos, sin)
        got_q, got_k = fast.qk(q, k, 1e-5, cos, sin)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k), dtype


def test_a_decode_with_the_passes_is_bitwise_the_decode_before(fast):
    from lib.decode_before import decode_before

    from h3serve.accel import attention
    from h3serve.accel.profile import Attention
    from h3serve.accel.vae import decoder_weights_to, set_decoder_passes
    from test_decode_exact import tiny_vae

    vae = tiny_vae(device="cuda", decoder_num_layers=3, decoder_num_attention_heads=4, decoder_attention_head_dim=64,
                   tile_size=32, tile_overlap_min=8)  # fmt: skip
    decoder_weights_to(vae, torch.float16)
    attention.set_kernel(vae, Attention.CUDNN_ATTN)
    z = randn(1, 24, 12, 14, 18, seed=6)  # two windows, 3 x 3 tiles
    before = decode_before(vae, z, torch.float16)
    set_decoder_passes(vae, fast)
    now = decode(vae, z, autocast_dtype=torch.float16)
    assert torch.equal(now, before)


@pytest.mark.parametrize("batch", [2, 4, 7])
def test_tiles_decoded_in_batches_are_bitwise_alone_at_the_released_shapes(fast, batch):
    """The released decoder's widths and tile (two of its 36 blocks), the default request's window (7 x 48 x 84
    latents: 28 tiles of 1,797 tokens), the engine's CUDA decode: a batch of tiles gives every tile the bits it has
    alone (cuBLAS's GEMMs and cuDNN's attention are row and batch invariant here), `CUDA_TILE_BATCH` included."""
    import dataclasses

    from lib.models import fill_random, released_configs

    from h3serve.accel import attention
    from h3serve.accel.profile import Attention
    from h3serve.accel.vae import CUDA_TILE_BATCH, decoder_weights_to, set_decoder_passes, set_tile_batch
    from h3serve.model.video_vae import VideoVAE

    assert CUDA_TILE_BATCH in (2, 4, 7), "the engine's batch must be one this test holds"
    cfg = dataclasses.replace(released_configs().video_vae_config, decoder_num_layers=2)
    vae = VideoVAE(cfg).to("cuda").eval()
    torch.manual_seed(0)
    with torch.no_grad():
        fill_random(vae)
    decoder_weights_to(vae, torch.float16)
    attention.set_kernel(vae, Attention.CUDNN_ATTN)
    set_decoder_passes(vae, fast)
    z = randn(1, 24, 7, 48, 84, seed=9)
    alone = decode_window(vae, z, autocast_dtype=torch.float16)
    set_tile_batch(vae, batch)
    assert torch.equal(decode_window(vae, z, autocast_dtype=torch.float16), alone)
