"""The engine: built once from loaded components (or a model folder, or the built-in tiny model) and a profile;
renders requests by running the stages of the data flow in order and timing each:

    text       prompt + fitted keyframes (or references) -> Qwen3-VL rows and tags  (pipeline.conditioning)
    keyframes  fitted keyframes, or Ref2VA's references -> clean condition latents (pipeline.conditioning)
    layout     packed rows, tags, positions, indices; the request's noise          (pipeline.layout, .sampling)
    tables     every block's AdaLN modulation table for every step (cached)        (accel.adaln)
    denoise    the DiT forwards (text refiner, RoPE and indices bound once)        (pipeline.sampling)
    video      generated rows -> frames (uint8)                                    (pipeline.decode)
    audio      audio rows -> stereo waveform (float32 at the model's sample rate)  (pipeline.decode)

What a request may ask of a loaded engine is `pipeline.admission`'s; the memory report is `pipeline.budget`'s; the
startup warmup is the service's (`service.warmup`).
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from h3serve.accel import attention, offload
from h3serve.accel import profile as profiles
from h3serve.accel.adaln import AdalnTables
from h3serve.accel.apply import apply, load_plan
from h3serve.accel.compile import Compiler, GraphCounter
from h3serve.accel.lora import RuntimeAdapters
from h3serve.accel.profile import Attention, Profile
from h3serve.accel.stepcache import HIGH_QUALITY, StepCache, StepCacheConfig, StepCacheReport
from h3serve.accel.stepcache import attach as attach_step_cache
from h3serve.checkpoint.adapters import Adapter, AdapterMerge, merge_into
from h3serve.checkpoint.adapters.library import AdapterLibrary, catalog_of
from h3serve.checkpoint.folder import ModelFolder, load_components, resolve_model_folder
from h3serve.checkpoint.safetensors import chain
from h3serve.config import FPS
from h3serve.model.components import Components
from h3serve.model.tiny import tiny_components
from h3serve.pipeline.admission import Admission, check_adapter_kinds, check_declared_kinds
from h3serve.pipeline.budget import Budget, loaded_budget
from h3serve.pipeline.conditioning import RELEASED_VIDEO_PROCESSING, VideoProcessing
from h3serve.pipeline.context import RenderCancelled, RenderContext
from h3serve.pipeline.decode import check_finite
from h3serve.pipeline.placement import RESIDENT, Placement
from h3serve.pipeline.preview import due, make_preview
from h3serve.pipeline.request import RenderRequest, RequestFields
from h3serve.pipeline.rules import RELEASED_RULES, TINY_RULES, RequestRules
from h3serve.pipeline.sampling import denoise, draw_layout_noise, initial_rows, request_generator, step_timesteps
from h3serve.pipeline.schedule import DualSchedule
from h3serve.pipeline.spread import ONE_DEVICE, Spread
from h3serve.pipeline.variants import clock_layouts, encode_conditions, encode_prompt
from h3serve.vocab import TaskType, dit_kind

log = logging.getLogger(__name__)

# The render's stages in order, each with its share of a job's progress (percent; denoise is spread over its
# forwards, video over its decode windows).
STAGES = {"text": 4, "keyframes": 2, "layout": 1, "tables": 1, "denoise": 79, "video": 11, "audio": 2}


@dataclass
class RenderResult:
    frames: np.ndarray | None  # (F, H, W, 3) uint8 RGB; None when they went to `RenderContext.frames_to`
    audio: np.ndarray  # (2, N) float32 in [-1, 1]
    sample_rate: int
    fps: int
    request: RenderRequest
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage, and "total"
    peak_memory_mb: float = 0.0  # CUDA: peak allocated during this render; CPU: the process's peak RSS so far
    step_cache: StepCacheReport | None = None  # which forwards reused cached blocks (None: no step cache attached)
    split: tuple[int, ...] = ()  # packed rows per GPU, when several shared the render (`h3serve.parallel`)


class RenderEngine(Protocol):
    """What the CLI, the service and the warmup use of an engine. `Engine` renders in this process;
    `parallel.workers.ParallelEngine` splits each render over worker processes, one per GPU, and answers for rank 0's
    engine."""

    profile: Profile
    rules: RequestRules
    admission: Admission  # what a request may ask (`pipeline.admission`)
    adapters: tuple[Adapter, ...]  # few-step adapters merged at load
    merge_seconds: float  # what merging them took, part of the load
    placement: Placement  # what waits in host memory and streams in (`pipeline.placement`)

    @property
    def name(self) -> str: ...

    @property
    def tasks(self) -> tuple[str, ...]: ...

    @property
    def num_gpus(self) -> int:
        """GPUs one render runs on."""
        ...

    @property
    def problem(self) -> str | None:
        """Why renders cannot run now (a GPU worker lost, the workers restarting), or None."""
        ...

    @property
    def recovering(self) -> bool:
        """The GPU workers are being started again (a node is awaited): a render would fail at once, so the service's
        queue waits instead."""
        ...

    @property
    def nodes(self) -> list[dict[str, Any]] | None:
        """Each node of a group over several hosts (its ranks, whether it has joined), else None."""
        ...

    def validate(self, fields: RequestFields) -> RenderRequest: ...

    def memory_budget(self) -> Budget: ...

    def render(
        self,
        request: RenderRequest,
        ctx: RenderContext | None = None,
        on_step: Callable[[int, int], None] | None = None,
    ) -> RenderResult: ...

    def prepare_tables(self) -> float: ...

    def close(self) -> None:
        """Release what the engine holds beyond memory (worker processes); the engine is not used after."""
        ...


class Engine:
    """Runs requests through the stages; holds the components, the profile and each model's choices for its whole
    life. One render runs at a time (a lock), whoever calls: the CLI, the service's worker, the warmup."""

    def __init__(
        self,
        components: Components,
        profile: Profile,
        rules: RequestRules = RELEASED_RULES,
        video_processing: VideoProcessing = RELEASED_VIDEO_PROCESSING,
        step_cache: StepCacheConfig | None = None,
        compiler: Compiler | None = None,
        adapters: Sequence[Adapter] = (),
        merge_seconds: float = 0.0,
        spread: Spread = ONE_DEVICE,
        placement: Placement = RESIDENT,
        keep_text_encoder: bool = True,
        library: AdapterLibrary | None = None,
    ):
        if placement.streams and not profiles.Linear(profile.linear).streams:  # a rule of values: before the machine's
            raise profiles.ProfileError("linear", "HUMMING's FP8 layout does not stream from host memory; place it all "
                                        "on the device (H3_OFFLOAD=none) or use another H3_LINEAR_BACKEND")  # fmt: skip
        if step_cache is not None:  # a rule of values; what the machine runs was checked by `load` (or by the
            profiles.check_step_cache(profile.linear)  # caller that built `components` on it)
        components.check()
        if profile.attention == Attention.AUTO:  # not chosen at start (`startup.preflight`): a benchmark's or a test's
            profile, line = attention.resolve(profile, components.dit_config.attention_head_dim)
            log.info("%s", line)
        self.components = components
        self.profile = profile
        self.rules = rules
        self.video_processing = video_processing  # how Qwen reads a reference video (the processor's config)
        self.lock = threading.Lock()
        self.spread = spread  # one process, or this rank's part of a render over several GPUs (`h3serve.parallel`)
        # The compile's graph counter (None when eager): how many graphs compiled, and whether any recompiled.
        self.compiled: GraphCounter | None = apply(components, profile, compiler)
        # Run-time adapters (H3_ADAPTERS): each DiT's targeted linears wrapped once, after the profile made them and
        # before the placement streams any block (their buffers stay on the device).
        self.library = library
        if library is not None:
            check_declared_kinds(library.catalog, components.task_type)
        self.runtime = {
            kind: RuntimeAdapters(dit, library, kind, profile.torch_dtype, profile.torch_device,
                                  wide=not placement.dit_streamed)
            for kind, dit in components.dits.items()
        } if library is not None else {}  # fmt: skip
        # What waits in host memory and streams in when it runs (`pipeline.placement`, `accel.offload`): after every
        # transform of the weights, before anything reads them (the AdaLN tables read the blocks' device).
        self.placement = placement
        self.offloaded = offload.attach(
            components,
            profile.torch_device,
            placement.dit_streamed,
            placement.text_streamed,
            placement.video_vae_visits,
            placement.slots,
        )
        if not keep_text_encoder:  # a split's rank other than 0: rank 0 encodes every prompt and broadcasts its states
            components.text_encoder.to("meta")
            self.offloaded.drop_text()  # and its layers' page-locked copies, where they streamed
        if placement.streams:
            log.info("placement: %s", placement.describe())
        # One AdaLN table cache per DiT (FL2VA, Ref2VA); mapped weights take the adapters' merge as they stream in.
        merge = AdapterMerge(adapters) if adapters and components.adaln_mapped else None
        self.tables = {kind: AdalnTables(dit, weights=profile.adaln_weights, cache_size=profile.adaln_tables_kept,
                                         merge=merge, mapped_load=components.adaln_mapped)
                       for kind, dit in components.dits.items()}  # fmt: skip
        # Step caching (lossy, opt-in): the outer layer of each DiT's block stack (`accel.stepcache`).
        self.step_caches: dict[str, StepCache] = {}
        if step_cache is not None:
            self.step_caches = {kind: attach_step_cache(dit, step_cache) for kind, dit in components.dits.items()}
        # Few-step adapters, already merged into the DiT's weights (`load`): their trained sampler is the default.
        self.adapters = tuple(adapters)
        self.merge_seconds = merge_seconds
        self.admission = Admission.build(
            components.task_type,
            rules,
            components.dit_config,
            bool(self.step_caches),
            self.adapters,
            max_rows=placement.max_rows,
            ranks=spread.ranks,
            catalog=catalog_of(library),
        )

    @classmethod
    def load(
        cls,
        model: str | Path | ModelFolder | None,
        profile: Profile,
        task_type: str = TaskType.FL2VA,
        step_cache: StepCacheConfig | None = None,
        adapters: Sequence[Adapter] = (),
        placement: Placement = RESIDENT,
        spread: Spread = ONE_DEVICE,
        keep_text_encoder: bool = True,
        library: AdapterLibrary | None = None,
    ) -> Engine:
        """`model=None` builds the tiny model; otherwise a released checkpoint folder (or one already resolved).
        `task_type`: which DiTs to load (fl2va, ref2va or both), checked first. `step_cache`: the DBCache profile
        every request runs with unless it asks otherwise (None: no caching). `adapters`: few-step adapters
        (`checkpoint.adapters.read_adapter`, already checked against the DiT's config), merged into the BF16 weights as
        they load, before FP8 quantization and before any AdaLN table is made. `placement`: what waits in host memory
        (`pipeline.placement`); a load sends those tensors there as they are read. `spread`: this process's part of a
        render over several (`h3serve.parallel`); `keep_text_encoder` False frees the text encoder once loaded (a
        split's rank that never encodes a prompt). `library`: the adapters requests may apply at run time
        (`checkpoint.adapters.library`, read and checked already). The profile is checked against the machine before
        any weight loads."""
        _check(profile, step_cache)
        check_adapter_kinds(adapters, task_type)
        if model is None:
            components = tiny_components(device=profile.torch_device, dtype=profile.torch_dtype, task_type=task_type)
            start = time.perf_counter()
            for dit in components.dits.values():
                merge_into(dit, adapters)
            merged = time.perf_counter() - start
            return cls(components, profile, TINY_RULES, step_cache=step_cache, adapters=adapters, merge_seconds=merged,
                       spread=spread, placement=placement, keep_text_encoder=keep_text_encoder,
                       library=library)  # fmt: skip
        folder = model if isinstance(model, ModelFolder) else resolve_model_folder(model)
        folder.check_task_type(task_type)
        hooks = load_plan(profile).hooks(folder)  # with the video decoder's float16 weights converted as read
        merge = AdapterMerge(adapters) if adapters else None
        # Merged in BF16, then quantized and placed; what streams goes to host memory as it is read.
        hooks["dit_hook"] = chain(merge, hooks["dit_hook"], offload.OffloadHook(placement.dit_host_names()))
        hooks["text_hook"] = chain(hooks["text_hook"], offload.OffloadHook(placement.text_host_names()))
        video_device = torch.device("cpu") if placement.video_vae_visits else None
        components = load_components(folder, device=profile.torch_device, dtype=profile.torch_dtype,
                                     task_type=task_type, video_vae_device=video_device, **hooks)  # fmt: skip
        config = folder.processor / "video_preprocessor_config.json"
        video_processing = VideoProcessing.from_folder(folder.processor) if config.is_file() else None
        merged = merge.seconds if merge is not None else 0.0
        processing = video_processing or RELEASED_VIDEO_PROCESSING
        return cls(components, profile, RELEASED_RULES, processing, step_cache, adapters=adapters, merge_seconds=merged,
                   spread=spread, placement=placement, keep_text_encoder=keep_text_encoder,
                   library=library)  # fmt: skip

    # The RenderEngine interface: one process renders on one device, and has no workers to lose or stop.
    num_gpus = 1
    problem: str | None = None
    recovering: bool = False
    nodes: list[dict[str, Any]] | None = None

    def close(self) -> None:
        pass

    @property
    def name(self) -> str:
        return self.components.name

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this engine serves: the base modes with the FL2VA DiT, ref2va with the Ref2VA DiT."""
        return self.admission.tasks

    def validate(self, fields: RequestFields) -> RenderRequest:
        """`Admission.validate`: the request under this engine's rules, for a task whose DiT is loaded."""
        return self.admission.validate(fields)

    def memory_budget(self) -> Budget:
        """What the loaded components hold, counted as the plan counts it (`pipeline.budget.loaded_budget`)."""
        budget = loaded_budget(self.components, self.profile, self.rules)
        if not self.placement.streams:
            return budget
        host = {**budget.host, "streamed weights (page-locked)": self.offloaded.host_bytes / 2**30}
        return dataclasses.replace(budget, host=host)

    @contextmanager
    def _stage(self, timings: dict[str, float], name: str, ctx: RenderContext) -> Iterator[None]:
        ctx.report(name, 0, 1)  # a stage boundary: a cancelled render stops here
        start = time.perf_counter()
        yield
        if self.profile.cuda:
            torch.cuda.synchronize(self.profile.torch_device)
        timings[name] = time.perf_counter() - start

    def _video_vae(self, needed: bool):
        """The video VAE on the device for a stage that runs it (it visits when the placement keeps it in host
        memory)."""
        return self.offloaded.visiting() if needed else nullcontext()

    def render(
        self,
        request: RenderRequest,
        ctx: RenderContext | None = None,
        on_step: Callable[[int, int], None] | None = None,
    ) -> RenderResult:
        """Run one request. `ctx` carries the cancel flag and progress events; `on_step(done, total)` is a plain
        per-forward callback (the CLI's progress bar). Raises RenderCancelled when cancelled; the memory the render
        held is released before that reaches the caller."""
        ctx = ctx or RenderContext()
        with self.lock:
            if self.profile.cuda:
                torch.cuda.reset_peak_memory_stats(self.profile.torch_device)
            try:
                result = self._render(request, ctx, on_step)
            except RenderCancelled:
                if self.profile.cuda:
                    torch.cuda.empty_cache()
                raise
            result.peak_memory_mb = _peak_memory_mb(self.profile.torch_device)
            return result

    @torch.no_grad()
    def _render(
        self, request: RenderRequest, ctx: RenderContext, on_step: Callable[[int, int], None] | None
    ) -> RenderResult:
        components, device = self.components, self.profile.torch_device
        self.admission.check_task(request.task)
        self.admission.check_quality(request.quality)
        kind = dit_kind(request.task)
        dit = components.dits[kind]
        cfg = dit.config
        timings: dict[str, float] = {}
        start = time.perf_counter()

        def step_done(done: int, total: int) -> None:
            if on_step is not None:
                on_step(done, total)
            ctx.report("denoise", done, total)

        spread = self.spread
        with self._stage(timings, "text", ctx):
            text, keyframes = spread.share(lambda: encode_prompt(components, request, self.video_processing))
        with self._stage(timings, "keyframes", ctx), self._video_vae(bool(keyframes or request.references)):
            conditions = spread.share(lambda: encode_conditions(components, request, text, keyframes))
        with self._stage(timings, "layout", ctx):
            layout = conditions.layout(request, cfg.patch_size)
            noise = draw_layout_noise(request_generator(request.seed), layout, cfg.latents_dim, cfg.audio_latents_dim)
            video_rows, audio_rows = initial_rows(layout, noise, conditions.latents, conditions.audio)
            schedule = request.schedule
        with self._stage(timings, "tables", ctx):
            adaln = self._apply_adapters(kind, request, timings)
            tables = self.tables[kind].for_steps(step_timesteps(layout, schedule), adaln)
        with self._stage(timings, "denoise", ctx):
            model = spread.bind(dit, layout, text.states, tables)
            cache = self.step_caches.get(kind)
            if cache is not None:
                high = request.quality == "high"
                cache.begin_request(
                    schedule.num_steps, enabled=request.quality != "lossless", config=HIGH_QUALITY if high else None
                )
            on_estimate = self._previews(request, layout, ctx, timings)
            try:
                video_rows, audio_rows = denoise(
                    model, video_rows.to(device), audio_rows.to(device), layout, schedule, step_done, on_estimate
                )
            finally:
                cache_report = cache.end_request() if cache is not None else None
        check_finite(video_rows, audio_rows)
        sink, sample_rate = ctx.frames_to, components.audio_vae.cfg.sampling_rate
        autocast = self.profile.vae_autocast_dtype
        report = lambda i, n: ctx.report("video", i, n)  # noqa: E731
        if sink is None:
            with self._stage(timings, "video", ctx), self._video_vae(True):
                frames = spread.decode_video(components.video_vae, video_rows, layout, autocast, report)
            with self._stage(timings, "audio", ctx):
                audio = spread.decode_audio(components.audio_vae, audio_rows, layout)
        else:  # frames streamed to the encoder as they are decoded: the audio first (the encoder interleaves it)
            if not self.admission.frames_stream:
                raise ValueError("a split render's frames cannot stream to an encoder: they reach the parent whole")
            with self._stage(timings, "audio", ctx):
                audio = spread.decode_audio(components.audio_vae, audio_rows, layout)
            sink.begin(audio, sample_rate, FPS, request.width, request.height)
            with self._stage(timings, "video", ctx), self._video_vae(True):
                frames = spread.decode_video(components.video_vae, video_rows, layout, autocast, report, sink.put)
        ctx.check()
        timings["total"] = time.perf_counter() - start
        return RenderResult(
            frames=frames,
            audio=audio,
            sample_rate=sample_rate,
            fps=FPS,
            request=request,
            timings=timings,
            step_cache=cache_report,
        )

    def _apply_adapters(self, kind: str, request: RenderRequest, timings: dict[str, float]) -> tuple:
        """The request's run-time adapters applied to the DiT of `kind` (none: the plain weights), the seconds it took
        in `timings["adapters"]` (part of the tables stage; disk reads of adapters the host cache had given up in
        `timings["adapter_reads"]`); returns the AdaLN tables' key for them."""
        runtime = self.runtime.get(kind)
        if runtime is None:
            if request.adapters:  # the admission refuses this; a request built by hand is told too
                raise ValueError("this engine declares no run-time adapters (H3_ADAPTERS)")
            return ()
        activation = runtime.activate(request.adapters)
        timings["adapters"] = activation.seconds
        if activation.read_seconds:
            timings["adapter_reads"] = activation.read_seconds
        return runtime.adaln_key()

    def _previews(self, request: RenderRequest, layout, ctx: RenderContext, timings: dict[str, float]):
        """The denoise loop's look at the clean estimate when the request asks for previews and someone takes them
        (`pipeline.preview`): at the forwards `preview.due` names, the first latents decoded as a PNG strip, its time
        added to `timings["previews"]` (part of the denoise stage's)."""
        every = request.preview_every
        if not every or ctx.on_preview is None:
            return None
        autocast = self.profile.vae_autocast_dtype

        def on_estimate(done: int, total: int, estimate) -> None:
            if not due(done, total, every):
                return
            with self._video_vae(True):
                preview = make_preview(self.components.video_vae, estimate(), layout, autocast, done, total)
            timings["previews"] = timings.get("previews", 0.0) + preview.seconds
            ctx.preview(preview)

        return on_estimate

    def prepare_tables(self) -> float:
        """Make the AdaLN tables of the default schedule (the engine's `Sampler`: the released 50 points and shifts,
        or a loaded adapter's trained ones) for every task the loaded DiTs serve (`variants.clock_layouts`), so that
        requests with the defaults find them made (a start-up step; other schedules are made on demand). Returns the
        seconds it took."""
        start = time.perf_counter()
        sampler = self.admission.sampler
        schedule = DualSchedule.build(sampler.steps, sampler.video_shift, sampler.audio_shift, sampler.positions)
        layouts = clock_layouts(self.rules, self.components.dit_config.patch_size)
        with self.lock:
            for kind, tables in self.tables.items():
                for layout in layouts[kind]:
                    tables.for_steps(step_timesteps(layout, schedule))
        return time.perf_counter() - start


def _check(profile: Profile, step_cache: StepCacheConfig | None) -> None:
    """What this machine and a step cache allow of the profile (`accel.profile`), before anything loads: once per
    process that loads an engine (the settings refuse the same profile earlier, naming the setting, on the command
    line's and the service's path)."""
    profiles.check(profile)
    if step_cache is not None:
        profiles.check_step_cache(profile.linear)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is KiB on Linux: the whole process's peak, not this render's alone.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
