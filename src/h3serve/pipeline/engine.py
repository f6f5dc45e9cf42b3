"""The engine: built once from loaded components (or a model folder, or the built-in tiny model) and a profile;
renders requests by running the stages of the data flow in order and timing each:

    text       prompt + fitted keyframes -> Qwen3-VL layer-50 rows and tags       (pipeline.conditioning)
    keyframes  fitted keyframes -> video VAE posterior samples, normalised         (pipeline.conditioning)
    layout     packed rows, tags, positions, indices; the request's noise          (pipeline.layout, .sampling)
    denoise    N-1 DiT forwards (text refiner, RoPE and indices bound once)        (pipeline.sampling)
    video      generated rows -> frames (uint8)                                    (pipeline.decode)
    audio      audio rows -> stereo waveform (float32 at the model's sample rate)  (pipeline.decode)
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

from h3serve.config import FPS
from h3serve.model.folder import Components, ModelFolder, load_components, resolve_model_folder
from h3serve.model.tiny import tiny_components
from h3serve.pipeline.conditioning import encode_keyframes, encode_text, fit_keyframes
from h3serve.pipeline.decode import check_finite, decode_audio, decode_video
from h3serve.pipeline.layout import MediaGeometry, build_layout
from h3serve.pipeline.request import RELEASED_RULES, TINY_RULES, RenderRequest, RequestRules, validate_request
from h3serve.pipeline.sampling import bind_model, denoise, draw_layout_noise, initial_rows, request_generator
from h3serve.pipeline.schedule import DualSchedule

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
VAE_AUTOCAST = {"float16": torch.float16, "none": None}
STAGES = ("text", "keyframes", "layout", "denoise", "video", "audio")


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


class Engine:
    """Runs requests through the stages; holds the components and the profile for its whole life."""

    def __init__(self, components: Components, profile: Profile, rules: RequestRules = RELEASED_RULES):
        components.check()
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
        return cls(load_components(folder, device=profile.torch_device, dtype=profile.torch_dtype), profile)

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

    @torch.no_grad()
    def render(self, request: RenderRequest, on_step: Callable[[int, int], None] | None = None) -> RenderResult:
        c, device = self.components, self.profile.torch_device
        cfg = c.dit.config
        timings: dict[str, float] = {}
        start = time.perf_counter()

        with self._stage(timings, "text"):
            keyframes = fit_keyframes(request.keyframes, request.width, request.height)
            text = encode_text(c.text_encoder, request.prompt, keyframes)

        with self._stage(timings, "keyframes"):
            keyframe_latents = encode_keyframes(c.video_vae, keyframes)

        with self._stage(timings, "layout"):
            geometry = MediaGeometry.from_pixels(request.height, request.width, request.num_frames)
            layout = build_layout(text.token_tags, geometry, request.anchors, patch_size=cfg.patch_size)
            noise = draw_layout_noise(request_generator(request.seed), layout, cfg.latents_dim, cfg.audio_latents_dim)
            video_rows, audio_rows = initial_rows(layout, noise, keyframe_latents)
            schedule = DualSchedule.build(request.steps, request.video_shift, request.audio_shift)
            model = bind_model(c.dit, layout, text.states)

        with self._stage(timings, "denoise"):
            video_rows, audio_rows = denoise(
                model, video_rows.to(device), audio_rows.to(device), layout, schedule, on_step
            )
        check_finite(video_rows, audio_rows)

        with self._stage(timings, "video"):
            frames = decode_video(c.video_vae, video_rows, layout, VAE_AUTOCAST[self.profile.vae_autocast])

        with self._stage(timings, "audio"):
            audio = decode_audio(c.audio_vae, audio_rows, layout)

        timings["total"] = time.perf_counter() - start
        return RenderResult(
            frames=frames,
            audio=audio,
            sample_rate=c.audio_vae.cfg.sampling_rate,
            fps=FPS,
            request=request,
            timings=timings,
        )
