"""The engine: built once from a model folder (or the built-in tiny model) and a profile; renders requests.

One render runs the stages of the data flow in order and times each:

    text   prompt (+ keyframes) -> Qwen3-VL layer-50 rows; keyframes -> VAE latents
    layout packed rows, tags, positions, indices; the request's noise
    denoise  N-1 DiT forwards (text refiner, RoPE table and indices bound once per request)
    video  generated rows -> latents -> frames (uint8)
    audio  generated rows -> latents -> stereo waveform (float32, 32 kHz)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from h3serve.config import DiTConfig
from h3serve.model.audio_vae import AudioVAEConfig
from h3serve.model.loading import load_dit, load_released_text_encoder, open_checkpoint
from h3serve.model.text_encoder import TEXT_ENCODER_LAYER
from h3serve.model.tiny import Components, tiny_components
from h3serve.model.vae_loading import (
    load_audio_vae,
    load_video_vae,
    read_audio_vae_config,
    read_video_vae_config,
)
from h3serve.model.video_vae import VideoVAEConfig
from h3serve.pipeline.layout import (
    MediaGeometry,
    audio_rows_to_latents,
    build_layout,
    unpatchify_video,
)
from h3serve.pipeline.request import (
    RELEASED_RULES,
    CanvasRule,
    RenderRequest,
    RequestRules,
    fit_keyframes,
    validate_request,
)
from h3serve.pipeline.sampling import (
    bind_model,
    denoise,
    draw_layout_noise,
    initial_rows,
    request_generator,
    sample_keyframe_latents,
)
from h3serve.pipeline.schedule import DualSchedule

log = logging.getLogger(__name__)

# The video VAE's pixel convention: ImageNet statistics over [0, 1].
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
FPS = 24

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
VAE_AUTOCAST = {"float16": torch.float16, "none": None}

# The tiny model accepts small canvases (its default is 224x128) so that a render takes seconds on a CPU.
TINY_RULES = RequestRules(canvas=CanvasRule(max_pixels=512 * 512, default_short_edge=128))
STAGES = ("text", "layout", "denoise", "video", "audio")


@dataclass(frozen=True)
class Profile:
    """How the engine runs: where, in which precision. Validated before any weight loads.

    dtype: the DiT block stack and text encoder (the DiT's fp32 islands stay fp32; the VAEs are always fp32).
    vae_autocast: the video decoder's autocast dtype; the released recipe decodes under float16 autocast on the GPU.
    """

    device: str = "cpu"
    dtype: str = "float32"
    vae_autocast: str = "none"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.vae_autocast not in VAE_AUTOCAST:
            raise ValueError(f"vae_autocast must be one of {', '.join(VAE_AUTOCAST)}, got {self.vae_autocast!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError as err:
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}") from err
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r}: CUDA is not available on this machine (allowed: cpu)")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"device {self.device!r}: only {torch.cuda.device_count()} CUDA device(s)")
        if device.type == "cpu" and self.vae_autocast == "float16":
            raise ValueError("vae_autocast float16 needs a CUDA device (allowed on cpu: none)")

    @classmethod
    def for_device(cls, device: str = "cpu", dtype: str | None = None, vae_autocast: str | None = None) -> Profile:
        """Defaults that fit the device: bfloat16 + float16 VAE autocast (the released recipe) on CUDA, float32 on
        the CPU. Explicit values are kept as given and validated."""
        cuda = device.startswith("cuda")
        return cls(
            device=device,
            dtype=dtype or ("bfloat16" if cuda else "float32"),
            vae_autocast=vae_autocast or ("float16" if cuda else "none"),
        )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class RenderResult:
    frames: np.ndarray  # (F, H, W, 3) uint8 RGB
    audio: np.ndarray  # (2, N) float32 in [-1, 1]
    sample_rate: int
    fps: int
    request: RenderRequest
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage, and "total"


@dataclass(frozen=True)
class ModelFolder:
    """A released checkpoint's component folders and configurations, read and cross-checked before any weight."""

    root: Path  # holds text_encoder/, tokenizer/, processor/ beside the folders below
    transformer: Path
    video_vae: Path
    audio_vae: Path
    dit: DiTConfig
    video_vae_config: VideoVAEConfig
    audio_vae_config: AudioVAEConfig
    text_hidden_size: int


def resolve_model_folder(path: str | Path) -> ModelFolder:
    """Find the components of a released checkpoint (the original `FL2VA/` layout, its parent, or the diffusers
    layout) and read every configuration, so that a missing folder, a broken config or components that do not fit
    together stop the start before any weight loads. Raises FileNotFoundError or ValueError naming the file."""
    from transformers import Qwen3VLConfig

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model folder {root} does not exist")
    if (root / "FL2VA" / "transformer").is_dir() and not (root / "transformer").is_dir():
        root = root / "FL2VA"
    for name in ("transformer", "text_encoder", "tokenizer", "processor", "audio_vae"):
        if not (root / name).is_dir():
            raise FileNotFoundError(
                f"model folder {root} has no {name}/ (expected the released FL2VA/ layout or the diffusers layout)"
            )
    video = root / ("video_vae" if (root / "video_vae").is_dir() else "vae")
    if not video.is_dir():
        raise FileNotFoundError(f"model folder {root} has no video_vae/ (original layout) or vae/ (diffusers layout)")
    dit_config = root / "transformer" / "config.json"
    if not dit_config.is_file():
        raise FileNotFoundError(f"{dit_config} is missing")
    text_config = root / "text_encoder" / "config.json"
    try:
        text = Qwen3VLConfig.from_pretrained(str(root / "text_encoder"), local_files_only=True).text_config
    except (OSError, ValueError) as err:
        raise ValueError(f"{text_config}: not a readable Qwen3-VL config ({err})") from err
    video_config, video_weights = read_video_vae_config(video)
    audio_config, audio_weights = read_audio_vae_config(root / "audio_vae")
    folder = ModelFolder(
        root=root,
        transformer=root / "transformer",
        video_vae=video,
        audio_vae=root / "audio_vae",
        dit=DiTConfig.from_json(dit_config),
        video_vae_config=video_config,
        audio_vae_config=audio_config,
        text_hidden_size=text.hidden_size,
    )
    if text.num_hidden_layers <= TEXT_ENCODER_LAYER:
        raise ValueError(
            f"{text_config}: the text encoder has {text.num_hidden_layers} layers; H3 reads the output of layer "
            f"{TEXT_ENCODER_LAYER}, so it needs more than {TEXT_ENCODER_LAYER}"
        )
    check_compatible(folder.dit, folder.video_vae_config, folder.audio_vae_config, folder.text_hidden_size)
    # Every weight file's header too (indexes, shards, key lists; no tensor data): a missing or truncated file
    # stops the start now, not after the components before it have loaded.
    for weights in (folder.transformer, root / "text_encoder", video_weights, audio_weights):
        open_checkpoint(weights)
    return folder


def check_compatible(dit: DiTConfig, video: VideoVAEConfig, audio: AudioVAEConfig, text_hidden_size: int) -> None:
    """The components must fit each other and the pipeline's fixed geometry (1/16 spatial and 1/4 temporal video
    latents on 17-frame clips, 40 audio latents per second); the message names both sides of a mismatch."""
    pairs = [
        ("transformer text_dim", dit.text_dim, "text encoder hidden_size", text_hidden_size),
        ("transformer latents_dim", dit.latents_dim, "video VAE latent_channels", video.latent_channels),
        ("transformer audio_latents_dim", dit.audio_latents_dim, "audio VAE latent_channels", audio.latent_channels),
        ("transformer patch_size", dit.patch_size, "the pipeline's", (1, 2, 2)),
        ("video VAE spatial ratio", video.spatial_ratio, "the pipeline's", 16),
        ("video VAE temporal ratio", video.temporal_ratio, "the pipeline's", 4),
        ("video VAE clip_length", video.clip_length, "the pipeline's", 17),
        ("audio VAE latents per second", audio.sampling_rate / audio.hop_length, "the pipeline's", 40),
    ]
    for left, a, right, b in pairs:
        if a != b:
            raise ValueError(f"incompatible model components: {left} is {_fmt(a)} but {right} is {_fmt(b)}")


def _fmt(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def load_components(folder: ModelFolder, profile: Profile) -> Components:
    device = profile.torch_device
    return Components(
        dit=load_dit(folder.transformer, device=device, dtype=profile.torch_dtype, config=folder.dit),
        text_encoder=load_released_text_encoder(folder.root, device=device, dtype=profile.torch_dtype),
        video_vae=load_video_vae(folder.video_vae, device=device, config=folder.video_vae_config),
        audio_vae=load_audio_vae(folder.audio_vae, device=device, config=folder.audio_vae_config),
        name=str(folder.root),
    )


class Engine:
    """Runs requests through the stages; holds the components and the profile for its whole life."""

    def __init__(self, components: Components, profile: Profile, rules: RequestRules = RELEASED_RULES):
        c = components
        text_hidden = c.text_encoder.model.config.text_config.hidden_size
        check_compatible(c.dit.config, c.video_vae.cfg, c.audio_vae.cfg, text_hidden)
        self.components = components
        self.profile = profile
        self.rules = rules

    @classmethod
    def load(cls, model: str | Path | ModelFolder | None, profile: Profile) -> Engine:
        """`model=None` builds the tiny model; otherwise a released checkpoint folder (or one already resolved)."""
        if model is None:
            components = tiny_components(device=profile.torch_device, dtype=profile.torch_dtype)
            return cls(components, profile, TINY_RULES)
        folder = model if isinstance(model, ModelFolder) else resolve_model_folder(model)
        return cls(load_components(folder, profile), profile)

    @property
    def name(self) -> str:
        return self.components.name

    def validate(self, prompt: str, **kwargs) -> RenderRequest:
        """`validate_request` under this model's canvas and frame rules."""
        return validate_request(prompt, rules=self.rules, **kwargs)

    @contextmanager
    def _stage(self, timings: dict[str, float], name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.profile.torch_device.type == "cuda":
            torch.cuda.synchronize(self.profile.torch_device)
        timings[name] = time.perf_counter() - start

    def _keyframe_latents(self, image: Image.Image) -> torch.Tensor:
        """A keyframe on the canvas -> its normalised, fp16-rounded latent (1, C, 1, H/16, W/16), float32 CPU."""
        vae = self.components.video_vae
        device = self.profile.torch_device
        pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).to(device)  # (H, W, 3)
        pixels = pixels.permute(2, 0, 1)[None, :, None].float().div(255.0)  # (1, 3, 1, H, W)
        mean = torch.tensor(PIXEL_MEAN, device=device).view(1, -1, 1, 1, 1)
        std = torch.tensor(PIXEL_STD, device=device).view(1, -1, 1, 1, 1)
        moments = vae.encode((pixels - mean) / std)
        posterior_mean, logvar = moments.chunk(2, dim=1)
        return sample_keyframe_latents(posterior_mean, logvar, vae.cfg.latents_mean, vae.cfg.latents_std)

    @torch.no_grad()
    def render(self, request: RenderRequest, on_step: Callable[[int, int], None] | None = None) -> RenderResult:
        c, device = self.components, self.profile.torch_device
        cfg = c.dit.config
        timings: dict[str, float] = {}
        start = time.perf_counter()

        with self._stage(timings, "text"):
            keyframes = fit_keyframes(request.keyframes, request.width, request.height)
            text = c.text_encoder.encode(request.prompt, keyframes)
            condition_latents = [self._keyframe_latents(k) for k in keyframes]

        with self._stage(timings, "layout"):
            geometry = MediaGeometry.from_pixels(request.height, request.width, request.num_frames)
            layout = build_layout(text.token_tags, geometry, request.anchors, patch_size=cfg.patch_size)
            noise = draw_layout_noise(request_generator(request.seed), layout, cfg.latents_dim, cfg.audio_latents_dim)
            video_rows, audio_rows = initial_rows(layout, noise, condition_latents)
            schedule = DualSchedule.build(request.steps, request.video_shift, request.audio_shift)
            model = bind_model(c.dit, layout, text.states)

        with self._stage(timings, "denoise"):
            video_rows, audio_rows = denoise(
                model, video_rows.to(device), audio_rows.to(device), layout, schedule, on_step
            )

        if not (torch.isfinite(video_rows).all() and torch.isfinite(audio_rows).all()):
            # Fail closed: a NaN would otherwise reach the MP4 as black pixels.
            raise RuntimeError("the denoised latents are not finite (NaN or inf); nothing was decoded")

        with self._stage(timings, "video"):
            generated = video_rows[layout.num_condition_video_rows :]
            latents = unpatchify_video(generated, geometry, cfg.patch_size)  # (1, C, F, h, w) normalised
            autocast = VAE_AUTOCAST[self.profile.vae_autocast]
            pixels = c.video_vae.decode(c.video_vae.denormalize_latents(latents), autocast_dtype=autocast)
            mean = torch.tensor(PIXEL_MEAN, device=pixels.device).view(1, -1, 1, 1, 1)
            std = torch.tensor(PIXEL_STD, device=pixels.device).view(1, -1, 1, 1, 1)
            if not torch.isfinite(pixels).all():
                raise RuntimeError("the video decoder produced non-finite pixels (NaN or inf)")
            # In place: at 1344x768x362 each full-size float32 copy would be ~4.5 GB.
            pixels = pixels.float().mul_(std).add_(mean).clamp_(0, 1).mul_(255).round_()  # (1, 3, F, H, W)
            frames = pixels[0].permute(1, 2, 3, 0).to(torch.uint8).cpu().numpy()

        with self._stage(timings, "audio"):
            audio_latents = audio_rows_to_latents(audio_rows, layout.audio_channels)  # (2, C, Na)
            wave = c.audio_vae.decode(c.audio_vae.denormalize_latents(audio_latents))  # (2, 1, Na * hop)
            audio = wave[:, 0].float().cpu().numpy()

        timings["total"] = time.perf_counter() - start
        return RenderResult(
            frames=frames,
            audio=audio,
            sample_rate=c.audio_vae.cfg.sampling_rate,
            fps=FPS,
            request=request,
            timings=timings,
        )
