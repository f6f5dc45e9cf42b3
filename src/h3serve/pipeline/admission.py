"""What a loaded engine accepts beyond the model's rules: the tasks whose DiT it loaded (and its adapters were trained
for), a step-cache quality only with a step cache, and a Ref2VA request only as large as the memory plan covers.
Every refusal is a RequestError naming its field, raised before anything is encoded. What a request leaves out of
its sampler (grid points, shifts) comes from the engine's `Sampler`: the released one, or the trained one of a loaded
few-step adapter."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from h3serve.checkpoint.adapters.library import MAX_SCALE, Catalog
from h3serve.config import AUDIO_SHIFT, CLIP_FRAMES, DEFAULT_STEPS, VIDEO_SHIFT, DiTConfig
from h3serve.errors import SettingError, env_name, label, shown
from h3serve.pipeline.budget import PLANNED_TEXT_ROWS, largest_request_rows
from h3serve.pipeline.layout import MediaGeometry, build_layout, build_ref2va_layout
from h3serve.pipeline.references import reference_descriptors
from h3serve.pipeline.request import RenderRequest, RequestFields, validate_request
from h3serve.pipeline.rules import RequestError, RequestRules
from h3serve.vocab import TASK_ANCHORS, TASK_TYPES, Task, dit_kind

REF2VA = Task.REF2VA
SAMPLER_FIELDS = ("steps", "video_shift", "audio_shift")


@dataclass(frozen=True)
class Sampler:
    """The sampler of a request that does not set it: the released one, or a few-step adapter's trained one
    (`positions`: its own unshifted sigma grid, used when the request leaves the grid points out)."""

    steps: int = DEFAULT_STEPS
    video_shift: float = VIDEO_SHIFT
    audio_shift: float = AUDIO_SHIFT
    positions: tuple[float, ...] | None = None
    source: str = "released"  # where it comes from: the released sampler or an adapter's file name

    @classmethod
    def for_adapters(cls, adapters) -> Sampler:
        """The first adapter's preset (`checkpoint.adapters.Preset`) that says something, its unknown fields the
        released values; the released sampler without one."""
        for adapter in adapters:
            preset = adapter.preset
            if preset is None:
                continue
            return cls(
                steps=preset.points if preset.points is not None else DEFAULT_STEPS,
                video_shift=preset.video_shift if preset.video_shift is not None else VIDEO_SHIFT,
                audio_shift=preset.audio_shift if preset.audio_shift is not None else AUDIO_SHIFT,
                positions=tuple(preset.sigmas) if preset.sigmas else None,
                source=adapter.path.name,
            )
        return cls()

    def fill(self, fields: RequestFields) -> RequestFields:
        """`fields` with what they leave out of the sampler taken from here."""
        left_out = {name: getattr(self, name) for name in SAMPLER_FIELDS if getattr(fields, name) is None}
        return dataclasses.replace(fields, **left_out)

    def positions_for(self, fields: RequestFields) -> tuple[float, ...] | None:
        """The sigma positions of the request's grid: this sampler's own only where the request leaves the grid
        points out (a request that names its steps gets an even grid)."""
        return self.positions if fields.steps is None else None

    def describe(self) -> str:
        grid = f"sigma positions {list(self.positions)}" if self.positions else f"{self.steps} grid points"
        return f"{grid}, shifts {self.video_shift:g}/{self.audio_shift:g} ({self.source})"


def check_adapter_kinds(adapters, task_type: str) -> None:
    """SettingError("lora") for adapters the loaded DiTs cannot take: one DiT per server with adapters (an FL2VA
    adapter must not reach the Ref2VA DiT, nor the reverse), and an adapter trained for the other DiT."""
    if not adapters:
        return
    if task_type == "both":
        raise SettingError(
            "lora",
            "adapters are merged into one DiT; with task type both, which one is ambiguous. Start with "
            f"{label('task_type')} fl2va or ref2va",
        )
    for adapter in adapters:
        kind = adapter.preset.dit_kind if adapter.preset is not None else None
        if kind is not None and kind != task_type:
            raise SettingError(
                "lora",
                f"{adapter.path}: an adapter for the {kind} DiT, but this server loads the {task_type} DiT "
                f"({label('task_type')})",
            )


def check_declared_kinds(catalog: Catalog, task_type: str) -> None:
    """SettingError("adapters") for a declared run-time adapter trained for a DiT this server does not load."""
    kinds = TASK_TYPES[task_type]
    for entry in catalog.entries.values():
        if entry.dit_kind is not None and entry.dit_kind not in kinds:
            raise SettingError(
                "adapters",
                f"{entry.name} ({entry.path}): an adapter for the {entry.dit_kind} DiT, but this server loads "
                f"{' and '.join(kinds)} ({label('task_type')} {task_type})",
            )


def trained_tasks(adapters) -> tuple[str, ...] | None:
    """The only tasks the adapters were distilled for (the first preset that restricts them), or None: any."""
    return next((tuple(a.preset.tasks) for a in adapters if a.preset is not None and a.preset.tasks), None)


@dataclass(frozen=True)
class Admission:
    tasks: tuple[str, ...]  # the tasks this engine serves
    task_type: str  # fl2va, ref2va or both: which DiTs were loaded
    rules: RequestRules
    dit_config: DiTConfig
    step_cache: bool  # whether a step cache is attached (quality=high needs one)
    sampler: Sampler = Sampler()
    trained_tasks: tuple[str, ...] | None = None  # the only tasks the loaded adapters were trained for (None: any)
    max_rows: int | None = None  # packed rows the device memory admits (`pipeline.placement`; None: the rules')
    ranks: int = 1  # processes one render runs on (H3_NUM_GPUS x H3_NNODES): a split render's shape rules below
    # The adapters a request may apply at run time (H3_ADAPTERS).
    catalog: Catalog = dataclasses.field(default_factory=Catalog)
    merged: tuple = ()  # the merged adapters (H3_LORA), their deltas dropped: their presets come first

    @classmethod
    def build(
        cls,
        task_type: str,
        rules: RequestRules,
        dit_config: DiTConfig,
        step_cache: bool,
        adapters: Sequence = (),
        max_rows: int | None = None,
        ranks: int = 1,
        catalog: Catalog | None = None,
    ) -> Admission:
        """What an engine that loads the DiTs of `task_type` (with `adapters` merged, `catalog` declared for run
        time, and a step cache or not) accepts: the one constructor, used by the engine and by the start-up plan
        before any weight loads."""
        kinds = TASK_TYPES[task_type]
        return cls(
            tasks=tuple(t for t in Task if dit_kind(t) in kinds),
            task_type=task_type,
            rules=rules,
            dit_config=dit_config,
            step_cache=step_cache,
            sampler=Sampler.for_adapters(adapters),
            trained_tasks=trained_tasks(adapters),
            max_rows=max_rows,
            ranks=ranks,
            catalog=catalog if catalog is not None else Catalog(),
            merged=tuple(dataclasses.replace(a, deltas=()) for a in adapters),
        )

    @property
    def previews(self) -> bool:
        """Whether a render can make previews: the clean estimate is decoded in the one process that holds every row;
        a split render's rows are spread over its ranks."""
        return self.ranks == 1

    @property
    def frames_stream(self) -> bool:
        """Whether the decode hands its frames to the encoder window by window: in one process; a split render's
        frames reach the parent whole, when the render ends (`parallel.workers.ParallelEngine`)."""
        return self.ranks == 1

    def check_previews(self, every: int | None) -> None:
        """RequestError("preview_every") for previews asked of a split render (`previews`)."""
        if every and not self.previews:
            raise RequestError(
                "preview_every",
                f"previews come from a render in one process, and each render here is split over {self.ranks} GPUs "
                f"({env_name('num_gpus')}), so it makes none: ask for none (preview_every 0)",
            )

    def check_task(self, task: str) -> None:
        """RequestError("task") for a task whose DiT this engine did not load, saying how to start one that does."""
        if task in self.tasks or (task not in TASK_ANCHORS and task != REF2VA):
            return  # served, or unknown (validate_request names the tasks)
        needed = (
            "the Ref2VA DiT (task type ref2va or both)" if task == REF2VA else "the FL2VA DiT (task type fl2va or both)"
        )
        raise RequestError(
            "task",
            f"task {task} needs {needed}, but this server was started with task type {self.task_type} "
            f"and serves only {', '.join(self.tasks)}; restart it with {label('task_type')} set to include it",
        )

    def check_trained_task(self, task: str, chosen: Sequence[tuple[str, float]] = ()) -> None:
        """RequestError("task") for a task the merged adapters were not trained for (FastH3, FlashGen: T2VA only),
        and RequestError("adapters") for one a chosen run-time adapter was not."""
        if task not in tuple(Task):
            return
        if self.trained_tasks is not None and task not in self.trained_tasks:
            raise RequestError(
                "task",
                f"task {task}: this server's adapter was trained for {', '.join(self.trained_tasks)} only "
                f"({self.sampler.source}); send one of those, or start the server without it",
            )
        for index, (name, _) in enumerate(chosen):
            tasks = trained_tasks([self.catalog.entries[name].adapter])
            if tasks is not None and task not in tasks:
                raise RequestError(
                    "adapters",
                    f"{name} was trained for {', '.join(tasks)} only; task {task} cannot use it",
                    index,
                )

    def check_adapters(self, task: str, asked: Sequence[tuple[str, float | None]]) -> tuple[tuple[str, float], ...]:
        """The run-time adapters a request names, each with its scale (its declared one where the request gives
        none), checked: declared here (by name: a request never names a file), each once, at most `max_active`, a
        scale that is a finite number with 0 < |scale| <= MAX_SCALE, and trained for the DiT the task runs.
        RequestError("adapters", index) naming what is wrong and what is allowed."""
        if not asked:
            return ()
        declared = ", ".join(self.catalog.names)
        if not self.catalog:
            raise RequestError("adapters", "adapters: this server declares none to apply per request (an operator "
                               f"declares them with {label('adapters')}, by name)")  # fmt: skip
        if len(asked) > self.catalog.max_active:
            raise RequestError("adapters", f"adapters: at most {self.catalog.max_active} at once on this server "
                               f"({label('adapter_max_active')}), got {len(asked)}")  # fmt: skip
        chosen: list[tuple[str, float]] = []
        for index, item in enumerate(asked):
            name, scale = item
            entry = self.catalog.entries.get(name) if isinstance(name, str) else None
            if entry is None:
                raise RequestError("adapters", f"{shown(name)} is not declared here; declared: {declared}",
                                   index)  # fmt: skip
            if any(name == n for n, _ in chosen):
                raise RequestError("adapters", f"{name} is named twice; name each once", index)
            if scale is None:
                scale = entry.scale
            elif isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
                raise RequestError("adapters", f"{name}'s scale must be a finite number, got {scale!r}", index)
            elif not 0 < abs(scale) <= MAX_SCALE:
                raise RequestError("adapters", f"{name}'s scale must be within -{MAX_SCALE:g}..{MAX_SCALE:g} "
                                   f"and not 0 (leave the adapter out instead), got {scale:g}", index)  # fmt: skip
            kind = dit_kind(task) if task in tuple(Task) else None
            if entry.dit_kind is not None and kind is not None and entry.dit_kind != kind:
                raise RequestError("adapters", f"{name} was trained on the {entry.dit_kind} DiT; task {task} "
                                   f"runs the {kind} DiT", index)  # fmt: skip
            chosen.append((name, float(scale)))
        return tuple(chosen)

    def sampler_for(self, chosen: Sequence[tuple[str, float]]) -> Sampler:
        """The sampler of a request applying `chosen`: the merged adapters' preset first, then the chosen ones' in
        the request's order, else the released one."""
        if not chosen:
            return self.sampler
        return Sampler.for_adapters([*self.merged, *(self.catalog.entries[n].adapter for n, _ in chosen)])

    def check_quality(self, quality: str | None) -> None:
        """RequestError("quality") for quality=high on an engine without a step cache: the operator chose full
        compute, and a lossy render is never something a request turns on by itself."""
        if quality == "high" and not self.step_cache:
            raise RequestError(
                "quality",
                "quality high runs the conservative step-cache profile, but this server runs without step caching "
                "(H3_CACHE_BACKEND=none); leave quality out or send lossless, or start the server with "
                "H3_CACHE_BACKEND=cache_dit",
            )

    def media_rows(self, task: str, width: int, height: int, num_frames: int) -> int:
        """Packed rows of a base-mode request's video and audio (its prompt's rows apart)."""
        geometry = MediaGeometry.from_pixels(height, width, num_frames)
        layout = build_layout([], geometry, TASK_ANCHORS[task], patch_size=self.dit_config.patch_size)
        return int(layout.token_tags.numel())

    def check_memory(self, request: RenderRequest) -> None:
        """RequestError("num_frames") for a base-mode request larger than the device memory admits
        (`pipeline.placement`: on a GPU that holds less than the largest request the rules allow), naming the limit
        and the most frames that fit at the request's size."""
        if self.max_rows is None or request.task == REF2VA:
            return  # Ref2VA: `check_rows`, against the same limit
        limit = self.max_rows - PLANNED_TEXT_ROWS
        rows = self.media_rows(request.task, request.width, request.height, request.num_frames)
        if rows <= limit:
            return
        frames = range(self.rules.frames.min_frames, request.num_frames, CLIP_FRAMES)  # the 17n+5 grid below it
        fitting = [n for n in frames if self.media_rows(request.task, request.width, request.height, n) <= limit]
        fits = (
            f"at {request.width}x{request.height} up to {max(fitting)} frames fit"
            if fitting
            else f"no frame count fits at {request.width}x{request.height}; use a smaller size"
        )
        raise RequestError(
            "num_frames",
            f"num_frames: {request.num_frames} frames at {request.width}x{request.height} pack {rows:,} rows of video "
            f"and audio; this server's device memory admits {limit:,} (frames x size, its prompt's "
            f"{PLANNED_TEXT_ROWS:,} rows apart: H3_DEVICE_MEMORY_GIB or the GPU's free memory, `h3serve check "
            f"--preflight`); {fits}",
        )

    def check_rows(self, request: RenderRequest) -> None:
        """RequestError("references") for a Ref2VA request that packs more rows than the memory plan covers.

        The plan (`pipeline.budget`: `h3serve check --preflight`, the start's gate) is made for the largest base-mode
        request the rules allow. A Ref2VA request can be far larger (each reference image at a 2048 short edge is up
        to 16,384 rows), so it is held to the same count, its prompt's rows excluded as the plan allows them: a
        request that fits the plan is never one the GPU cannot hold.
        """
        if request.task != REF2VA:
            return
        geometry = MediaGeometry.from_pixels(request.height, request.width, request.num_frames)
        blocks = reference_descriptors(request.references)
        layout = build_ref2va_layout([], blocks, geometry, patch_size=self.dit_config.patch_size)  # no prompt rows
        references = layout.num_reference_video_rows + layout.num_reference_audio_rows
        target = layout.num_video_rows + layout.num_audio_rows
        limit = self.row_limit
        if references + target > limit:
            raise RequestError(
                "references",
                f"references: this request packs {references} reference rows and {target} rows of its own video "
                f"and audio, {references + target} in all; the server's memory plan covers {limit} (the largest "
                f"keyframe request, {self.rules.frames.max_frames} frames of 16:9). Use fewer or smaller reference "
                "images or videos, or fewer frames",
            )

    @functools.cached_property
    def row_limit(self) -> int:
        """Reference and target rows the memory plan covers: its largest request's rows less the prompt's allowance
        (made once: that layout has over a hundred thousand rows)."""
        largest = largest_request_rows(self.dit_config, self.rules)
        return (largest if self.max_rows is None else min(largest, self.max_rows)) - PLANNED_TEXT_ROWS

    def validate(self, fields: RequestFields) -> RenderRequest:
        """`validate_request` under this engine's rules and sampler, for a served task. The engine's own checks come
        first, so a request for a task not served is told so before its files are decoded."""
        self.check_task(fields.task)
        chosen = self.check_adapters(fields.task, fields.adapters)
        self.check_trained_task(fields.task, chosen)
        self.check_quality(fields.quality)
        self.check_previews(fields.preview_every)
        sampler = self.sampler_for(chosen)
        request = validate_request(sampler.fill(fields), self.rules, sampler.positions_for(fields))
        self.check_memory(request)
        self.check_rows(request)
        return dataclasses.replace(request, adapters=chosen)
