"""What the API accepts and returns: the video request fields mapped onto the engine's request, and the job record.

Accepted fields are OpenAI's video fields (`prompt`, `model`, `seconds`, `size` as WxH, `input_reference`, `user`)
and vLLM-Omni's extensions (`width`, `height`, `num_frames`, `fps`, `num_inference_steps`, `flow_shift`, `seed`,
`aspect_ratio`, `short_edge`, `quality`, repeated `input_references`, and `extra_params` as a JSON object with
`task`, `duration`, `audio_flow_shift`, `frame_indices`, `mute_references`). Any other field is refused by name rather
than ignored: a setting the server would not honour must not look accepted. The mapped values go through the same
`validate_request` as the CLI, and every refusal names the API field. `quality` (step caching for the request:
`lossless` runs without the step cache, `high` the conservative profile) goes to the engine, which refuses `high` on a
server started without a step cache.

Files (multipart file parts, or base64 strings / data: URLs in a JSON body) mean one of two things:

* keyframes, unless `extra_params.task` is `ref2va` (as before): one or two images, first and last frame,
  placed by `extra_params.frame_indices` (t2va/i2va/l2va/fl2va, the FL2VA DiT);
* Ref2VA references, only with an explicit `extra_params.task=ref2va` (the Ref2VA DiT; the server must be started
  with H3_TASK_TYPE ref2va or both): any mix of images, videos (with or without sound) and audio files, the kind
  read from the content, at most 9 images, 3 videos, 3 audios and 12 in all, audio never alone. Their order is the
  request order, and positions count from 0: repeated `input_references` parts in the order they were sent, or a
  JSON list. A request uses one of the two names for all its references (`input_reference` repeated works too);
  mixing `input_reference` and `input_references` in a ref2va request is refused, since a JSON object (and a form
  grouped by field name) has no order between two fields. `extra_params.mute_references` lists the positions of
  video references whose soundtrack is left out; `frame_indices` does not apply to references. A refusal about one
  file names it by position as the field was sent, e.g. `input_references[2]`.
"""

from __future__ import annotations

import enum
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from h3serve.config import FPS
from h3serve.pipeline.request import RenderRequest
from h3serve.pipeline.rules import (
    MAX_REFERENCE_AUDIOS,
    MAX_REFERENCE_IMAGES,
    MAX_REFERENCE_VIDEOS,
    MAX_REFERENCES,
    MAX_SEED,
    QUALITIES,
    RequestError,
    resolve_canvas,
)
from h3serve.service.bodies import LongInt, Upload, load_json
from h3serve.service.errors import ApiError, bad_request, named, shown
from h3serve.vocab import ANCHORS, TASK_ANCHORS, ReferenceKind, Task, seconds_to_frames

FIELDS = (
    "prompt", "model", "seconds", "size", "input_reference", "input_references", "user", "width", "height",
    "num_frames", "fps", "num_inference_steps", "flow_shift", "seed", "extra_params", "aspect_ratio", "short_edge",
    "quality", "lora", "preview_every",
)  # fmt: skip
# vLLM-Omni's per-request adapter object: its name, its path on the server, its scale.
LORA_KEYS = ("name", "lora_name", "path", "local_path", "scale")
EXTRA_PARAMS = ("task", "duration", "audio_flow_shift", "frame_indices", "mute_references")
TEXT_FIELDS = ("prompt", "model", "size", "user", "aspect_ratio", "quality")  # strings, whatever the body's form
MAX_USER_CHARS = 256
# Fields other servers take that H3 has no use for: refused with the reason, not silently dropped.
NOT_USED = {
    "guidance_scale": "H3 is CFG-distilled and runs without classifier-free guidance",
    "guidance_scale_2": "H3 is CFG-distilled and runs without classifier-free guidance",
    "true_cfg_scale": "H3 is CFG-distilled and runs without classifier-free guidance",
    "negative_prompt": "H3 is CFG-distilled: there is no negative branch to condition",
    "num_outputs_per_prompt": "one video per request; send several requests",
}
ASPECT_RATIOS = {"21:9": (21, 9), "16:9": (16, 9), "4:3": (4, 3), "1:1": (1, 1), "3:4": (3, 4), "9:16": (9, 16)}
REF2VA = Task.REF2VA  # service/app.py's name for it
TASKS = tuple(Task)  # fl2va with one keyframe is i2va or l2va by frame_indices
FRAME_INDEX = {"first": 0, "last": -1}  # extra_params.frame_indices' value for each keyframe anchor
# The keyframe task of each frame_indices list (first before last): i2va [0], l2va [-1], fl2va [0, -1].
FRAME_INDEX_TASKS = {tuple(FRAME_INDEX[a] for a in anchors): task for task, anchors in TASK_ANCHORS.items() if anchors}
MAX_KEYFRAMES = 2  # first and last frame
MAX_FILES = max(MAX_KEYFRAMES, MAX_REFERENCES)  # files one request may carry (ref2va: 12 references)
MAX_SECONDS = 3600.0
CHOICES = {"aspect_ratio": tuple(ASPECT_RATIOS), "quality": QUALITIES}
SIZE = re.compile(r"^(\d{1,5})[xX](\d{1,5})$")
INTEGER = re.compile(r"\s*[+-]?\d{1,40}\s*")
NUMBER = re.compile(r"\s*[+-]?(\d{1,40}(\.\d{0,40})?|\.\d{1,40})([eE][+-]?\d{1,4})?\s*")


@dataclass(frozen=True)
class Mapped:
    """A request ready for the engine (its `quality` is the request's, echoed by the job record)."""

    request: RenderRequest
    preview_asked: bool = False  # the request set preview_every itself (not the server's default)


def _int(param: str, value: Any) -> int:
    """An integer field: a JSON integer (or an integral float), or a form's decimal string of at most 40 digits."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and INTEGER.fullmatch(value):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        value = LongInt(len(value.strip().lstrip("+-")))
    if isinstance(value, LongInt):
        raise bad_request(param, f"{param} is out of range: got {value}")
    raise bad_request(param, f"{param} must be an integer, got {shown(value)}")


def _float(param: str, value: Any) -> float:
    """A number field: a JSON number, or a form's decimal string (no NaN, no infinity)."""
    number_type = isinstance(value, int | float) and not isinstance(value, bool)
    if number_type or (isinstance(value, str) and NUMBER.fullmatch(value)):
        number = float(value)
    else:
        raise bad_request(param, f"{param} must be a finite number, got {shown(value)}")
    if not math.isfinite(number):
        raise bad_request(param, f"{param} must be a finite number, got {shown(value)}")
    return number


def _extra_params(value: Any) -> dict[str, Any]:
    if isinstance(value, str):  # a form field: the object as JSON text, read as strictly as a JSON body
        value = load_json(value, "extra_params")
    if not isinstance(value, dict):
        raise bad_request("extra_params", f"extra_params must be a JSON object, got {shown(value)}")
    for key, item in value.items():
        if key not in EXTRA_PARAMS:
            raise bad_request(
                f"extra_params.{named(key)}",
                f"extra_params.{named(key)} is not accepted; allowed: {', '.join(EXTRA_PARAMS)}",
            )
        if item is None:
            raise bad_request(f"extra_params.{key}", f"extra_params.{key} is null; leave it out for its default")
    return value


def _check_fields(fields: dict[str, Any]) -> None:
    """Every field named as accepted, present with a value (null is refused: leave a field out for its default),
    and the text fields text."""
    for name, value in fields.items():
        if name in NOT_USED:
            raise bad_request(name, f"{name} is not accepted: {NOT_USED[name]}")
        if name not in FIELDS:
            raise bad_request(named(name), f"unknown field {shown(name)}; accepted: {', '.join(FIELDS)}")
        if value is None:
            raise bad_request(name, f"{name} is null; leave the field out for its default")
        if name in TEXT_FIELDS and not isinstance(value, str):
            allowed = f" (one of {', '.join(CHOICES[name])})" if name in CHOICES else ""
            raise bad_request(name, f"{name} must be a string{allowed}, got {shown(value)}")
    user = fields.get("user")
    if user is not None and len(user) > MAX_USER_CHARS:
        raise bad_request("user", f"user is {len(user)} characters; the limit is {MAX_USER_CHARS}")


def _task_and_order(task: str | None, indices: Any, uploads: list[Upload]) -> tuple[str, list[Upload]]:
    """The engine task and the keyframes in packed order (first before last) from task, frame_indices and files;
    for ref2va, the references in request order."""
    if task is not None and task not in TASKS:
        raise bad_request("extra_params.task", f"task must be one of {', '.join(TASKS)}, got {shown(task)}")
    n = len(uploads)
    if task == REF2VA:
        if indices is not None:
            raise bad_request(
                "extra_params.frame_indices",
                "frame_indices places keyframes and does not apply to task ref2va, whose files are references",
            )
        names = list(dict.fromkeys(u.field for u in uploads))
        if len(names) > 1:
            raise bad_request(
                "input_references",
                "input_references: send all of a ref2va request's references under one field name (repeated "
                "input_references, in order), not both input_reference and input_references",
            )
        return REF2VA, list(uploads)
    if task == Task.T2VA or (task is None and n == 0):
        if n:
            raise bad_request("input_reference", f"input_reference: task t2va takes no keyframes, got {n} file(s)")
        if indices is not None:
            raise bad_request("extra_params.frame_indices", "frame_indices applies only with keyframes")
        return Task.T2VA, []
    if n == 0:
        raise bad_request("input_reference", f"task {task} needs one or two keyframe images as input_reference(s)")
    if n > MAX_KEYFRAMES:
        raise bad_request(
            "input_references",
            f"input_references: at most {MAX_KEYFRAMES} keyframes (first and last), got {n}; to send the files as "
            "Ref2VA references, set extra_params.task to ref2va",
        )
    if indices is None:
        # i2va and l2va place their one keyframe; otherwise one file is the first frame, two the first and last.
        anchors = TASK_ANCHORS[task] if task in (Task.I2VA, Task.L2VA) else ANCHORS[:n]
        indices = [FRAME_INDEX[a] for a in anchors]
    if not (isinstance(indices, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in indices)):
        raise bad_request(
            "extra_params.frame_indices", f"frame_indices must be a list of integers, got {shown(indices)}"
        )
    if len(indices) != n or len(set(indices)) != n or not set(indices) <= {0, -1}:
        raise bad_request(
            "extra_params.frame_indices",
            f"frame_indices must give one distinct index from [0, -1] per keyframe ({n} given), got "
            + (f"[{', '.join(shown(i) for i in indices)}]" if len(indices) <= 4 else shown(indices)),
        )
    ordered = [u for _, u in sorted(zip(indices, uploads, strict=True), key=lambda p: p[0] != 0)]
    resolved = FRAME_INDEX_TASKS[tuple(sorted(indices, key=lambda i: i != 0))]
    if task in (Task.I2VA, Task.L2VA) and task != resolved:
        raise bad_request("extra_params.frame_indices", f"task {task} does not match frame_indices {indices}")
    return resolved, ordered


def _mute_references(task: str, value: Any, uploads: list[Upload]) -> list[int]:
    """extra_params.mute_references: distinct positions of the request's references (the engine checks that each
    one is a video)."""
    param = "extra_params.mute_references"
    if value is None:
        return []
    if task != REF2VA:
        raise bad_request(param, f"mute_references applies only to task ref2va (its video references), not {task}")
    if not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise bad_request(param, f"mute_references must be a list of integer positions, got {shown(value)}")
    n = len(uploads)
    for i in value:
        if not 0 <= i < n:
            raise bad_request(
                param, f"mute_references: position {shown(i)} is not one of the {n} reference(s) (0..{n - 1})"
            )
    if len(set(value)) != len(value):
        twice = next(i for i in value if value.count(i) > 1)
        raise bad_request(param, f"mute_references lists position {twice} twice")
    return value


def _check_lora(value: Any, adapters) -> None:
    """vLLM-Omni's per-request `lora` ({name, path, scale}; a JSON string in a form). The adapters are merged into
    the weights at load, so a request may name only what the server merged (by its path, or its file name as `name`
    or `path`, at its scale): that is a no-op; anything else is refused, saying how to serve it."""
    if isinstance(value, str):
        value = load_json(value, "lora")
    if not isinstance(value, dict):
        raise bad_request("lora", f"lora must be a JSON object with name, path and scale, got {shown(value)}")
    for key in value:
        if key not in LORA_KEYS:
            raise bad_request(
                f"lora.{named(key)}", f"lora.{named(key)} is not accepted; allowed: {', '.join(LORA_KEYS)}"
            )
    names = [value[k] for k in ("path", "local_path", "name", "lora_name") if value.get(k) is not None]
    if not names or not all(isinstance(n, str) and n for n in names):
        raise bad_request(
            "lora", f"lora must name the adapter by path or name (a non-empty string), got {shown(value)}"
        )
    scale = _float("lora.scale", value["scale"]) if "scale" in value else None
    serve = f"adapters are merged into the weights at load: start a server with H3_LORA={named(names[0])}"
    if not adapters:
        raise bad_request("lora", f"this server runs no adapter; {serve} (--lora)")
    loaded = ", ".join(f"{a.path.name}:{a.scale:g}" for a in adapters)
    for adapter in adapters:
        if all(n in (str(adapter.path), adapter.path.name, adapter.path.stem) for n in names):
            if scale is not None and scale != adapter.scale:
                raise bad_request("lora.scale", f"lora.scale {scale:g}: the server merged {adapter.path.name} at "
                                                f"{adapter.scale:g}; {serve}:{scale:g}")  # fmt: skip
            return
    raise bad_request("lora", f"lora names {shown(names[0])}, but this server merged {loaded} and a request cannot "
                              f"switch adapters; {serve}[:SCALE]")  # fmt: skip


def _refusal(err: RequestError, names: dict[str, str], hint: str = "") -> ApiError:
    """The engine's refusal under the API's names (`names`: engine field -> API param, from the request as sent).

    One reference is the param `input_references[i]` and its message names it so, from the error's field and index
    (`RequestError.describe`); a mute_references refusal names the reference it points at the same way. Any other
    refusal is its field's param, followed by the engine's message (which names the engine's field).
    """
    param = names.get(err.field, err.field)
    if err.index is not None and err.field == "references":
        return bad_request(f"{param}[{err.index}]", err.describe(names) + hint)
    if err.index is not None and err.field == "mute_references":
        why = " (only a video reference has a soundtrack to leave out)"
        return bad_request(param, err.describe(names) + why + hint)
    return bad_request(param, f"{param}: {err}{hint}")


@dataclass(frozen=True)
class PreviewRule:
    """The server's bounds on previews: the interval a request that leaves `preview_every` out gets (H3_PREVIEW_EVERY,
    0: none) and the smallest a request may ask for (H3_PREVIEW_MIN_EVERY)."""

    default: int = 0
    minimum: int = 1


def _preview_every(fields: dict[str, Any], rule: PreviewRule, steps: int, engine) -> int | None:
    """The request's preview interval: its own (refused below the server's minimum), else the server's default where
    the request's `steps` leave a forward to preview before the last, else none (and none from a split render)."""
    if "preview_every" in fields:
        every = _int("preview_every", fields["preview_every"])
        if every and engine.num_gpus > 1:
            raise bad_request(
                "preview_every",
                f"previews come from a render in one process; this server splits each render over {engine.num_gpus} "
                "GPUs (H3_NUM_GPUS), so it makes none: send preview_every 0 or leave it out",
            )
        if 0 < every < rule.minimum:
            raise bad_request(
                "preview_every",
                f"preview_every must be 0 (none) or at least {rule.minimum} forwards on this server "
                f"(H3_PREVIEW_MIN_EVERY), got {every}",
            )
        return every
    return rule.default if 0 < rule.default <= steps - 2 and engine.num_gpus == 1 else None


def _preview_refusal(every: int, steps: int, rule: PreviewRule) -> ApiError:
    """A preview interval the request's forwards cannot hold, with the range this server takes: from its minimum
    (H3_PREVIEW_MIN_EVERY) to the last forward before the final one."""
    most = max(steps - 2, 0)  # a preview comes before the last of the steps - 1 forwards
    if most >= rule.minimum:
        allowed = f"0 (none) or {rule.minimum}..{most}"
    else:
        allowed = (
            f"0 (none): {steps} steps leave {most} forwards to preview, fewer than this server's least interval, "
            f"{rule.minimum} (H3_PREVIEW_MIN_EVERY)"
        )
    return bad_request("preview_every", f"preview_every must be {allowed} for {steps} steps, got {every}")


def map_request(
    fields: dict[str, Any],
    uploads: list[Upload],
    engine,
    served_model: str,
    max_prompt: int,
    previews: PreviewRule = PreviewRule(),
) -> Mapped:
    """Validate the API fields and build the engine's request; ApiError names the field on any refusal."""
    _check_fields(fields)
    prompt = fields.get("prompt")
    if prompt is None or not prompt.strip():
        raise bad_request("prompt", "prompt is required and must be a non-empty string")
    if len(prompt) > max_prompt:
        raise bad_request("prompt", f"prompt is {len(prompt)} characters; the limit is {max_prompt}")
    model = fields.get("model")
    if model is not None and model != served_model:
        raise ApiError(
            404,
            "model_not_found",
            f"model {shown(model)} is not served here; this server serves {shown(served_model)}",
            "model",
        )
    extra = _extra_params(fields["extra_params"]) if "extra_params" in fields else {}
    if "lora" in fields:
        _check_lora(fields["lora"], engine.adapters)

    # Canvas: size or width+height, else aspect_ratio (+ short_edge), else the model's default.
    width = _int("width", fields["width"]) if "width" in fields else None
    height = _int("height", fields["height"]) if "height" in fields else None
    size_param = "width"
    if "size" in fields:
        match = SIZE.fullmatch(fields["size"].strip())
        if not match:
            raise bad_request("size", f"size must be WIDTHxHEIGHT, e.g. 768x448, got {shown(fields['size'])}")
        sw, sh = int(match[1]), int(match[2])
        for name, given, value in (("width", width, sw), ("height", height, sh)):
            if given is not None and given != value:
                raise bad_request("size", f"size {sw}x{sh} disagrees with {name} {given}; give one or the other")
        width, height, size_param = sw, sh, "size"
    canvas = engine.rules.canvas
    aspect = fields.get("aspect_ratio")
    if aspect is not None and aspect not in ASPECT_RATIOS:
        allowed = ", ".join(ASPECT_RATIOS)
        raise bad_request("aspect_ratio", f"aspect_ratio must be one of {allowed}, got {shown(aspect)}")
    if "short_edge" in fields and (edge := _int("short_edge", fields["short_edge"])) != canvas.default_short_edge:
        raise bad_request(
            "short_edge", f"short_edge must be {canvas.default_short_edge} for this model, got {shown(edge)}"
        )
    if width is None and height is None and "aspect_ratio" in fields:
        width, height = resolve_canvas(*ASPECT_RATIOS[fields["aspect_ratio"]], canvas)
        size_param = "aspect_ratio"

    # Length: one of num_frames, seconds, extra_params.duration.
    given = [p for p in ("num_frames", "seconds", "duration") if p in (extra if p == "duration" else fields)]
    given = [("extra_params." + p if p == "duration" else p) for p in given]
    if len(given) > 1:
        raise bad_request(given[1], f"give one of num_frames, seconds, extra_params.duration; got {', '.join(given)}")
    num_frames, frames_param = None, "num_frames"
    if "num_frames" in fields:
        num_frames = _int("num_frames", fields["num_frames"])
    elif given:
        param = "seconds" if "seconds" in fields else "extra_params.duration"
        seconds = _float(param, fields["seconds"] if "seconds" in fields else extra["duration"])
        # Past an hour the frame rule would refuse it anyway; refusing here keeps seconds * FPS finite.
        if not 0 < seconds <= MAX_SECONDS:
            frames = engine.rules.frames
            allowed = f"{frames.min_frames / FPS:.2f}-{frames.max_frames / FPS:.2f} s"
            raise bad_request(param, f"{param} must be > 0 (the model takes {allowed}), got {seconds:g}")
        num_frames, frames_param = seconds_to_frames(seconds), param
    if "fps" in fields and _int("fps", fields["fps"]) != FPS:
        raise bad_request("fps", f"fps must be {FPS}, the model's frame rate, got {shown(fields['fps'])}")

    # Step caching for this request; the engine owns the rule (and refuses high without a step cache). Checked here
    # too so that a misspelt value is refused before any file is decoded.
    quality = fields.get("quality")
    if quality is not None and quality not in QUALITIES:
        raise bad_request("quality", f"quality must be one of {', '.join(QUALITIES)}, got {shown(quality)}")
    steps = fields.get("num_inference_steps")
    steps = engine.admission.sampler.steps if steps is None else _int("num_inference_steps", steps)
    preview_every = _preview_every(fields, previews, steps, engine)
    seed = _int("seed", fields["seed"]) if "seed" in fields else secrets.randbelow(2**31)
    if not 0 <= seed <= MAX_SEED:
        raise bad_request("seed", f"seed must be 0..{MAX_SEED}, got {shown(seed)}")
    task, ordered = _task_and_order(extra.get("task"), extra.get("frame_indices"), uploads)
    mute = _mute_references(task, extra.get("mute_references"), uploads)

    names = {
        "task": "extra_params.task",
        "prompt": "prompt",
        "keyframes": "input_reference",
        "width": size_param,
        "height": "height" if size_param == "width" else size_param,
        "num_frames": frames_param,
        "steps": "num_inference_steps",
        "seed": "seed",
        "video_shift": "flow_shift",
        "audio_shift": "extra_params.audio_flow_shift",
        "references": ordered[0].field if ordered else "input_references",  # the name the files were sent under
        "mute_references": "extra_params.mute_references",
    }
    if ordered and task != REF2VA:
        names["keyframes"] = ordered[0].field
    kwargs: dict[str, Any] = {
        "task": task, "width": width, "height": height, "num_frames": num_frames, "seed": seed, "quality": quality,
    }  # fmt: skip
    if preview_every is not None:
        kwargs["preview_every"] = preview_every
        names["preview_every"] = "preview_every"
    # Left out, the sampler is the server's: the released one, or its adapter's trained one (`Admission.sampler`).
    kwargs["steps"] = (
        _int("num_inference_steps", fields["num_inference_steps"]) if "num_inference_steps" in fields else None
    )
    if "flow_shift" in fields:
        kwargs["video_shift"] = _float("flow_shift", fields["flow_shift"])
    if "audio_flow_shift" in extra:
        kwargs["audio_shift"] = _float("extra_params.audio_flow_shift", extra["audio_flow_shift"])
    if task == REF2VA:
        # The file name only appears in the engine's messages: capped as every echo is.
        kwargs["references"] = [(named(u.filename) if u.filename else None, u.data) for u in ordered]
        kwargs["mute_references"] = mute
    else:
        kwargs["keyframes"] = [u.data for u in ordered]
    try:
        request = engine.validate(prompt, **kwargs)
    except RequestError as err:
        if err.field == "preview_every":  # the engine knows 1 as the least; this server's least is its minimum
            raise _preview_refusal(
                _int("preview_every", fields.get("preview_every", preview_every)), steps, previews
            ) from err
        hint = ""
        if err.field == "task" and extra.get("task") is None and ordered and REF2VA in engine.tasks:
            hint = "; to send the files as Ref2VA references instead, set extra_params.task to ref2va"
        raise _refusal(err, names, hint) from err
    return Mapped(request, preview_asked="preview_every" in fields)


def request_limits(engine, max_prompt: int, max_upload_mb: int) -> dict[str, Any]:
    """What a request to this server may be, as `/v1/models` reports it (under `limits`): the values the checks above
    and the engine's rules hold requests to, so that a client (the web page) shows them rather than guessing.

    `size.aspect_ratios` gives the canvas each `aspect_ratio` resolves to on this model; `frames` the 17n+5 grid
    (`seconds` snap up to it: `round(seconds * fps)`, then the next 17n+5); `num_inference_steps.default` the
    server's (an adapter's trained one where it has one); `quality` the step-cache choices, null without a step cache;
    `references` the Ref2VA limits per kind and in all, null on a server without the Ref2VA DiT.
    """
    rules, admission = engine.rules, engine.admission
    canvas, frames = rules.canvas, rules.frames
    sizes = {name: "x".join(map(str, resolve_canvas(*ratio, canvas))) for name, ratio in ASPECT_RATIOS.items()}
    references = None
    if REF2VA in engine.tasks:
        references = {
            ReferenceKind.IMAGE.value: MAX_REFERENCE_IMAGES,
            ReferenceKind.VIDEO.value: MAX_REFERENCE_VIDEOS,
            ReferenceKind.AUDIO.value: MAX_REFERENCE_AUDIOS,
            "total": MAX_REFERENCES,
        }
    return {
        "prompt_chars": max_prompt,
        "upload_mb": max_upload_mb,
        "size": {
            "multiple": canvas.multiple,
            "max_pixels": canvas.max_pixels,
            "min_aspect": canvas.min_aspect,
            "max_aspect": canvas.max_aspect,
            "default": sizes["16:9"],  # without keyframes; with them, the first keyframe's aspect
            "aspect_ratios": sizes,
        },
        "frames": {"min": frames.min_frames, "max": frames.max_frames, "default": frames.default_frames, "fps": FPS},
        "num_inference_steps": {"min": rules.min_steps, "max": rules.max_steps, "default": admission.sampler.steps},
        "seed": {"min": 0, "max": MAX_SEED},
        "keyframes": MAX_KEYFRAMES,
        "references": references,
        "quality": list(QUALITIES) if admission.step_cache else None,
    }


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    """A job record, with the fields of vLLM-Omni's VideoResponse (and the request's shape and seed). The job store's
    table is derived from these fields (`service.store`): a field added here is a column there, and an older store
    gains it on open."""

    id: str
    object: str = "video"
    status: JobStatus
    progress: int = 0
    model: str
    prompt: str
    size: str
    seconds: str
    quality: str | None = None
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    error: JobError | None = None
    media_type: str = "video/mp4"
    file_name: str | None = None
    inference_time_s: float | None = None
    stage_durations: dict[str, float] | None = None
    peak_memory_mb: float | None = None
    num_gpus: int | None = None  # GPUs the render was split over, set when it completes
    task: str
    num_frames: int
    num_inference_steps: int
    seed: int
    # The sampler that ran (the request's, or the server's default for what it left out: an adapter's trained one).
    flow_shift: float | None = None
    audio_flow_shift: float | None = None
    # Step caching, set when the render completes: the mode it ran with (`step_cache_mode`) and the DiT forwards
    # (0-based, in denoise order) that reused cached blocks instead of running them; [] when none were.
    step_cache: str | None = None
    cached_steps: list[int] | None = None
    # Previews: after every this many forwards (0: none); while it renders, GET .../events and .../preview.
    preview_every: int = 0


def step_cache_mode(report, quality: str | None) -> str:
    """What a render's step caching was: `off` (the server has no step cache, or quality=lossless turned it off for
    this request), `server` (the server's H3_CACHE_CONFIG profile) or `high` (quality=high: the conservative one)."""
    if report is None or not report.enabled:
        return "off"
    return "high" if quality == "high" else "server"
