"""What a loaded engine accepts beyond the model's rules: the tasks whose DiT it loaded, a step-cache quality only
with a step cache, and a Ref2VA request only as large as the memory plan covers. Every refusal is a RequestError
naming its field, raised before anything is encoded."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from h3serve.config import DiTConfig
from h3serve.pipeline.budget import PLANNED_TEXT_ROWS, largest_request_rows
from h3serve.pipeline.layout import MediaGeometry, build_ref2va_layout
from h3serve.pipeline.references import reference_descriptors
from h3serve.pipeline.request import RenderRequest, validate_request
from h3serve.pipeline.rules import RequestError, RequestRules
from h3serve.vocab import TASK_ANCHORS, Task

REF2VA = Task.REF2VA


@dataclass(frozen=True)
class Admission:
    tasks: tuple[str, ...]  # the tasks this engine serves
    task_type: str  # fl2va, ref2va or both: which DiTs were loaded
    rules: RequestRules
    dit_config: DiTConfig
    step_cache: bool  # whether a step cache is attached (quality=high needs one)

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
            f"and serves only {', '.join(self.tasks)}; restart it with H3_TASK_TYPE (--task-type) set to include it",
        )

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
        return largest_request_rows(self.dit_config, self.rules) - PLANNED_TEXT_ROWS

    def validate(self, prompt: str, **fields: Any) -> RenderRequest:
        """`validate_request(prompt, **fields)` under this engine's rules, for a served task (its keywords: task,
        width, height, num_frames, steps, seed, video_shift, audio_shift, keyframes, references, mute_references,
        quality). The engine's own checks come first, so a request for a task not served is told so before its
        files are decoded."""
        self.check_task(fields.get("task", Task.T2VA))
        self.check_quality(fields.get("quality"))
        request = validate_request(prompt, rules=self.rules, **fields)
        self.check_rows(request)
        return request
