"""Audio VAE: parity with diffusers' AutoencoderKLMiniMaxH3Audio on its tiny test config, and config checks.

The key names are identical in both implementations, so the reference's state dict loads into ours unchanged.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from h3serve.model.audio_vae import AudioVAE, AudioVAEConfig, kaiser_sinc_filter

REF = Path(__file__).parent / "data" / "reference"

# diffusers' tiny test config (tests/models/autoencoders/test_models_autoencoder_kl_minimax_h3_audio.py), with
# non-trivial latent statistics so de-normalisation is exercised.
TINY = {
    "encoder_dim": 4,
    "encoder_rates": [2, 2],
    "latent_dim": 32,
    "latent_channels": 8,
    "num_attention_heads": 2,
    "decoder_dim": 16,
    "decoder_rates": [2, 2],
    "decoder_kernel_sizes": [4, 4],
    "resblock_kernel_sizes": [3, 7],
    "resblock_dilation_sizes": [[1, 3], [1, 3]],
    "sampling_rate": 32000,
    "latents_mean": [0.1 * i for i in range(8)],
    "latents_std": [1.0 + 0.25 * i for i in range(8)],
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def make_reference(config: dict | None = None, seed: int = 0):
    from diffusers import AutoencoderKLMiniMaxH3Audio

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # diffusers uses the legacy torch weight_norm
        ref = AutoencoderKLMiniMaxH3Audio(**(config or TINY)).eval()
    with torch.no_grad():
        for p in ref.parameters():  # SnakeBeta logs and biases start at zero; perturb everything
            p.add_(0.1 * torch.randn_like(p))
    return ref


@pytest.fixture(scope="module")
def pair():
    ref = make_reference()
    ours = AudioVAE(AudioVAEConfig.from_diffusers(TINY)).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def test_decode_matches_reference(pair):
    ref, ours = pair
    z = torch.randn(2, 8, 10, generator=torch.Generator().manual_seed(1))  # stereo: L and R as batch items
    with torch.no_grad():
        expected = ref.decode(z).sample
    got = ours.decode(z)
    assert got.shape == expected.shape == (2, 1, 40)
    assert got.dtype == torch.float32
    assert rel_err(got, expected) < 1e-5
    assert got.abs().max() <= 1.0


def test_decode_is_clamped_and_channels_are_independent(pair):
    _, ours = pair
    z = 50 * torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(2))
    both = ours.decode(z)
    assert both.abs().max() == 1.0  # large latents saturate: clamped, not wrapped or scaled
    torch.testing.assert_close(both[1:], ours.decode(z[1:]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("samples", [32, 37])  # 37 is right-padded to a whole hop
def test_encode_matches_reference(pair, samples):
    ref, ours = pair
    wave = 0.3 * torch.randn(2, 1, samples, generator=torch.Generator().manual_seed(samples))
    with torch.no_grad():
        expected = ref.encode(wave).latent_dist.mode()
    got = ours.encode(wave)
    assert got.shape == expected.shape == (2, 8, -(-samples // 4))
    assert rel_err(got, expected) < 1e-5


def test_latent_denormalisation(pair):
    _, ours = pair
    z = torch.randn(2, 8, 5)
    stats = ours.cfg.latent_stats
    d = stats.denormalize(z)
    torch.testing.assert_close(d[:, 3], z[:, 3] * 1.75 + 0.3)
    torch.testing.assert_close(stats.normalize(d), z)


def test_kaiser_filters_match_reference_buffers():
    ref = make_reference()
    sd = ref.state_dict()
    up = sd["decoder.activation_post.upsample.filter"]
    down = sd["decoder.activation_post.downsample.lowpass.filter"]
    torch.testing.assert_close(kaiser_sinc_filter(0.25, 0.3, 12), up, rtol=0, atol=0)
    torch.testing.assert_close(kaiser_sinc_filter(0.25, 0.3, 12), down, rtol=0, atol=0)


def test_configs_of_both_layouts_agree():
    metadata = json.loads((REF / "FL2VA/audio_vae/metadata.json").read_text())
    wrapper = json.loads((REF / "FL2VA/audio_vae/config.json").read_text())
    diffusers = json.loads((REF / "audio_vae/config.json").read_text())
    original = AudioVAEConfig.from_original(metadata, wrapper)
    assert original == AudioVAEConfig.from_diffusers(diffusers)
    assert original.hop_length == 800 and original.sampling_rate // original.hop_length == 40


@pytest.mark.parametrize(
    "change",
    [
        {"decoder_rates": [2, 3]},  # does not upsample by the hop length
        {"decoder_kernel_sizes": [4]},
        {"latents_std": [1.0] * 7 + [0.0]},
        {"latents_mean": [0.0] * 7},
        {"num_attention_heads": 3},
        {"resblock_kernel_sizes": [3, 4]},
        {"decoder_dim": 6},
        {"sample_rate": 32000},  # a misspelt key is refused, not ignored
    ],
)
def test_config_rejects_invalid_values(change):
    with pytest.raises(ValueError):
        AudioVAEConfig.from_diffusers({**TINY, **change})


def test_original_config_refuses_other_decoders():
    metadata = json.loads((REF / "FL2VA/audio_vae/metadata.json").read_text())
    wrapper = json.loads((REF / "FL2VA/audio_vae/config.json").read_text())
    metadata["metadata"]["kwargs"]["decoder_type"] = "hifigan"
    with pytest.raises(ValueError, match="bigvgan"):
        AudioVAEConfig.from_original(metadata, wrapper)
