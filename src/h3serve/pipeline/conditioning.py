"""Conditioning: a request's prompt and keyframes -> the text rows and keyframe latents the denoise loop starts from.

    fit_keyframes     keyframes (packed order) onto the canvas
    present           H3's presentation: `"<Picture i>: "` + a vision block per keyframe, then the prompt, tokenized
    encode_text       the presentation -> Qwen3-VL layer-50 rows, with each row's modality tag
    encode_keyframes  each fitted keyframe -> video VAE posterior -> one sampled, fp16-rounded, normalised latent

Presentation: the prompt is tokenized verbatim (no chat template, no special tokens, no truncation). Each keyframe,
in packed order, comes first as `"<Picture i>: "` plus `<|vision_start|> <|image_pad|>*n <|vision_end|>`; the rows
of that vision block are tagged video for the DiT's AdaLN, all others text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from h3serve.config import Modality
from h3serve.model.latents import LatentStats
from h3serve.model.text_encoder import TextEncoder
from h3serve.model.video_vae import VideoVAE, posterior_sample

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# Keyframe posteriors are sampled with their own generator, so a keyframe always encodes to the same anchor.
KEYFRAME_POSTERIOR_SEED = 42


@dataclass(frozen=True)
class Presentation:
    """One request's text stream, tokenized: ids and modality tags per row, and the keyframes' vision inputs."""

    token_ids: tuple[int, ...]
    token_tags: tuple[int, ...]
    pixel_values: torch.Tensor | None = None  # (patches, 3 * temporal_patch * patch * patch)
    image_grid_thw: torch.Tensor | None = None  # (num_keyframes, 3)


@dataclass(frozen=True)
class TextConditioning:
    states: torch.Tensor  # (L, hidden) hidden_states[layer], at the encoder's dtype and device
    token_tags: torch.Tensor  # (L,) int64 Modality values


def fit_keyframes(keyframes: Sequence[Image.Image], width: int, height: int) -> list[Image.Image]:
    """Put keyframes (packed order) on the canvas: the first is stretched, a second one cover-cropped, both LANCZOS.

    The cover crop is the released model's arithmetic (round the scaled size, centre with `(src - dst) // 2`), which
    differs by a pixel from generic crop helpers on some aspect ratios.
    """
    fitted = []
    for i, image in enumerate(keyframes):
        if image.size == (width, height):
            fitted.append(image)
        elif i == 0:
            fitted.append(image.resize((width, height), Image.Resampling.LANCZOS))
        else:
            scale = max(width / image.width, height / image.height)
            size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
            left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
            fitted.append(image.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height)))
    return fitted


def present(tokenizer, prompt: str, keyframes: Sequence[Image.Image] = (), image_processor=None) -> Presentation:
    """Tokenize the H3 presentation of a prompt and its keyframes (in packed order: first, then last)."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    ids: list[int] = []
    tags: list[int] = []
    pixel_values = grid = None
    if keyframes:
        if image_processor is None:
            raise ValueError("keyframes need an image processor (load the released processor/ folder)")
        vision = image_processor(images=list(keyframes), return_tensors="pt")
        pixel_values, grid = vision["pixel_values"], vision["image_grid_thw"]
        merge = image_processor.merge_size**2
        start, pad, end = tokenizer.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END])
        for i in range(len(keyframes)):
            label = tokenizer(f"<Picture {i + 1}>: ", add_special_tokens=False)["input_ids"]
            block = [start] + [pad] * (int(grid[i].prod()) // merge) + [end]
            ids += label + block
            tags += [Modality.TEXT] * len(label) + [Modality.VIDEO] * len(block)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids += prompt_ids
    tags += [Modality.TEXT] * len(prompt_ids)
    return Presentation(tuple(ids), tuple(int(t) for t in tags), pixel_values, grid)


def encode_text(encoder: TextEncoder, prompt: str, keyframes: Sequence[Image.Image] = ()) -> TextConditioning:
    """Prompt and fitted keyframes -> (L, hidden) conditioning rows and their tags."""
    if keyframes and not encoder.has_vision:
        raise ValueError("this text encoder was loaded without the vision tower; keyframes cannot be encoded")
    p = present(encoder.tokenizer, prompt, keyframes, encoder.image_processor)
    states = encoder(p.token_ids, p.pixel_values, p.image_grid_thw)
    return TextConditioning(states, torch.tensor(p.token_tags, dtype=torch.long))


def sample_keyframe_latents(
    mean: torch.Tensor, logvar: torch.Tensor, stats: LatentStats, seed: int = KEYFRAME_POSTERIOR_SEED
) -> torch.Tensor:
    """Normalised keyframe latent from the video VAE posterior: sampled with its own generator, rounded to fp16.

    mean, logvar: (1, C, 1, h, w) on any device. Returns float32 on the CPU. The fp16 rounding is part of the
    released recipe (about 11 bits kept).
    """
    # Drawn from a CPU generator at the posterior's dtype, then moved, like the reference.
    generator = torch.Generator(device="cpu").manual_seed(seed)
    z = posterior_sample(mean, logvar, generator).to(torch.float16).float().cpu()
    return stats.normalize(z)


@torch.no_grad()
def encode_keyframes(vae: VideoVAE, keyframes: Sequence[Image.Image]) -> list[torch.Tensor]:
    """Fitted keyframes -> one normalised latent each, (1, C, 1, H/16, W/16) float32 on the CPU."""
    device = next(vae.parameters()).device
    latents = []
    for image in keyframes:
        rgb = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).to(device)  # (H, W, 3)
        moments = vae.encode(vae.rgb_to_input(rgb[None, None]))  # (1, 2C, 1, h, w)
        mean, logvar = moments.chunk(2, dim=1)
        latents.append(sample_keyframe_latents(mean, logvar, vae.cfg.latent_stats))
    return latents
