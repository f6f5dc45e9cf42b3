"""The engine: built once from loaded components (or a model folder, or the built-in tiny model) and a profile;
renders requests by running the stages of the data flow in order and timing each:

    text       prompt + fitted keyframes (or references) -> Qwen3-VL rows and tags  (pipeline.conditioning)
    keyframes  fitted keyframes -> video VAE posterior samples, normalised;        (pipeline.conditioning)
               ref2va: image/video references the same way, soundtracks and audio references -> clean audio rows
    layout     packed rows, tags, positions, indices; the request's noise          (pipeline.layout, .sampling)
    tables     every block's AdaLN modulation table for every step (cached)        (accel.adaln)
    denoise    N-1 DiT forwards (text refiner, RoPE and indices bound once)        (pipeline.sampling)
    video      generated rows -> frames (uint8)                                    (pipeline.decode)
    audio      audio rows -> stereo waveform (float32 at the model's sample rate)  (pipeline.decode)
"""

from __future__ import annotations

import io
import logging
import resource
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from h3serve.accel import apply_profile, load_hooks
from h3serve.accel.adaln import AdalnTables
from h3serve.accel.compile import GraphCounter
from h3serve.accel.stepcache import HIGH_QUALITY, StepCache, StepCacheConfig, StepCacheReport, check_linear
from h3serve.accel.stepcache import attach as attach_step_cache
from h3serve.config import AUDIO_SHIFT, DEFAULT_STEPS, FPS, VIDEO_SHIFT
from h3serve.media.mp4 import DEFAULT_THREADS, encode_mp4, verify_mp4
from h3serve.model.folder import (
    FL2VA,
    REF2VA,
    Components,
    ModelFolder,
    dit_kind,
    load_components,
    resolve_model_folder,
)
from h3serve.model.tiny import tiny_components
from h3serve.pipeline.budget import PLANNED_TEXT_ROWS, dit_activation_bytes, largest_request_rows
from h3serve.pipeline.conditioning import (
    RELEASED_VIDEO_PROCESSING,
    VideoProcessing,
    encode_keyframes,
    encode_references,
    encode_text,
    fit_keyframes,
)
from h3serve.pipeline.context import RenderCancelled, RenderContext
from h3serve.pipeline.decode import check_finite, decode_audio, decode_video
from h3serve.pipeline.layout import TASK_ANCHORS, MediaGeometry, Reference, build_layout, build_ref2va_layout
from h3serve.pipeline.references import reference_descriptors
from h3serve.pipeline.request import (
    RELEASED_RULES,
    TINY_RULES,
    RenderRequest,
    RequestError,
    RequestRules,
    validate_request,
)
from h3serve.pipeline.sampling import (
    bind_model,
    denoise,
    draw_layout_noise,
    initial_rows,
    request_generator,
    step_timesteps,
)
from h3serve.pipeline.schedule import DualSchedule

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
VAE_AUTOCAST = {"float16": torch.float16, "none": None}
STAGES = ("text", "keyframes", "layout", "tables", "denoise", "video", "audio")


# What each backend setting may name (the seed's operator names), and what this build runs. A name outside the first
# set is a typo; a name outside the second is refused rather than run as something else.
ATTENTION_BACKENDS = ("CUDNN_ATTN", "TORCH_SDPA")
EXECUTION_MODES = ("compile", "eager")
LINEAR_BACKENDS = ("BF16", "CUTLASS", "HUMMING")
BUILT = {
    "attention": ("TORCH_SDPA", "CUDNN_ATTN"),
    "execution": ("eager", "compile"),
    "linear": ("BF16", "CUTLASS", "HUMMING"),
}
NOT_BUILT = "not available in this build yet (the acceleration profiles add it)"
# The defaults per device. On CUDA the seed's profile (cuDNN attention, regional compile, CUTLASS FP8 block
# linears); BF16 is the exact profile. On the CPU the only one that runs there.
DEFAULTS = {
    "cuda": {"attention": "CUDNN_ATTN", "execution": "compile", "linear": "CUTLASS"},
    "cpu": {"attention": "TORCH_SDPA", "execution": "eager", "linear": "BF16"},
}


@dataclass(frozen=True)
class Profile:
    """How the engine runs: where, in which precision, with which backends. Validated before any weight loads.

    dtype: the DiT block stack and text encoder (the DiT's fp32 islands stay fp32; the VAEs are always fp32).
    vae_autocast: the video decoder's autocast dtype; the released recipe decodes under float16 autocast on the GPU.
    attention / execution / linear: the backends, by the seed's names. TORCH_SDPA is torch's own
    scaled_dot_product_attention dispatch; BF16 means unquantized linears in `dtype`.
    """

    device: str = "cpu"
    dtype: str = "float32"
    vae_autocast: str = "none"
    attention: str = "TORCH_SDPA"
    execution: str = "eager"
    linear: str = "BF16"
    text_linear: str = "BF16"  # the text encoder's decoder-layer linears: BF16, or CUTLASS (FP8; opt-in)
    adaln_resident: bool = False  # keep the DiT's AdaLN weights on the device instead of only its tables

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.vae_autocast not in VAE_AUTOCAST:
            raise ValueError(f"vae_autocast must be one of {', '.join(VAE_AUTOCAST)}, got {self.vae_autocast!r}")
        for kind, value, names in (
            ("attention", self.attention, ATTENTION_BACKENDS),
            ("execution", self.execution, EXECUTION_MODES),
            ("linear", self.linear, LINEAR_BACKENDS),
        ):
            if value not in names:
                raise ValueError(f"{kind} must be one of {', '.join(names)}, got {value!r}")
            if value not in BUILT[kind]:
                raise ValueError(f"{kind} {value} is {NOT_BUILT}; allowed now: {', '.join(BUILT[kind])}")
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
        if device.type == "cpu":
            if self.vae_autocast == "float16":
                raise ValueError("vae_autocast float16 needs a CUDA device (allowed on cpu: none)")
            for kind, allowed in DEFAULTS["cpu"].items():
                if getattr(self, kind) != allowed:
                    raise ValueError(f"{kind} {getattr(self, kind)} needs a CUDA device (allowed on cpu: {allowed})")
        from h3serve.accel import attention, humming, linear

        attention.check(self.attention, device)
        if self.attention == "CUDNN_ATTN" and self.dtype == "float32":
            raise ValueError("attention CUDNN_ATTN has no float32 kernel: use dtype bfloat16, or attention TORCH_SDPA")
        linear.check(self.linear, device)
        if self.linear == "HUMMING":
            if self.execution != "eager":
                raise ValueError(
                    f"linear HUMMING runs eager only (it is the deterministic profile), got {self.execution}"
                )
            humming.check(device)
        if self.text_linear not in ("BF16", "CUTLASS"):
            raise ValueError(f"text_linear must be one of BF16, CUTLASS, got {self.text_linear!r}")
        linear.check(self.text_linear, device, kind="text_linear")

    @classmethod
    def for_device(
        cls,
        device: str = "cpu",
        dtype: str | None = None,
        vae_autocast: str | None = None,
        attention: str | None = None,
        execution: str | None = None,
        linear: str | None = None,
        text_linear: str | None = None,
    ) -> Profile:
        """Defaults that fit the device: bfloat16 + float16 VAE autocast (the released recipe) on CUDA, float32 on
        the CPU; the backends this build runs. Explicit values are kept as given and validated."""
        cuda = device.startswith("cuda")
        defaults = DEFAULTS["cuda" if cuda else "cpu"]
        return cls(
            device=device,
            dtype=dtype or ("bfloat16" if cuda else "float32"),
            vae_autocast=vae_autocast or ("float16" if cuda else "none"),
            attention=attention or defaults["attention"],
            execution=execution or defaults["execution"],
            linear=linear or defaults["linear"],
            text_linear=text_linear or "BF16",
        )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def vae_autocast_dtype(self) -> torch.dtype | None:
        return VAE_AUTOCAST[self.vae_autocast]


@dataclass
class RenderResult:
    frames: np.ndarray  # (F, H, W, 3) uint8 RGB
    audio: np.ndarray  # (2, N) float32 in [-1, 1]
    sample_rate: int
    fps: int
    request: RenderRequest
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage, and "total"
    peak_memory_mb: float = 0.0  # CUDA: peak allocated during this render; CPU: the process's peak RSS so far
    step_cache: StepCacheReport | None = None  # which forwards reused cached blocks (None: no step cache attached)


@dataclass(frozen=True)
class WarmupResult:
    """The startup warmup: a short render at the production shape, encoded and checked as the clients will."""

    passed: bool
    seconds: float
    request: str  # what was rendered, e.g. "t2va 768x448 56 frames 1 step(s)"
    error: str | None = None


WARMUP_PROMPT = "Macro soldering a PCB under warm bench light, soft room tone."
WARMUP_STEPS = 2  # grid points: one forward, as the seed's 2-step warmup


class Engine:
    """Runs requests through the stages; holds the components and the profile for its whole life.

    One render runs at a time (a lock), whoever calls: the CLI, the service's worker, the warmup.
    """

    def __init__(
        self,
        components: Components,
        profile: Profile,
        rules: RequestRules = RELEASED_RULES,
        video_processing: VideoProcessing = RELEASED_VIDEO_PROCESSING,
        step_cache: StepCacheConfig | None = None,
    ):
        components.check()
        if step_cache is not None:
            check_linear(profile.linear)
        self.components = components
        self.profile = profile
        self.rules = rules
        self.video_processing = video_processing  # how Qwen reads a reference video (the processor's config)
        self.lock = threading.Lock()
        self.compiled: GraphCounter | None = apply_profile(components, profile)
        # One AdaLN table cache per loaded DiT (FL2VA, Ref2VA): same architecture, different weights.
        self.tables = {kind: AdalnTables(dit, resident=profile.adaln_resident) for kind, dit in components.dits.items()}
        # Step caching (lossy, opt-in): attached after compiling, around each DiT's blocks (`accel.stepcache`).
        self.step_caches: dict[str, StepCache] = {}
        if step_cache is not None:
            self.step_caches = {kind: attach_step_cache(dit, step_cache) for kind, dit in components.dits.items()}

    @classmethod
    def load(
        cls,
        model: str | Path | ModelFolder | None,
        profile: Profile,
        task_type: str = FL2VA,
        step_cache: StepCacheConfig | None = None,
    ) -> Engine:
        """`model=None` builds the tiny model; otherwise a released checkpoint folder (or one already resolved).
        `task_type`: which DiTs to load (fl2va, ref2va or both; `model.folder.TASK_TYPES`), checked first.
        `step_cache`: the DBCache profile every request runs with unless it asks otherwise (None: no caching)."""
        if step_cache is not None:
            check_linear(profile.linear)  # before any weight loads
        if model is None:
            components = tiny_components(device=profile.torch_device, dtype=profile.torch_dtype, task_type=task_type)
            return cls(components, profile, TINY_RULES, step_cache=step_cache)
        folder = model if isinstance(model, ModelFolder) else resolve_model_folder(model)
        folder.check_task_type(task_type)
        config = folder.processor / "video_preprocessor_config.json"
        video_processing = VideoProcessing.from_folder(folder.processor) if config.is_file() else None
        components = load_components(
            folder, device=profile.torch_device, dtype=profile.torch_dtype, task_type=task_type, **load_hooks(profile)
        )
        return cls(components, profile, RELEASED_RULES, video_processing or RELEASED_VIDEO_PROCESSING, step_cache)

    @property
    def name(self) -> str:
        return self.components.name

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this engine serves: the base modes with the FL2VA DiT, ref2va with the Ref2VA DiT."""
        base = tuple(TASK_ANCHORS) if self.components.dit is not None else ()
        return base + ((REF2VA,) if self.components.ref_dit is not None else ())

    def check_task(self, task: str) -> None:
        """RequestError("task") for a task whose DiT this engine did not load, saying how to start one that does."""
        if task in self.tasks or (task not in TASK_ANCHORS and task != REF2VA):
            return  # served, or unknown (validate_request names the tasks)
        needed = (
            "the Ref2VA DiT (task type ref2va or both)" if task == REF2VA else "the FL2VA DiT (task type fl2va or both)"
        )
        raise RequestError(
            "task",
            f"task {task} needs {needed}, but this server was started with task type {self.components.task_type} "
            f"and serves only {', '.join(self.tasks)}; restart it with H3_TASK_TYPE (--task-type) set to include it",
        )

    def check_quality(self, quality: str | None) -> None:
        """RequestError("quality") for quality=high on an engine without a step cache: the operator chose full
        compute, and a lossy render is never something a request turns on by itself."""
        if quality == "high" and not self.step_caches:
            raise RequestError(
                "quality",
                "quality high runs the conservative step-cache profile, but this server runs without step caching "
                "(H3_CACHE_BACKEND=none); leave quality out or send lossless, or start the server with "
                "H3_CACHE_BACKEND=cache_dit",
            )

    def validate(self, prompt: str, **kwargs) -> RenderRequest:
        """`validate_request` under this model's canvas and frame rules, for a task whose DiT is loaded."""
        self.check_task(kwargs.get("task", "t2va"))
        self.check_quality(kwargs.get("quality"))
        request = validate_request(prompt, rules=self.rules, **kwargs)
        if request.task == REF2VA:
            self.check_rows(request)
        return request

    def check_rows(self, request: RenderRequest) -> None:
        """RequestError("references") for a Ref2VA request that packs more rows than the memory plan covers.

        The plan (`pipeline.budget`: `h3serve check --preflight`, the start's gate, `memory_budget`) is made for the
        largest base-mode request the rules allow. A Ref2VA request can be far larger (each reference image at a 2048
        short edge is up to 16,384 rows), so it is held to the same count, its prompt's rows excluded as the plan
        allows them: a request that fits the plan is never one the GPU cannot hold.
        """
        cfg = self.components.dit_config
        geometry = MediaGeometry.from_pixels(request.height, request.width, request.num_frames)
        blocks = reference_descriptors(request.references)
        layout = build_ref2va_layout([], blocks, geometry, patch_size=cfg.patch_size)  # the rows, no prompt
        references = layout.num_reference_video_rows + layout.num_reference_audio_rows
        target = layout.num_video_rows + layout.num_audio_rows
        limit = largest_request_rows(cfg, self.rules) - PLANNED_TEXT_ROWS
        if references + target > limit:
            raise RequestError(
                "references",
                f"references: this request packs {references} reference rows and {target} rows of its own video "
                f"and audio, {references + target} in all; the server's memory plan covers {limit} (the largest "
                f"keyframe request, {self.rules.frames.max_frames} frames of 16:9). Use fewer or smaller reference "
                "images or videos, or fewer frames",
            )

    @contextmanager
    def _stage(self, timings: dict[str, float], name: str, ctx: RenderContext) -> Iterator[None]:
        ctx.report(name, 0, 1)  # a stage boundary: a cancelled render stops here
        start = time.perf_counter()
        yield
        if self.profile.torch_device.type == "cuda":
            torch.cuda.synchronize(self.profile.torch_device)
        timings[name] = time.perf_counter() - start

    def render(
        self,
        request: RenderRequest,
        ctx: RenderContext | None = None,
        on_step: Callable[[int, int], None] | None = None,
    ) -> RenderResult:
        """Run one request. `ctx` carries the cancel flag and progress events; `on_step(done, total)` is a plain
        per-step callback (the CLI's progress bar). Raises RenderCancelled when cancelled; the memory the render
        held is released before that reaches the caller."""
        ctx = ctx or RenderContext()
        with self.lock:
            cuda = self.profile.torch_device.type == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.profile.torch_device)
            try:
                result = self._render(request, ctx, on_step)
            except RenderCancelled:
                if cuda:
                    torch.cuda.empty_cache()
                raise
            result.peak_memory_mb = _peak_memory_mb(self.profile.torch_device)
            return result

    @torch.no_grad()
    def _render(
        self, request: RenderRequest, ctx: RenderContext, on_step: Callable[[int, int], None] | None
    ) -> RenderResult:
        c, device = self.components, self.profile.torch_device
        self.check_task(request.task)
        self.check_quality(request.quality)
        kind = dit_kind(request.task)
        dit = c.dits[kind]
        cfg = dit.config
        timings: dict[str, float] = {}
        start = time.perf_counter()

        def step_done(done: int, total: int) -> None:
            if on_step is not None:
                on_step(done, total)
            ctx.report("denoise", done, total)

        with self._stage(timings, "text", ctx):
            if kind == REF2VA:
                keyframes = []
                text = encode_text(
                    c.text_encoder,
                    request.prompt,
                    references=request.references,
                    video_processing=self.video_processing,
                )
            else:
                keyframes = fit_keyframes(request.keyframes, request.width, request.height)
                text = encode_text(c.text_encoder, request.prompt, keyframes)

        with self._stage(timings, "keyframes", ctx):
            condition_audio = ()
            if kind == REF2VA:
                latents = encode_references(c.video_vae, c.audio_vae, request.references)
                condition_latents, condition_audio = latents.video, latents.audio
            else:
                condition_latents = encode_keyframes(c.video_vae, keyframes)

        with self._stage(timings, "layout", ctx):
            geometry = MediaGeometry.from_pixels(request.height, request.width, request.num_frames)
            if kind == REF2VA:
                blocks = reference_descriptors(request.references)
                layout = build_ref2va_layout(text.token_tags, blocks, geometry, patch_size=cfg.patch_size)
            else:
                layout = build_layout(text.token_tags, geometry, request.anchors, patch_size=cfg.patch_size)
            noise = draw_layout_noise(request_generator(request.seed), layout, cfg.latents_dim, cfg.audio_latents_dim)
            video_rows, audio_rows = initial_rows(layout, noise, condition_latents, condition_audio)
            schedule = DualSchedule.build(request.steps, request.video_shift, request.audio_shift)

        with self._stage(timings, "tables", ctx):
            tables = self.tables[kind].for_steps(step_timesteps(layout, schedule))

        with self._stage(timings, "denoise", ctx):
            model = bind_model(dit, layout, text.states, tables)
            cache = self.step_caches.get(kind)
            if cache is not None:
                high = request.quality == "high"
                cache.begin_request(
                    request.steps - 1, enabled=request.quality != "lossless", config=HIGH_QUALITY if high else None
                )
            try:
                video_rows, audio_rows = denoise(
                    model, video_rows.to(device), audio_rows.to(device), layout, schedule, step_done
                )
            finally:
                cache_report = cache.end_request() if cache is not None else None
        check_finite(video_rows, audio_rows)

        with self._stage(timings, "video", ctx):
            frames = decode_video(
                c.video_vae, video_rows, layout, self.profile.vae_autocast_dtype, lambda i, n: ctx.report("video", i, n)
            )

        with self._stage(timings, "audio", ctx):
            audio = decode_audio(c.audio_vae, audio_rows, layout)
        ctx.check()

        timings["total"] = time.perf_counter() - start
        return RenderResult(
            frames=frames,
            audio=audio,
            sample_rate=c.audio_vae.cfg.sampling_rate,
            fps=FPS,
            request=request,
            timings=timings,
            step_cache=cache_report,
        )

    def memory_budget(self, text_rows: int = 1024) -> dict[str, float]:
        """GiB: the weights on the device per component (one device per engine, so matched by device type), the
        AdaLN weights held in host memory, and an estimate of the DiT's activations at the largest request the rules
        allow (`pipeline.budget`, which also plans the same rows from a folder's configurations before loading)."""
        gib = 2**30
        device = self.profile.torch_device

        def on_device(module: torch.nn.Module) -> float:
            tensors = [*module.parameters(), *module.buffers()]
            return sum(t.numel() * t.element_size() for t in tensors if t.device.type == device.type) / gib

        c = self.components
        names = {FL2VA: "dit", REF2VA: "ref_dit"}
        report = {names[kind]: round(on_device(dit), 3) for kind, dit in c.dits.items()}
        for name in ("text_encoder", "video_vae", "audio_vae"):
            report[name] = round(on_device(getattr(c, name)), 3)
        report["weights_total"] = round(sum(report.values()), 3)
        host = [
            p
            for dit in c.dits.values()
            for b in dit.blocks
            for p in b.adaln_proj.parameters()
            if p.device.type != device.type
        ]
        report["adaln_in_host_memory"] = round(sum(p.numel() * p.element_size() for p in host) / gib, 3)
        rows = largest_request_rows(c.dit_config, self.rules, text_rows)
        report["largest_request_rows"] = rows
        report["dit_activations_at_largest"] = round(dit_activation_bytes(c.dit_config, rows) / gib, 3)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            report["device_free"], report["device_total"] = round(free / gib, 3), round(total / gib, 3)
        return report

    def prepare_tables(self) -> float:
        """Make the AdaLN tables of the default schedule (`DEFAULT_STEPS` grid points, the default shifts) for every
        task the loaded DiTs serve, so that requests with the defaults find them made (a start-up step; other
        schedules are made on demand). Only each step's distinct timesteps matter, and those depend only on which
        clocks a layout has, so a one-row prompt on the warmup's canvas stands in for the requests: per base mode,
        and for ref2va without and with reference audio. Returns the seconds it took."""
        start = time.perf_counter()
        schedule = DualSchedule.build(DEFAULT_STEPS, VIDEO_SHIFT, AUDIO_SHIFT)
        shape = self.warmup_request()
        geometry = MediaGeometry.from_pixels(shape.height, shape.width, shape.num_frames)
        patch = self.components.dit_config.patch_size
        layouts = {FL2VA: [], REF2VA: []}
        for anchors in dict.fromkeys(TASK_ANCHORS.values()):
            layouts[FL2VA].append(build_layout([1], geometry, anchors, patch_size=patch))
        image = Reference.image(patch[1], patch[2])
        for refs in ([image], [image, Reference.audio(1)]):
            layouts[REF2VA].append(build_ref2va_layout([1], refs, geometry, patch_size=patch))
        for kind, tables in self.tables.items():
            for layout in layouts[kind]:
                tables.for_steps(step_timesteps(layout, schedule))
        return time.perf_counter() - start

    def warmup_request(self) -> RenderRequest:
        """The production shape (768x448, 56 frames for the released model; the tiny model's own default): T2VA, or
        with only the Ref2VA DiT loaded, ref2va with one generated image reference."""
        size = self.rules.warmup_size
        task = "t2va" if "t2va" in self.tasks else REF2VA
        extra = {"references": [("warmup.png", _warmup_reference())]} if task == REF2VA else {}
        return self.validate(
            WARMUP_PROMPT,
            task=task,
            width=size[0] if size else None,
            height=size[1] if size else None,
            num_frames=self.rules.warmup_frames,
            steps=WARMUP_STEPS,
            seed=0,
            **extra,
        )

    def warmup(self, threads: int = DEFAULT_THREADS) -> WarmupResult:
        """Render the warmup request, encode it to MP4 in memory and check the file as a client would (codecs,
        size, frame count, stereo AAC). Never raises: a failure is the result, with its reason."""
        start = time.perf_counter()
        request = self.warmup_request()
        shape = (
            f"{request.task} {request.width}x{request.height} {request.num_frames} frames {request.steps - 1} step(s)"
        )
        try:
            with self.lock:
                log.info("default-schedule AdaLN tables made in %.2f s", self.prepare_tables())
            result = self.render(request)
            buffer = io.BytesIO()
            encode_mp4(
                buffer, result.frames, result.audio, fps=result.fps, sample_rate=result.sample_rate, threads=threads
            )
            buffer.seek(0)
            verify_mp4(buffer, width=request.width, height=request.height, num_frames=request.num_frames)
        except Exception as err:  # the warmup reports every failure instead of raising: the server stays not ready
            log.exception("warmup failed")
            return WarmupResult(False, time.perf_counter() - start, shape, f"{type(err).__name__}: {err}")
        return WarmupResult(True, time.perf_counter() - start, shape)


def _warmup_reference() -> bytes:
    """A square PNG (colour gradients) standing in for a reference image in a Ref2VA-only warmup."""
    from PIL import Image

    ramp = np.linspace(0, 255, 64, dtype=np.float32)
    rgb = np.stack([ramp[None, :].repeat(64, 0), ramp[:, None].repeat(64, 1), 255 - ramp[None, :].repeat(64, 0)], -1)
    buffer = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is KiB on Linux: the whole process's peak, not this render's alone.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
