"""The video decode is bitwise the decode before issue 41 (`bench/lib/decode_before.py`, main at 8d6725d): the tiles
and windows cross-faded in place instead of by concatenation, the patch layout copied to float32 once, the blocks'
passes swappable (`ViTDecoder3d.passes`). On the CPU with the plain passes, tiled and untiled, one window and
several, in float32 and under bfloat16 autocast; the Triton passes are checked on the GPU (tests/test_gpu_decode.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from h3serve.model.video_vae import VideoVAE, VideoVAEConfig
from h3serve.pipeline.video_decode import decode, decode_window

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from lib.decode_before import decode_before, decode_window_before


def tiny_vae(seed: int = 0, device: str = "cpu", **decoder) -> VideoVAE:
    """A small tiled video VAE (ratios 4 and 4), every parameter perturbed; `decoder` overrides config fields."""
    fields = dict(decoder_num_layers=2, decoder_num_attention_heads=2, decoder_attention_head_dim=16, tile_size=16,
                  tile_overlap_min=4) | decoder  # fmt: skip
    cfg = VideoVAEConfig(
        block_out_channels=(32, 32), layers_per_block=1, spatial_downsample_factors=(2, 2),
        temporal_downsample_factors=(2, 2), latents_mean=[0.0] * 24, latents_std=[1.0] * 24, **fields,
    )  # fmt: skip
    torch.manual_seed(seed)
    vae = VideoVAE(cfg).to(device).eval()
    with torch.no_grad():
        for p in vae.parameters():  # the residual scales and registers start at zero: perturb all so each counts
            p.add_(0.2 * torch.randn_like(p))
    return vae


@pytest.fixture(scope="module")
def vae():
    return tiny_vae()


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
@pytest.mark.parametrize("latents", [7, 12, 18])  # one window; two with a cross-fade; three and a padded tail
def test_the_decode_is_bitwise_the_decode_before(vae, tiled, autocast, latents):
    z = torch.randn(1, 24, latents, 7, 9, generator=torch.Generator().manual_seed(latents))  # 28 x 36 px: 3 x 3 tiles
    now = decode(vae, z, tiled=tiled, autocast_dtype=autocast)
    before = decode_before(vae, z, autocast, tiled=tiled)
    assert now.shape == before.shape and now.dtype == before.dtype == torch.float32
    assert torch.equal(now, before)
    if tiled:  # the tiles really were blended: an untiled decode differs at the seams
        assert not torch.equal(now, decode(vae, z, tiled=False, autocast_dtype=autocast))


def test_a_window_is_bitwise_the_window_before(vae):
    z = torch.randn(2, 24, 3, 7, 9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(
        decode_window(vae, z, autocast_dtype=torch.bfloat16), decode_window_before(vae, z, torch.bfloat16)
    )


def test_the_passes_are_what_the_blocks_run(vae, monkeypatch):
    """A decoder given other passes runs them (the hook `accel.vae.set_decoder_passes` uses): counted here."""
    import dataclasses

    from h3serve.accel.vae import set_decoder_passes
    from h3serve.model.video_vae import REFERENCE_PASSES

    calls = {"qk": 0, "residual": 0, "swiglu": 0, "norm": 0, "residual_norm": 0}

    def counting(name):
        def run(*args):
            calls[name] += 1
            return getattr(REFERENCE_PASSES, name)(*args)

        return run

    z = torch.randn(1, 24, 7, 4, 4, generator=torch.Generator().manual_seed(4))
    plain = decode(vae, z, tiled=False)
    set_decoder_passes(vae, dataclasses.replace(REFERENCE_PASSES, **{n: counting(n) for n in calls}))
    try:
        assert torch.equal(decode(vae, z, tiled=False), plain)
    finally:
        set_decoder_passes(vae, REFERENCE_PASSES)
    layers = vae.cfg.decoder_num_layers
    # every add but the last is fused with the norm after it; the first block's first norm stands alone
    assert calls == {"qk": layers, "residual": 1, "swiglu": layers, "norm": 1, "residual_norm": 2 * layers - 1}
