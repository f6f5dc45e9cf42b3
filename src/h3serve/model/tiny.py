"""The built-in tiny H3: every component of the released model at toy widths, with deterministic random weights.

It exists so the whole pipeline (tokenizer, text encoder with vision tower, DiT, both VAEs, MP4) runs on a CPU in
seconds with no download. Its output is noise. The geometry that the pipeline depends on is the released one:
video latents are 1/16 of the canvas and 4x fewer frames (17n+5 frames -> 5n+2 latents), audio is 40 latents/s
decoded to 32 kHz, the DiT patch is (1, 2, 2), and the tokenizer and image processor are the released files.
Widths differ from each other on purpose, as in the reference's own tiny tests, so that a transposed weight fails.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3VLConfig, Qwen3VLModel

from h3serve.config import (
    SAMPLE_RATE,
    TINY_AUDIO_LATENT_CHANNELS,
    TINY_DIT,
    TINY_VIDEO_LATENT_CHANNELS,
)
from h3serve.model.audio_vae import AudioVAE, AudioVAEConfig
from h3serve.model.components import Components
from h3serve.model.dit import H3DiT, is_fp32_name
from h3serve.model.text_encoder import (
    TextEncoder,
    load_image_processor,
    load_tokenizer,
    materialize_buffers,
    truncated_qwen3vl,
)
from h3serve.model.video_vae import VideoVAE, VideoVAEConfig
from h3serve.vocab import TASK_TYPES, TINY_MODEL_NAME, DiTKind, TaskType

TINY_SEED = 20261130

TINY_VIDEO_VAE = VideoVAEConfig(
    latent_channels=TINY_VIDEO_LATENT_CHANNELS,
    block_out_channels=(8, 8, 16, 16),
    layers_per_block=1,
    spatial_downsample_factors=(2, 2, 2, 2),  # /16, as released
    temporal_downsample_factors=(1, 2, 2, 1),  # /4, as released
    norm_num_groups=4,
    decoder_num_layers=2,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=8,  # 6 of 8 dims rotate (3 axes x 2)
    decoder_num_register_tokens=2,
    decoder_ffn_mult=2,
    latents_mean=tuple(0.1 * (i - 4) for i in range(TINY_VIDEO_LATENT_CHANNELS)),
    latents_std=tuple(1.0 + 0.05 * i for i in range(TINY_VIDEO_LATENT_CHANNELS)),
)

TINY_AUDIO_VAE = AudioVAEConfig(
    encoder_dim=2,
    encoder_rates=(2, 4, 4, 5, 5),  # hop 800: 40 latents/s at 32 kHz, as released
    latent_dim=64,
    latent_channels=TINY_AUDIO_LATENT_CHANNELS,
    num_attention_heads=2,
    decoder_dim=128,
    decoder_rates=(5, 5, 2, 2, 2, 2, 2),
    decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4),
    resblock_kernel_sizes=(3, 7),
    resblock_dilation_sizes=((1, 3), (1, 3)),
    sampling_rate=SAMPLE_RATE,
    latents_mean=tuple(-0.05 * i for i in range(TINY_AUDIO_LATENT_CHANNELS)),
    latents_std=tuple(0.5 + 0.1 * i for i in range(TINY_AUDIO_LATENT_CHANNELS)),
)


def asset_dir(name: str) -> Path:
    """A folder of the package's assets (the released tokenizer and processor configs)."""
    return Path(str(resources.files("h3serve") / "assets" / name))


@torch.no_grad()
def randomize(module: nn.Module, seed: int, *, keep: tuple[str, ...] = ()) -> nn.Module:
    """Deterministic weights independent of torch's init code: tensors in name order from one generator, matrices
    scaled by 1/sqrt(fan_in), norm-like vectors near 1, other vectors near 0. Names containing any of `keep` (the
    Kaiser filters, the rope frequencies) are left as constructed."""
    g = torch.Generator().manual_seed(seed)
    for name, t in sorted(module.state_dict(keep_vars=True).items()):
        if any(k in name for k in keep) or not t.is_floating_point():
            continue
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        if t.ndim <= 1 and ("norm" in name or leaf in ("weight_g", "scale1", "scale2")):
            value = 1.0 + 0.1 * noise
        elif t.ndim <= 1:
            value = 0.1 * noise
        else:
            value = noise / max(1, t[0].numel()) ** 0.5
        t.copy_(value.to(t.dtype))
    return module


# --- the tiny text encoder ---------------------------------------------------------------------------------

TINY_TEXT_LAYER = 2


def tiny_text_encoder_config(num_hidden_layers: int = TINY_TEXT_LAYER + 1) -> Qwen3VLConfig:
    """A Qwen3-VL of a few kilobytes per layer that keeps the released token ids, vocabulary and vision geometry
    (patch 16, merge 2, temporal patch 2), so the real tokenizer and processor drive it. The full vocabulary makes
    the token embedding (151936 x 32, 19 MB in float32) nearly all of its size.

    Widths differ on purpose (hidden 32, heads 4x8 with 2 KV heads, MLP 48; vision 16 wide, 2 heads) and MRoPE
    sections [2, 1, 1] interleave like the released [24, 20, 20].
    """
    return Qwen3VLConfig(
        text_config=dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=151936,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_scaling=dict(rope_type="default", mrope_section=[2, 1, 1], mrope_interleaved=True),
            rope_theta=5_000_000.0,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=24,
            num_heads=2,
            out_hidden_size=32,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
    )


def tiny_qwen3vl(
    *, seed: int = 0, layer: int = TINY_TEXT_LAYER, vision: bool = True, dtype: torch.dtype = torch.float32
) -> Qwen3VLModel:
    """The truncated tiny Qwen3-VL (layers 0..layer-1, no final norm) with deterministic random weights, on the CPU."""
    model = truncated_qwen3vl(tiny_text_encoder_config(layer + 1), layer, vision).to_empty(device="cpu")
    materialize_buffers(model)
    randomize(model.float(), seed)
    for p in model.parameters():  # the rotary tables stay float32
        p.data = p.data.to(dtype)
    return model


def tiny_text_encoder(
    tokenizer, image_processor=None, *, seed: int = 0, layer: int = TINY_TEXT_LAYER, dtype: torch.dtype = torch.float32
) -> TextEncoder:
    """Text encoder of the built-in tiny model: the real tokenizer (and processor) over `tiny_qwen3vl`."""
    model = tiny_qwen3vl(seed=seed, layer=layer, vision=image_processor is not None, dtype=dtype)
    return TextEncoder(model, tokenizer, image_processor)


def tiny_dit(seed: int = TINY_SEED, dtype: torch.dtype = torch.float32) -> H3DiT:
    """A tiny DiT with deterministic random weights rounded to bfloat16 values (fp32 islands kept), like the released
    checkpoint, so float32 and bfloat16 runs start from the same numbers."""
    dit = randomize(H3DiT(TINY_DIT), seed, keep=("rope.inv_freq",))
    with torch.no_grad():
        for name, t in dit.state_dict(keep_vars=True).items():
            t.data = t.data.to(torch.float32 if is_fp32_name(name) else dtype)
            if not is_fp32_name(name):
                t.data = t.data.to(torch.bfloat16).to(dtype)
    return dit


def tiny_components(
    *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, task_type: str = TaskType.FL2VA
) -> Components:
    """Build the tiny model: the DiTs `task_type` names (the FL2VA DiT, a Ref2VA DiT of the same shape with its own
    weights, or both), the VAEs and the text encoder."""
    if task_type not in TASK_TYPES:
        raise ValueError(f"task type must be one of {', '.join(TASK_TYPES)}, got {task_type!r}")
    kinds = TASK_TYPES[task_type]
    dit = tiny_dit(TINY_SEED, dtype) if DiTKind.FL2VA in kinds else None
    ref_dit = tiny_dit(TINY_SEED + 4, dtype) if DiTKind.REF2VA in kinds else None
    video_vae = randomize(VideoVAE(TINY_VIDEO_VAE), TINY_SEED + 1)
    audio_vae = randomize(AudioVAE(TINY_AUDIO_VAE), TINY_SEED + 2, keep=("filter",))
    with torch.no_grad():
        # At this random scale over a quarter of the samples sat on the [-1, 1] clamp, where any two decodes agree
        # trivially; a tenth of the output gain keeps the waveform inside it, so audio comparisons mean something.
        audio_vae.decoder.conv_post.weight_g.mul_(0.1)
    text_encoder = tiny_text_encoder(
        load_tokenizer(asset_dir("tokenizer")),
        load_image_processor(asset_dir("processor")),
        seed=TINY_SEED + 3,
        dtype=dtype,
    )
    parts = [d for d in (dit, ref_dit) if d is not None] + [video_vae, audio_vae, text_encoder]
    for part in parts:
        part.to(device).eval().requires_grad_(False)
    return Components(
        dit=dit,
        text_encoder=text_encoder,
        video_vae=video_vae,
        audio_vae=audio_vae,
        name=TINY_MODEL_NAME,
        ref_dit=ref_dit,
    )
