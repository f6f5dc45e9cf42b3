"""Conditioning: a request's prompt and keyframes -> the text rows and keyframe latents the denoise loop starts from.

    fit_keyframes              keyframes (packed order) onto the canvas
    tokenize_prompt            H3's prompt format: `"<Picture i>: "` + a vision block per keyframe, then the prompt
    tokenize_reference_prompt  the ref2va format: a label per reference (request order), vision blocks, the prompt
    encode_text                the tokenized prompt -> Qwen3-VL layer-50 rows, with each row's modality tag
    encode_keyframes           each fitted keyframe -> video VAE posterior -> a sampled, fp16-rounded, normalised latent
    encode_references          ref2va: image / video references as keyframes are (the video's 17n+5 prefix);
                               soundtracks and audio references -> the audio VAE's posterior mean, normalised, as clean
                               channel-major rows

The prompt format (diffusers' "presentation"): the prompt is tokenized verbatim (no chat template, no special tokens,
no truncation). Each keyframe, in packed order, comes first as `"<Picture i>: "` plus
`<|vision_start|> <|image_pad|>*n <|vision_end|>`; the rows of that vision block are tagged video for the DiT's
AdaLN, all others text.

The Ref2VA format (docs/model.md §3, checked against diffusers' ref2va text-encoder step): labels are numbered per
kind and emitted in request order. An image is `"<Picture i>: "` + an image vision block. Audio is `"<Audio j>: "`
alone (no waveform reaches Qwen). A video that keeps its soundtrack is first `"<Audio j>: "`, then `"<Video k>: "`;
a video's frames (24 fps) are read at 2 fps, merged in pairs by Qwen's temporal patch (the last one repeated when
odd), and each pair becomes `"<t seconds>"` (the pair's mean time, one decimal, Python's half-to-even rounding) + a
`<|video_pad|>` vision block. Vision rows are tagged video, every label and the prompt text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from h3serve.config import FPS, Modality
from h3serve.model.audio_vae import AudioVAE
from h3serve.model.latents import LatentStats
from h3serve.model.text_encoder import TextEncoder
from h3serve.model.video_vae import VideoVAE, posterior_sample
from h3serve.vocab import ReferenceKind

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
# The rate Qwen reads a reference video at (diffusers' `video_sample_fps`); reference videos arrive at 24 fps.
REFERENCE_VIDEO_SAMPLE_FPS = 2.0
# Keyframe posteriors are sampled with their own generator, so a keyframe always encodes to the same anchor.
KEYFRAME_POSTERIOR_SEED = 42


@dataclass(frozen=True)
class TokenizedPrompt:
    """One request's text stream, tokenized: ids and modality tags per row, and the keyframes' vision inputs."""

    token_ids: tuple[int, ...]
    token_tags: tuple[int, ...]
    pixel_values: torch.Tensor | None = None  # (patches, 3 * temporal_patch * patch * patch)
    image_grid_thw: torch.Tensor | None = None  # (num_keyframes, 3)
    pixel_values_videos: torch.Tensor | None = None  # ref2va only: the reference videos' patches, request order
    video_grid_thw: torch.Tensor | None = None  # (num_videos, 3)


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


def tokenize_prompt(
    tokenizer, prompt: str, keyframes: Sequence[Image.Image] = (), image_processor=None
) -> TokenizedPrompt:
    """Tokenize a prompt and its keyframes (in packed order: first, then last) in H3's prompt format."""
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
    return TokenizedPrompt(tuple(ids), tuple(int(t) for t in tags), pixel_values, grid)


def encode_text(
    encoder: TextEncoder,
    prompt: str,
    keyframes: Sequence[Image.Image] = (),
    *,
    references: Sequence | None = None,
    video_processing: VideoProcessing | None = None,
) -> TextConditioning:
    """Prompt and fitted keyframes (base modes) or decoded references (ref2va) -> (L, hidden) rows and their tags."""
    if references is not None:
        if keyframes:
            raise ValueError("a request has keyframes or references, not both")
        kinds = {_reference_kind(r) for r in references}
        if kinds - {AUDIO_KIND} and not encoder.has_vision:
            raise ValueError("this text encoder was loaded without the vision tower; references cannot be encoded")
        tokens = tokenize_reference_prompt(
            encoder.tokenizer,
            prompt,
            references,
            encoder.image_processor,
            video_processing or RELEASED_VIDEO_PROCESSING,
        )
        return TextConditioning(_run_encoder(encoder, tokens), torch.tensor(tokens.token_tags, dtype=torch.long))
    if keyframes and not encoder.has_vision:
        raise ValueError("this text encoder was loaded without the vision tower; keyframes cannot be encoded")
    tokens = tokenize_prompt(encoder.tokenizer, prompt, keyframes, encoder.image_processor)
    states = encoder(tokens.token_ids, tokens.pixel_values, tokens.image_grid_thw)
    return TextConditioning(states, torch.tensor(tokens.token_tags, dtype=torch.long))


# --- the ref2va prompt format ------------------------------------------------------------------------------------

IMAGE_KIND, VIDEO_KIND, AUDIO_KIND = ReferenceKind.IMAGE, ReferenceKind.VIDEO, ReferenceKind.AUDIO


@dataclass(frozen=True)
class VideoProcessing:
    """What Qwen3-VL's video processor does to a reference video, from the released `video_preprocessor_config.json`.

    min_pixels / max_pixels bound frames * height * width (the config's `shortest_edge` / `longest_edge`); the
    released processor applies no per-frame cap. Normalisation is (x - 127.5) / 127.5 in float32 (mean = std = 0.5
    fused with the 1/255 rescale).
    """

    min_pixels: int = 4096
    max_pixels: int = 25165824
    patch_size: int = 16
    temporal_patch: int = 2
    merge_size: int = 2
    mean: float = 0.5
    std: float = 0.5

    @classmethod
    def from_folder(cls, path: str | Path) -> VideoProcessing:
        cfg = json.loads((Path(path) / "video_preprocessor_config.json").read_text())
        if cfg.get("cap_pixels_per_frame"):
            raise ValueError("a per-frame pixel cap in the video processor config is not supported")
        mean, std = set(cfg.get("image_mean", [0.5])), set(cfg.get("image_std", [0.5]))
        if len(mean) != 1 or len(std) != 1:
            raise ValueError("per-channel video normalisation is not supported")
        return cls(
            min_pixels=cfg["size"]["shortest_edge"],
            max_pixels=cfg["size"]["longest_edge"],
            patch_size=cfg.get("patch_size", 16),
            temporal_patch=cfg.get("temporal_patch_size", 2),
            merge_size=cfg.get("merge_size", 2),
            mean=mean.pop(),
            std=std.pop(),
        )


RELEASED_VIDEO_PROCESSING = VideoProcessing()


def _reference_kind(reference) -> ReferenceKind:
    kind = getattr(reference, "kind", None)
    if kind not in tuple(ReferenceKind):
        raise ValueError(f"a reference must be an image, a video or audio, got {kind!r}")
    return ReferenceKind(kind)


def _reference_has_audio(reference) -> bool:
    """Audio references, and videos that kept their soundtrack, get an `<Audio j>` label."""
    kind = _reference_kind(reference)
    return kind == AUDIO_KIND or (kind == VIDEO_KIND and getattr(reference, "audio", None) is not None)


def sample_reference_video(
    num_frames: int,
    fps: float = FPS,
    sample_fps: float = REFERENCE_VIDEO_SAMPLE_FPS,
    temporal_patch: int = 2,
) -> tuple[list[int], list[float]]:
    """Which frames of a reference video Qwen sees, and the time label of each merged block.

    Frames are taken every `fps / sample_fps` (rounded half to even, repeats dropped); a block merges `temporal_patch`
    consecutive samples (the last repeated to fill) and is labelled with the mean of its first and last sample times.
    """
    stride = fps / sample_fps
    indices: list[int] = []
    step = 0
    while (index := round(step * stride)) < num_frames:
        if not indices or index > indices[-1]:
            indices.append(index)
        step += 1
    if len(indices) < temporal_patch:
        raise ValueError(
            f"a reference video needs {temporal_patch} frames at {sample_fps:g} fps for Qwen, got {num_frames} frames"
        )
    times = [i / sample_fps for i in range(len(indices))]
    times += [times[-1]] * (-len(times) % temporal_patch)
    blocks = [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]
    return indices, blocks


def _video_canvas(frames: int, height: int, width: int, vp: VideoProcessing) -> tuple[int, int]:
    """Qwen3-VL's video `smart_resize`: the (height, width) the sampled frames are resized to."""
    factor, t = vp.patch_size * vp.merge_size, vp.temporal_patch
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / t) * t
    if t_bar * h * w > vp.max_pixels:
        beta = math.sqrt(frames * height * width / vp.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h * w < vp.min_pixels:
        beta = math.sqrt(vp.min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def video_vision_inputs(frames: np.ndarray, vp: VideoProcessing) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Sampled frames (T, H, W, 3) uint8 -> Qwen3-VL video patches (t*h*w, 3*tp*p*p) and the grid (t, h, w)."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # (T, 3, H, W) uint8
    size = _video_canvas(x.shape[0], x.shape[2], x.shape[3], vp)
    if size != tuple(x.shape[2:]):
        # Bicubic with antialias, through float32 and back to uint8, as torchvision resizes a uint8 tensor.
        # Not checked against torchvision (absent here): only videos past the processor's pixel budget get here.
        x = F.interpolate(x.float(), size=size, mode="bicubic", antialias=True, align_corners=False)
        x = x.clamp_(0, 255).round_().to(torch.uint8)
    x = (x.float() - vp.mean * 255) / (vp.std * 255)
    if pad := -x.shape[0] % vp.temporal_patch:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    tp, p, m = vp.temporal_patch, vp.patch_size, vp.merge_size
    gt, gh, gw = x.shape[0] // tp, x.shape[2] // p, x.shape[3] // p
    x = x.view(gt, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, 3 * tp * p * p), (gt, gh, gw)


def tokenize_reference_prompt(
    tokenizer,
    prompt: str,
    references: Sequence,
    image_processor=None,
    video_processing: VideoProcessing = RELEASED_VIDEO_PROCESSING,
) -> TokenizedPrompt:
    """Tokenize a prompt and its decoded references (request order) in the ref2va prompt format.

    `references` are `DecodedReference`s or anything with `kind` ("image" | "video" | "audio"), `pixels` (an image's
    (H, W, 3), a video's (F, H, W, 3) uint8 at 24 fps) and `audio` (a video's soundtrack or None). The vision inputs
    are batched per kind, in request order within a kind, which is how Qwen3-VL pairs them with the pad runs.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    kinds = [_reference_kind(r) for r in references]
    merge = video_processing.merge_size**2
    pixel_values = image_grid = None
    image_tokens: list[int] = []
    images = [Image.fromarray(r.pixels) for r, k in zip(references, kinds, strict=True) if k == IMAGE_KIND]
    if images:
        if image_processor is None:
            raise ValueError("image references need an image processor (load the released processor/ folder)")
        vision = image_processor(images=images, return_tensors="pt")
        pixel_values, image_grid = vision["pixel_values"], vision["image_grid_thw"]
        image_tokens = [int(g.prod()) // merge for g in image_grid]
    video_patches, video_grids, video_blocks = [], [], []
    for r, k in zip(references, kinds, strict=True):
        if k == VIDEO_KIND:
            indices, times = sample_reference_video(r.pixels.shape[0], temporal_patch=video_processing.temporal_patch)
            patches, grid = video_vision_inputs(r.pixels[indices], video_processing)
            video_patches.append(patches)
            video_grids.append(grid)
            video_blocks.append((times, grid[1] * grid[2] // merge))

    start, end = tokenizer.convert_tokens_to_ids([VISION_START, VISION_END])
    image_pad, video_pad = tokenizer.convert_tokens_to_ids([IMAGE_PAD, VIDEO_PAD])
    ids: list[int] = []
    tags: list[int] = []

    def text(value: str) -> None:
        label = tokenizer(value, add_special_tokens=False)["input_ids"]
        ids.extend(label)
        tags.extend([int(Modality.TEXT)] * len(label))

    def block(pad: int, n: int) -> None:
        ids.extend([start] + [pad] * n + [end])
        tags.extend([int(Modality.VIDEO)] * (n + 2))

    counts = dict.fromkeys((IMAGE_KIND, VIDEO_KIND, AUDIO_KIND), 0)
    for r, k in zip(references, kinds, strict=True):
        if _reference_has_audio(r):
            counts[AUDIO_KIND] += 1
            text(f"<Audio {counts[AUDIO_KIND]}>: ")
        if k == IMAGE_KIND:
            text(f"<Picture {counts[IMAGE_KIND] + 1}>: ")
            block(image_pad, image_tokens[counts[IMAGE_KIND]])
            counts[IMAGE_KIND] += 1
        elif k == VIDEO_KIND:
            times, n = video_blocks[counts[VIDEO_KIND]]
            counts[VIDEO_KIND] += 1
            text(f"<Video {counts[VIDEO_KIND]}>: ")
            for t in times:
                text(f"<{t:.1f} seconds>")
                block(video_pad, n)
    text(prompt)
    return TokenizedPrompt(
        tuple(ids),
        tuple(tags),
        pixel_values,
        image_grid,
        torch.cat(video_patches) if video_patches else None,
        torch.tensor(video_grids, dtype=torch.long) if video_grids else None,
    )


@torch.no_grad()
def _run_encoder(encoder: TextEncoder, tokens: TokenizedPrompt) -> torch.Tensor:
    return encoder(
        tokens.token_ids, tokens.pixel_values, tokens.image_grid_thw, tokens.pixel_values_videos, tokens.video_grid_thw
    )


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


@dataclass(frozen=True)
class ReferenceLatents:
    """A ref2va request's conditioning latents, in packed (request) order."""

    video: tuple[torch.Tensor, ...]  # per image / video reference: (1, C, F, h, w) normalised, float32 on the CPU
    audio: tuple[torch.Tensor, ...]  # per audio-bearing reference: (2 * Na, C_a) channel-major rows, float32, CPU


@torch.no_grad()
def encode_references(video_vae: VideoVAE, audio_vae: AudioVAE, references: Sequence) -> ReferenceLatents:
    """Decoded references (`pipeline.references.DecodedReference`, request order) -> their conditioning latents.

    An image is encoded as one frame, a video as its longest 17n+5 prefix (`vae_frames`), each like a keyframe: the
    posterior sampled under its own seeded generator, rounded to float16, normalised. A soundtrack or an audio
    reference (float32 (2, N) at 32 kHz) goes through the audio VAE's encoder, each stereo channel as a batch item;
    its posterior *mean* is normalised and laid out channel-major, never sampled, never noised.
    """
    video_device = next(video_vae.parameters()).device
    audio_device = next(audio_vae.parameters()).device
    video, audio = [], []
    for ref in references:
        kind = _reference_kind(ref)
        if kind in (IMAGE_KIND, VIDEO_KIND):
            pixels = ref.pixels if kind == VIDEO_KIND else ref.pixels[None]  # (F, H, W, 3) uint8
            rgb = torch.from_numpy(np.array(pixels[: ref.vae_frames])).to(video_device)  # a writable copy
            moments = video_vae.encode(video_vae.rgb_to_input(rgb[None]))  # (1, 2C, F', h, w)
            mean, logvar = moments.chunk(2, dim=1)
            video.append(sample_keyframe_latents(mean, logvar, video_vae.cfg.latent_stats))
        if ref.audio is not None:
            wave = torch.from_numpy(np.ascontiguousarray(ref.audio, dtype=np.float32)).to(audio_device)
            latents = audio_vae.encode(wave[:, None]).float().cpu()  # (2, C_a, Na): the posterior mean
            normalized = audio_vae.cfg.latent_stats.normalize(latents)
            audio.append(normalized.transpose(1, 2).reshape(-1, normalized.shape[1]))
    return ReferenceLatents(tuple(video), tuple(audio))
