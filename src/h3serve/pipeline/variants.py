"""The task variants as data: what a request conditions on (keyframes for t2va, i2va, l2va and fl2va; references
for Ref2VA) and the packed layout built over it. The engine runs the same stages for every task; only the
`Conditions` they produce differ."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from h3serve.model.components import Components
from h3serve.pipeline.conditioning import (
    TextConditioning,
    VideoProcessing,
    encode_keyframes,
    encode_references,
    encode_text,
    fit_keyframes,
)
from h3serve.pipeline.layout import MediaGeometry, PackedLayout, Reference, build_layout, build_ref2va_layout
from h3serve.pipeline.references import reference_descriptors
from h3serve.pipeline.request import RenderRequest
from h3serve.pipeline.rules import RequestRules, resolve_canvas
from h3serve.vocab import TASK_ANCHORS, DiTKind, Task


@dataclass(frozen=True)
class Conditions:
    """A request's conditioning, ready for the layout."""

    text: TextConditioning  # the prompt's states and token tags
    latents: object  # the clean condition latents (keyframes, or image and video references)
    audio: tuple = ()  # Ref2VA: clean audio rows of the references' soundtracks and audio references
    references: tuple[Reference, ...] | None = None  # Ref2VA: the layout's reference blocks; None: keyframes

    def layout(self, request: RenderRequest, patch_size: tuple[int, int, int]) -> PackedLayout:
        geometry = MediaGeometry.from_pixels(request.height, request.width, request.num_frames)
        if self.references is not None:
            return build_ref2va_layout(self.text.token_tags, list(self.references), geometry, patch_size=patch_size)
        return build_layout(self.text.token_tags, geometry, request.anchors, patch_size=patch_size)


def encode_prompt(
    components: Components, request: RenderRequest, video_processing: VideoProcessing
) -> tuple[TextConditioning, list[Image.Image]]:
    """The text stage: the prompt with what the task shows Qwen (the fitted keyframes, or the references); returns
    the fitted keyframes too, which the keyframe stage encodes."""
    if request.task == Task.REF2VA:
        refs = request.references
        return encode_text(
            components.text_encoder, request.prompt, references=refs, video_processing=video_processing
        ), []
    keyframes = fit_keyframes(request.keyframes, request.width, request.height)
    return encode_text(components.text_encoder, request.prompt, keyframes), keyframes


def encode_conditions(
    components: Components, request: RenderRequest, text: TextConditioning, keyframes: list[Image.Image]
) -> Conditions:
    """The keyframe stage: clean latents of what the task conditions on, and the layout's blocks for them."""
    if request.task == Task.REF2VA:
        latents = encode_references(components.video_vae, components.audio_vae, request.references)
        return Conditions(text, latents.video, latents.audio, tuple(reference_descriptors(request.references)))
    return Conditions(text, encode_keyframes(components.video_vae, keyframes))


def clock_layouts(rules: RequestRules, patch_size: tuple[int, int, int]) -> dict[DiTKind, list[PackedLayout]]:
    """A layout for each set of clocks a request can have, per DiT: a step's distinct timesteps depend only on which
    clocks a layout has, so a one-row prompt on the warmup's canvas stands in for every request (per base mode, and
    for Ref2VA without and with reference audio) when a schedule's AdaLN tables are made ahead."""
    width, height = rules.warmup_size or resolve_canvas(16, 9, rules.canvas)
    geometry = MediaGeometry.from_pixels(height, width, rules.warmup_frames or rules.frames.default_frames)
    base = [
        build_layout([1], geometry, anchors, patch_size=patch_size) for anchors in dict.fromkeys(TASK_ANCHORS.values())
    ]
    image = Reference.image(patch_size[1], patch_size[2])
    refs = [
        build_ref2va_layout([1], r, geometry, patch_size=patch_size) for r in ([image], [image, Reference.audio(1)])
    ]
    return {DiTKind.FL2VA: base, DiTKind.REF2VA: refs}
