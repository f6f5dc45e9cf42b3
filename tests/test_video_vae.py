"""Video VAE: parity with diffusers' AutoencoderKLMiniMaxH3 on tiny configs, geometry and config checks.

diffusers is the numerical oracle here and is imported by tests only. The weights are random and shared: the
diffusers model is built and perturbed, then its state dict is rewritten into the original checkpoint layout by
`diffusers_to_original` below (written from the conversion script's description, independently of
`h3serve.checkpoint.vae`) and loaded into our module.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from h3serve.checkpoint.vae import original_video_vae_config
from h3serve.model.video_vae import VideoVAE, VideoVAEConfig, posterior_sample, split_tiles
from h3serve.pipeline.video_decode import decode

REF = Path(__file__).parent / "data" / "reference"

# diffusers' own tiny test config (tests/models/autoencoders/test_models_autoencoder_kl_minimax_h3.py).
TINY_DIFFUSERS = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "block_out_channels": [8, 16],
    "layers_per_block": 1,
    "spatial_downsample_factors": [2, 2],
    "temporal_downsample_factors": [2, 2],
    "norm_num_groups": 8,
    "decoder_num_layers": 2,
    "decoder_num_attention_heads": 2,
    "decoder_attention_head_dim": 8,
    "decoder_num_register_tokens": 2,
    "decoder_ffn_mult": 2,
    "clip_length": 17,
    "token_drop": 3,
    "latents_mean": [0.0] * 4,
    "latents_std": [1.0] * 4,
}
# Tiles of 16 px with >= 8 px overlap at ratio 4: a 44 x 36 px frame gives 5 x 4 tiles with uneven overlaps
# ([12, 8, 8, 8] and [12, 8, 8]), so the slack-distribution and corner-blending paths all run.
TILE, OVERLAP = 16, 8


def tiny_config(**overrides) -> VideoVAEConfig:
    values = {"tile_size": TILE, "tile_overlap_min": OVERLAP, **overrides}
    return replace(VideoVAEConfig.from_diffusers(TINY_DIFFUSERS), **values)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def diffusers_to_original(sd: dict[str, torch.Tensor], heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """diffusers AutoencoderKLMiniMaxH3 names -> original checkpoint names (the inverse of the conversion)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        if ".attn.to_k." in key or ".attn.to_v." in key:
            continue
        if ".attn.to_q." in key:
            prefix, suffix = key.split(".attn.to_q.")
            q, k, v = (sd[f"{prefix}.attn.to_{n}.{suffix}"] for n in "qkv")
            # Original rows are per-head interleaved: [h0: q k v, h1: q k v, ...].
            per_head = [x.reshape(heads, head_dim, *x.shape[1:]) for x in (q, k, v)]
            out[f"{prefix}.attn.to_qkv.{suffix}"] = torch.cat(per_head, dim=1).reshape(
                3 * heads * head_dim, *q.shape[1:]
            )
            continue
        new = key
        if new.startswith("encoder.down_blocks."):
            level, rest = new.removeprefix("encoder.down_blocks.").split(".", 1)
            rest = rest.replace("resnets.", "block.", 1).replace("conv_shortcut.", "nin_shortcut.", 1)
            rest = rest.replace("downsamplers.0.", "downsample.", 1)
            new = f"encoder.down.{level}.{rest}"
        new = new.replace("decoder.proj_in.", "decoder.x_embedder.").replace(".attn.to_out.0.", ".attn.to_out.")
        if ".ff.net.0.proj." in new:
            up, gate = t.chunk(2, dim=0)  # diffusers [up; gate] -> original [gate; up]
            t = torch.cat([gate, up], dim=0)
            new = new.replace(".ff.net.0.proj.", ".ff.w1.")
        new = new.replace(".ff.net.2.", ".ff.w2.")
        out[new] = t.clone()
    dim = heads * head_dim
    out["decoder.mask_token"] = torch.zeros(1, 1, dim)
    return out


def make_reference(seed: int = 0, **config):
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(seed)
    ref = AutoencoderKLMiniMaxH3(**{**TINY_DIFFUSERS, **config}).eval()
    with torch.no_grad():
        for p in ref.parameters():  # scales and registers start at zero; perturb everything so every path counts
            p.add_(0.2 * torch.randn_like(p))
    ref.enable_tiling(TILE, TILE, OVERLAP, OVERLAP)
    return ref


def make_pair(seed: int = 0):
    ref = make_reference(seed)
    cfg = tiny_config()
    ours = VideoVAE(cfg).eval()
    sd = diffusers_to_original(ref.state_dict(), cfg.decoder_num_attention_heads, cfg.decoder_attention_head_dim)
    ours.load_state_dict(sd, strict=True)
    return ref, ours


@pytest.fixture(scope="module")
def pair():
    return make_pair()


# ---------------------------------------------------------------------------------------------------------------
# Encode
# ---------------------------------------------------------------------------------------------------------------
def test_encode_single_frame_matches_reference(pair):
    ref, ours = pair
    x = torch.randn(2, 3, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref.encode(x).latent_dist.parameters
    got = ours.encode(x)
    assert got.shape == (2, 8, 1, 2, 2)  # one latent frame: an image bypasses clip chunking
    assert rel_err(got, expected) < 1e-5


def test_encode_22_frames_matches_reference(pair):
    ref, ours = pair
    x = torch.randn(1, 3, 22, 8, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref.encode(x).latent_dist.parameters
    got = ours.encode(x)
    assert got.shape == (1, 8, 7, 2, 2)  # 17n + 5 frames -> 5n + 2 latents
    assert rel_err(got, expected) < 1e-5


def test_tiled_encode_matches_reference(pair):
    ref, ours = pair
    x = torch.randn(1, 3, 1, 44, 36, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref.encode(x).latent_dist.parameters
        ref.disable_tiling()
        untiled = ref.encode(x).latent_dist.parameters
        ref.enable_tiling(TILE, TILE, OVERLAP, OVERLAP)
    got = ours.encode(x)
    assert got.shape == (1, 8, 1, 11, 9)
    assert rel_err(got, expected) < 1e-5
    assert rel_err(got, untiled) > 1e-3  # tiling really ran (seams differ from the untiled encode)
    assert rel_err(ours.encode(x, tiled=False), untiled) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("num_latents", "num_frames"),
    [(7, 22), (9, 30), (12, 39)],  # one window; a padded tail; two windows with a 5-frame cross-fade
)
def test_untiled_decode_matches_reference(pair, num_latents, num_frames):
    ref, ours = pair
    z = torch.randn(1, 4, num_latents, 2, 3, generator=torch.Generator().manual_seed(num_latents))
    ref.disable_tiling()
    try:
        with torch.no_grad():
            expected = ref.decode(z).sample
    finally:
        ref.enable_tiling(TILE, TILE, OVERLAP, OVERLAP)
    got = decode(ours, z, tiled=False, autocast_dtype=None)
    assert got.shape == expected.shape == (1, 3, num_frames, 8, 12)
    assert ours.cfg.decode_plan(num_latents)[2] == num_frames
    assert rel_err(got, expected) < 1e-5


def test_tiled_decode_matches_reference(pair):
    ref, ours = pair
    z = torch.randn(1, 4, 7, 11, 9, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ref.decode(z).sample
    got = decode(ours, z, autocast_dtype=None)  # tiling is on by default, as released
    assert got.shape == expected.shape == (1, 3, 22, 44, 36)
    assert rel_err(got, expected) < 1e-5
    untiled = decode(ours, z, tiled=False, autocast_dtype=None)
    assert rel_err(got, untiled) > 1e-3  # the seams really are blended tiles, not one big decode


def test_tiled_decode_runs_the_decoder_on_tiles_only(pair):
    _, ours = pair
    seen: list[tuple[int, ...]] = []
    handle = ours.decoder.register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
    try:
        decode(ours, torch.randn(1, 4, 7, 11, 9), autocast_dtype=None)
    finally:
        handle.remove()
    assert len(seen) == 5 * 4
    assert all(s[-2:] == (TILE // 4, TILE // 4) for s in seen)


def test_fp16_autocast_decode_tracks_reference(pair):
    ref, ours = pair
    z = torch.randn(1, 4, 7, 11, 9, generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        expected = ref.decode(z).sample.float()
    got = decode(ours, z, autocast_dtype=torch.float16)  # as released
    exact = decode(ours, z, autocast_dtype=None)
    assert got.dtype == torch.float32
    # fp16 keeps 11 significant bits (~5e-4 relative per op). Our fused to_qkv GEMM, fp32 tile blending (the
    # reference blends fp16 tiles) and a different summation order each round differently, so two fp16 runs agree
    # to ~7e-4 here (the reference's own fp16-vs-fp32 gap is ~1e-3), not to 1e-5. 5e-3 still catches any real
    # error: a wrong weight layout or blend is > 1e-1 on this fixture.
    assert rel_err(got, expected) < 5e-3
    assert rel_err(got, exact) > 1e-5  # autocast really took effect


def test_decode_rejects_too_few_latents(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="too few"):
        decode(ours, torch.randn(1, 4, 2, 2, 2))
    with pytest.raises(ValueError, match="expected latents"):
        decode(ours, torch.randn(1, 5, 7, 2, 2))


def test_posterior_sample_matches_reference(pair):
    ref, ours = pair
    x = torch.randn(1, 3, 1, 8, 8, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = ref.encode(x).latent_dist.sample(generator=torch.Generator().manual_seed(42))
    got = posterior_sample(*ours.encode(x).chunk(2, dim=1), torch.Generator().manual_seed(42))
    assert rel_err(got, expected) < 1e-5


def test_latent_normalisation_round_trip():
    cfg = tiny_config(latents_mean=(0.5, -1.0, 2.0, 0.0), latents_std=(2.0, 0.5, 1.0, 4.0))
    z = torch.randn(1, 4, 3, 2, 2)
    n = cfg.latent_stats.normalize(z)
    torch.testing.assert_close(n[:, 1], (z[:, 1] + 1.0) / 0.5)
    torch.testing.assert_close(cfg.latent_stats.denormalize(n), z)


# ---------------------------------------------------------------------------------------------------------------
# Geometry and config
# ---------------------------------------------------------------------------------------------------------------
def test_release_geometry():
    cfg = VideoVAEConfig(latents_mean=[0.0] * 24, latents_std=[1.0] * 24)
    assert (cfg.tokens_chunk_size, cfg.frame_pre_padding, cfg.token_overlap, cfg.frame_overlap) == (5, 3, 2, 5)
    # 448 x 768 at the released 256 / 64: 2 x 4 tiles, overlaps 64 and 96, 80, 80.
    assert split_tiles(448, 256, 64, 16) == ([0, 192], [64])
    assert split_tiles(768, 256, 64, 16) == ([0, 160, 336, 512], [96, 80, 80])
    assert split_tiles(256, 256, 64, 16) == ([0], [])
    assert cfg.decode_plan(17) == (0, 3, 56)  # 56 frames <-> 17 latents, 3 windows
    assert cfg.decode_plan(7) == (0, 1, 22)
    assert cfg.decode_plan(9) == (3, 2, 30)  # padded with 3 copies of the last latent, 9 frames cut again


def test_configs_of_both_layouts_agree():
    wrapper = json.loads((REF / "FL2VA/video_vae/config.json").read_text())
    source = json.loads((REF / "FL2VA/video_vae/source/config.json").read_text())
    diffusers = json.loads((REF / "vae/config.json").read_text())
    original = original_video_vae_config(wrapper, source)
    assert original == VideoVAEConfig.from_diffusers(diffusers)
    assert original.decoder_dim == 2048 and original.rope_dim == 48 and original.spatial_ratio == 16


@pytest.mark.parametrize(
    "change",
    [
        {"latents_std": [1.0, 1.0, 0.0, 1.0]},
        {"latents_mean": [0.0] * 3},
        {"spatial_downsample_factors": [2]},
        {"spatial_downsample_factors": [1, 2]},
        {"spatial_downsample_factors": [3, 2]},
        {"norm_num_groups": 3},
        {"decoder_attention_head_dim": 12},
        {"token_drop": 5},
        {"spatial_padding_mode": "mirror"},
        {"decoder_num_layers": 0},
    ],
)
def test_config_rejects_invalid_values(change):
    with pytest.raises(ValueError):
        VideoVAEConfig.from_diffusers({**TINY_DIFFUSERS, **change})


def test_config_rejects_unknown_and_unsupported_keys():
    with pytest.raises(ValueError, match="unknown keys"):
        VideoVAEConfig.from_diffusers({**TINY_DIFFUSERS, "latent_chanels": 4})
    with pytest.raises(ValueError, match="tile_size"):
        tiny_config(tile_size=18)
    wrapper = json.loads((REF / "FL2VA/video_vae/config.json").read_text())
    source = json.loads((REF / "FL2VA/video_vae/source/config.json").read_text())
    with pytest.raises(ValueError, match="causal_decoder"):
        original_video_vae_config(wrapper, {**source, "causal_decoder": True})
    with pytest.raises(ValueError, match=r"unknown keys \['vae_tile_sise'\]"):
        original_video_vae_config({**wrapper, "vae_tile_sise": 128}, source)
    with pytest.raises(ValueError, match="vae_decoder_parallel=1 is not supported"):
        original_video_vae_config({**wrapper, "vae_decoder_parallel": 1}, source)
