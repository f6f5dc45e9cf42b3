"""What the API accepts and returns: the video request fields mapped onto the engine's request, and the job record.

Accepted fields are OpenAI's video fields (`prompt`, `model`, `seconds`, `size` as WxH, `input_reference`, `user`)
and vLLM-Omni's extensions (`width`, `height`, `num_frames`, `fps`, `num_inference_steps`, `flow_shift`, `seed`,
`aspect_ratio`, `short_edge`, `quality`, repeated `input_references`, and `extra_params` as a JSON object with
`task`, `duration`, `audio_flow_shift`, `frame_indices`, `mute_references`). Any other field is refused by name rather
than ignored: a setting the server would not honour must not look accepted. The fields are one model,
`VideoCreateRequest`, whose fields carry their API names (aliases) and bounds; `to_fields` gives the engine's typed
`RequestFields`, which go through the same `Admission.validate` as the CLI's, and every refusal names the API field.
`quality` (step caching for the request: `lossless` runs without the step cache, `high` the conservative profile) goes
to the engine, which refuses `high` on a server started without a step cache.

Adapters a request applies at run time (`H3_ADAPTERS`: declared by the operator, by name) come as vLLM-Omni's `lora`,
one object or a list of them (`name` or `lora_name`, `scale`; a JSON string in a form), or as LightX2V's top-level
`lora_name` and `lora_strength`; they become `RequestFields.adapters`, which the engine's admission checks (declared,
each once, how many at once, the DiT). A request never names a file: a `path` (`local_path`) is taken only where it is
the merged adapter's (`H3_LORA`), as is an object naming the merged adapter at its scale; both change nothing.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from h3serve.checkpoint.adapters.library import MAX_SCALE
from h3serve.config import FPS
from h3serve.errors import label
from h3serve.pipeline.admission import Admission
from h3serve.pipeline.request import RenderRequest, RequestFields
from h3serve.pipeline.rules import (
    MAX_REFERENCE_AUDIOS,
    MAX_REFERENCE_IMAGES,
    MAX_REFERENCE_VIDEOS,
    MAX_REFERENCES,
    MAX_SEED,
    QUALITIES,
    RequestError,
    RequestRules,
    resolve_canvas,
)
from h3serve.service.bodies import LongInt, Upload, load_json
from h3serve.service.errors import ApiError, bad_request, named, shown
from h3serve.vocab import ANCHORS, TASK_ANCHORS, ReferenceKind, Task, seconds_to_frames

if TYPE_CHECKING:
    from h3serve.pipeline.engine import RenderEngine

FIELDS = (
    "prompt", "model", "seconds", "size", "input_reference", "input_references", "user", "width", "height",
    "num_frames", "fps", "num_inference_steps", "flow_shift", "seed", "extra_params", "aspect_ratio", "short_edge",
    "quality", "lora", "lora_name", "lora_strength", "preview_every",
)  # fmt: skip
# vLLM-Omni's per-request adapter object: its name, its path on the server, its scale.
LORA_KEYS = ("name", "lora_name", "path", "local_path", "scale")
LORA_PATHS = ("path", "local_path")  # a file: only the merged adapter's (a no-op); nothing a client names is opened
LORA_NAMES = ("name", "lora_name")
EXTRA_PARAMS = ("task", "duration", "audio_flow_shift", "frame_indices", "mute_references")
# Strings, whatever the body's form.
TEXT_FIELDS = ("prompt", "model", "size", "user", "aspect_ratio", "quality", "lora_name")
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


@dataclass(frozen=True)
class PreviewRule:
    """The server's bounds on previews: the interval a request that leaves `preview_every` out gets (H3_PREVIEW_EVERY,
    0: none) and the smallest a request may ask for (H3_PREVIEW_MIN_EVERY)."""

    default: int = 0
    minimum: int = 1


def random_seed() -> int:
    """The seed of a request that sends none: any of the documented range, 0..MAX_SEED, alike."""
    return secrets.randbelow(MAX_SEED + 1)


@dataclass(frozen=True)
class ServerTerms:
    """What this server holds a request to beyond the model's rules (which the engine applies): the model it serves,
    its caps, what a request leaves out (grid points, previews, the seed) and what it was started with."""

    served_model: str
    max_prompt: int
    rules: RequestRules
    steps: int  # grid points of a request that leaves them out (`Admission.sampler`: an adapter's trained ones)
    admission: Admission  # the engine's: the rules about a request's shape (previews only from one process)
    tasks: tuple[str, ...]
    adapters: tuple = ()  # `checkpoint.adapters.Adapter`s merged at load
    previews: PreviewRule = PreviewRule()
    draw_seed: Callable[[], int] = random_seed

    @classmethod
    def of(
        cls, engine: RenderEngine, served_model: str, max_prompt: int, previews: PreviewRule = PreviewRule()
    ) -> ServerTerms:
        rules, steps = engine.rules, engine.admission.sampler.steps
        return cls(
            served_model, max_prompt, rules, steps, engine.admission, tuple(engine.tasks), engine.adapters, previews
        )


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


@dataclass(frozen=True)
class AdapterAsk:
    """A run-time adapter a request names (`RequestFields.adapters`): a name for the engine's admission to check
    against the declared ones, its scale (None: its declared one), and the API fields that named them, so that a
    refusal names what the client sent (`lora`, `lora[1]` or `lora_name`; `lora.scale`, `lora[1].scale` or
    `lora_strength`)."""

    param: str
    scale_param: str
    name: str
    scale: float | None


def _check_scale(param: str, scale: float) -> float:
    """A run-time adapter's scale. The engine's admission owns the rule and checks it again; it is checked here too
    because the engine's refusal names the adapter (`RequestError("adapters", index)`), not which of its fields is
    wrong, and a client is told the field it sent (`lora_strength`, `lora[1].scale`)."""
    if not 0 < abs(scale) <= MAX_SCALE:
        allowed = f"within -{MAX_SCALE:g}..{MAX_SCALE:g} and not 0 (leave the adapter out instead)"
        raise bad_request(param, f"{param} must be {allowed}, got {scale:g}")
    return scale


def _not_served(param: str, asked: str, terms: ServerTerms) -> ApiError:
    """An adapter this server cannot apply for a request: a file that is not the merged adapter's (the API opens no
    file a client names), or any adapter on a server that declares none for requests; the message says what the
    server has and how to serve the adapter."""
    catalog = terms.admission.catalog
    if catalog:  # only a file gets here: a name goes to the engine, which says what is declared
        declared = ", ".join(catalog.names)
        message = f"{param} names the file {shown(asked)}, but a request names an adapter by its declared name, never"
        return bad_request(param, f"{message} a file; declared here: {declared}")
    serve = f"adapters are merged into the weights at load: start a server with H3_LORA={named(asked)}"
    declare = f"or declare adapters that requests name with {label('adapters')}"
    if not terms.adapters:
        return bad_request(param, f"this server runs no adapter; {serve} (--lora), {declare}")
    loaded = ", ".join(f"{a.path.name}:{a.scale:g}" for a in terms.adapters)
    message = f"{param} names {shown(asked)}, but this server merged {loaded} and a request cannot switch adapters"
    return bad_request(param, f"{message}; {serve}[:SCALE], {declare}")


def _adapter_ask(
    param: str, scale_param: str, paths: list[str], names: list[str], scale: float | None, terms: ServerTerms
) -> AdapterAsk | None:
    """One adapter a request names by file (`paths`) or name (`names`, each the same), at `scale` (None: its own).
    The merged adapter (by its path, file name or stem, at its scale) changes nothing: None. Otherwise a declared
    name, for the engine to check (declared, each once, how many at once, its DiT); a file, or any adapter on a server
    that declares none, is refused here."""
    for adapter in terms.adapters:
        if all(n in (str(adapter.path), adapter.path.name, adapter.path.stem) for n in (*paths, *names)):
            if scale is not None and scale != adapter.scale:
                merged = f"the server merged {adapter.path.name} at {adapter.scale:g}"
                serve = f"start a server with H3_LORA={named([*paths, *names][0])}:{scale:g}"
                message = f"{scale_param} {scale:g}: {merged}; adapters are merged into the weights at load: {serve}"
                raise bad_request(scale_param, message)
            return None
    if paths:
        raise _not_served(param, paths[0], terms)
    if any(n != names[0] for n in names):
        raise bad_request(param, f"{param}: name {shown(names[0])} and lora_name {shown(names[1])} differ; give one")
    if not terms.admission.catalog:
        raise _not_served(param, names[0], terms)
    return AdapterAsk(param, scale_param, names[0], None if scale is None else _check_scale(scale_param, scale))


def _lora_object(param: str, value: Any, terms: ServerTerms) -> AdapterAsk | None:
    """One object of vLLM-Omni's `lora`: {name or lora_name, scale}, or the merged adapter by path."""
    if not isinstance(value, dict):
        raise bad_request(param, f"{param} must be a JSON object with name and scale, got {shown(value)}")
    for key in value:
        if key not in LORA_KEYS:
            where = f"{param}.{named(key)}"
            raise bad_request(where, f"{where} is not accepted; allowed: {', '.join(LORA_KEYS)}")
    paths = [value[k] for k in LORA_PATHS if value.get(k) is not None]
    names = [value[k] for k in LORA_NAMES if value.get(k) is not None]
    if not (paths or names) or not all(isinstance(n, str) and n for n in (*paths, *names)):
        what = f"{param} must name the adapter by path or name (a non-empty string)"
        raise bad_request(param, f"{what}, got {shown(value)}")
    scale_param = f"{param}.scale"
    scale = _float(scale_param, value["scale"]) if "scale" in value else None
    return _adapter_ask(param, scale_param, paths, names, scale, terms)


def _check_lora(value: Any, terms: ServerTerms) -> tuple[AdapterAsk, ...]:
    """vLLM-Omni's per-request `lora`: one object or a list of them (a JSON string in a form). The run-time adapters
    it names, in its order; the merged adapter's objects (no-ops) are left out."""
    if isinstance(value, str):
        value = load_json(value, "lora")
    if isinstance(value, list):
        if not value:
            raise bad_request("lora", "lora is an empty list; leave it out to apply no adapter")
        objects = [(f"lora[{i}]", item) for i, item in enumerate(value)]
    else:
        objects = [("lora", value)]
    return tuple(ask for param, item in objects if (ask := _lora_object(param, item, terms)) is not None)


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


def _out_of_bounds(param: str, error: dict[str, Any], lo: Any, hi: Any) -> ApiError:
    """A value pydantic refused against its field's declared type or bounds, in the API's words."""
    value = error.get("input")
    if error["type"] == "string_too_long":
        return bad_request(param, f"{param} is {len(value)} characters; the limit is {error['ctx']['max_length']}")
    if error["type"] in ("greater_than_equal", "less_than_equal"):
        return bad_request(param, f"{param} must be {lo}..{hi}, got {shown(value)}")
    return bad_request(param, f"{param}: {error['msg']}, got {shown(value)}")


class _ApiModel(BaseModel):
    """API fields, each named by its alias, the API's name (under `PREFIX` in a nested object). A refusal is an
    ApiError naming that field, raised where it is found: pydantic passes an exception other than ValueError through,
    so validation stops at the first refusal in field order, as a client reading one message at a time expects."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    PREFIX: ClassVar[str] = ""

    @classmethod
    def param(cls, name: str) -> str:
        """The API name of the field `name`."""
        return cls.PREFIX + (cls.model_fields[name].alias or name)

    @field_validator("*", mode="wrap")
    @classmethod
    def _declared(cls, value: Any, handler: Callable[[Any], Any], info: ValidationInfo) -> Any:
        """The field's declared type and bounds (`Field(ge=, le=, max_length=)`), refused by name."""
        try:
            return handler(value)
        except ValidationError as err:
            bounds = {type(m).__name__: m for m in cls.model_fields[info.field_name].metadata}
            lo, hi = getattr(bounds.get("Ge"), "ge", None), getattr(bounds.get("Le"), "le", None)
            raise _out_of_bounds(cls.param(info.field_name), err.errors()[0], lo, hi) from None


class ExtraParams(_ApiModel):
    """vLLM-Omni's `extra_params` object (a JSON string in a form)."""

    PREFIX: ClassVar[str] = "extra_params."

    task: Task | None = Field(None, description="t2va, i2va, l2va, fl2va or ref2va; else from the files")
    duration: float | None = Field(None, description="seconds of video; one of num_frames, seconds, duration")
    audio_shift: float | None = Field(None, alias="audio_flow_shift", description="the audio schedule's shift")
    # Checked against the files, once the task is known (`_task_and_order`, `_mute_references`).
    frame_indices: Any = Field(None, description="where each keyframe goes: 0 first, -1 last")
    mute_references: Any = Field(None, description="ref2va: positions of video references to take without sound")

    @model_validator(mode="before")
    @classmethod
    def _object(cls, value: Any) -> Any:
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

    @field_validator("task", mode="before")
    @classmethod
    def _task(cls, value: Any) -> Any:
        if value not in TASKS:
            raise bad_request("extra_params.task", f"task must be one of {', '.join(TASKS)}, got {shown(value)}")
        return value

    @field_validator("duration", mode="before")
    @classmethod
    def _duration(cls, value: Any, info: ValidationInfo) -> float:
        return _seconds(cls.param("duration"), value, info.context)

    @field_validator("audio_shift", mode="before")
    @classmethod
    def _shift(cls, value: Any) -> float:
        return _float(cls.param("audio_shift"), value)


def _seconds(param: str, value: Any, terms: ServerTerms) -> float:
    seconds = _float(param, value)
    # Past an hour the frame rule would refuse it anyway; refusing here keeps seconds * FPS finite.
    if not 0 < seconds <= MAX_SECONDS:
        frames = terms.rules.frames
        allowed = f"{frames.min_frames / FPS:.2f}-{frames.max_frames / FPS:.2f} s"
        raise bad_request(param, f"{param} must be > 0 (the model takes {allowed}), got {seconds:g}")
    return seconds


class VideoCreateRequest(_ApiModel):
    """POST /v1/videos' fields (OpenAI's and vLLM-Omni's), in the order they are checked; the files come apart
    (`service.bodies`). Validate with `parse`, under a server's `ServerTerms`; `to_fields` gives the engine's."""

    user: str | None = Field(None, max_length=MAX_USER_CHARS, description="who asks, for the operator's log")
    prompt: str = Field(None, validate_default=True, description="what to render; required")
    model: str | None = Field(None, description="the served model's id, if given")
    extra_params: ExtraParams = Field(default_factory=ExtraParams)
    lora: Any = Field(None, description="adapters by name and scale: an object, or a list of them")
    lora_name: str | None = Field(None, description="one adapter by name, instead of lora (LightX2V's)")
    lora_strength: float | None = Field(None, description="lora_name's scale; left out: its declared one")
    width: int | None = None
    height: int | None = None
    size: tuple[int, int] | None = Field(None, description="WIDTHxHEIGHT, instead of width and height")
    aspect_ratio: str | None = Field(None, description="the canvas by ratio, when no size is given")
    short_edge: int | None = Field(None, description="with aspect_ratio; only the model's own")
    num_frames: int | None = None
    seconds: float | None = Field(None, description="the length in seconds, instead of num_frames")
    fps: int | None = Field(None, description="only the model's frame rate")
    quality: str | None = Field(None, description="step caching: lossless (none) or high (conservative)")
    steps: int | None = Field(None, alias="num_inference_steps", description="grid points, the final one included")
    preview_every: int | None = Field(None, description="a preview after every this many forwards; 0: none")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="left out: drawn from the whole range")
    video_shift: float | None = Field(None, alias="flow_shift", description="the video schedule's shift")
    # The run-time adapters named by lora, or by lora_name and lora_strength (`_adapter_asks`), for the engine.
    _adapters: tuple[AdapterAsk, ...] = PrivateAttr(default=())

    @classmethod
    def parse(cls, fields: dict[str, Any], terms: ServerTerms) -> VideoCreateRequest:
        """The request's fields checked one by one; ApiError naming the first field refused."""
        return cls.model_validate(fields, context=terms)

    @model_validator(mode="before")
    @classmethod
    def _names(cls, fields: Any) -> Any:
        """Every field named as accepted, present with a value (null is refused: leave a field out for its
        default), and the text fields text."""
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
        return fields

    @field_validator("width", "height", "num_frames", "steps", "seed", mode="before")
    @classmethod
    def _integer(cls, value: Any, info: ValidationInfo) -> int:
        return _int(cls.param(info.field_name), value)

    @field_validator("video_shift", mode="before")
    @classmethod
    def _number(cls, value: Any, info: ValidationInfo) -> float:
        return _float(cls.param(info.field_name), value)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt: str | None, info: ValidationInfo) -> str:
        if prompt is None or not prompt.strip():
            raise bad_request("prompt", "prompt is required and must be a non-empty string")
        if len(prompt) > info.context.max_prompt:
            raise bad_request("prompt", f"prompt is {len(prompt)} characters; the limit is {info.context.max_prompt}")
        return prompt

    @field_validator("model")
    @classmethod
    def _model(cls, model: str, info: ValidationInfo) -> str:
        served = info.context.served_model
        if model != served:
            message = f"model {shown(model)} is not served here; this server serves {shown(served)}"
            raise ApiError(404, "model_not_found", message, "model")
        return model

    @field_validator("lora", mode="before")
    @classmethod
    def _lora(cls, value: Any, info: ValidationInfo) -> tuple[AdapterAsk, ...]:
        return _check_lora(value, info.context)

    @field_validator("lora_name", mode="before")
    @classmethod
    def _lora_name(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("lora") is not None:
            message = "lora_name and lora both name adapters; give one (lora, as a list, for several)"
            raise bad_request("lora_name", message)
        if not value.strip():
            raise bad_request("lora_name", "lora_name must name an adapter, got an empty string")
        return value

    @field_validator("lora_strength", mode="before")
    @classmethod
    def _lora_strength(cls, value: Any, info: ValidationInfo) -> float:
        if info.data.get("lora_name") is None:
            message = "lora_strength is the scale of the adapter lora_name names: give lora_name too"
            raise bad_request("lora_strength", f"{message} (or lora, with its scale)")
        return _float("lora_strength", value)

    @model_validator(mode="after")
    def _adapter_asks(self, info: ValidationInfo) -> VideoCreateRequest:
        """The run-time adapters the request names, from `lora` or from `lora_name` and `lora_strength`."""
        if self.lora_name is not None:
            ask = _adapter_ask("lora_name", "lora_strength", [], [self.lora_name], self.lora_strength, info.context)
            self._adapters = () if ask is None else (ask,)
        elif self.lora is not None:
            self._adapters = self.lora
        return self

    @field_validator("size", mode="before")
    @classmethod
    def _size(cls, value: str, info: ValidationInfo) -> tuple[int, int]:
        match = SIZE.fullmatch(value.strip())
        if not match:
            raise bad_request("size", f"size must be WIDTHxHEIGHT, e.g. 768x448, got {shown(value)}")
        sw, sh = int(match[1]), int(match[2])
        for name, side in (("width", sw), ("height", sh)):
            given = info.data.get(name)
            if given is not None and given != side:
                raise bad_request("size", f"size {sw}x{sh} disagrees with {name} {given}; give one or the other")
        return sw, sh

    @field_validator("aspect_ratio", "quality")
    @classmethod
    def _choice(cls, value: str, info: ValidationInfo) -> str:
        # quality: the engine owns the rule (and refuses high without a step cache); checked here too so that a
        # misspelt value is refused before any file is decoded.
        if value not in CHOICES[info.field_name]:
            allowed = ", ".join(CHOICES[info.field_name])
            raise bad_request(info.field_name, f"{info.field_name} must be one of {allowed}, got {shown(value)}")
        return value

    @field_validator("short_edge", mode="before")
    @classmethod
    def _short_edge(cls, value: Any, info: ValidationInfo) -> int:
        edge, wanted = _int("short_edge", value), info.context.rules.canvas.default_short_edge
        if edge != wanted:
            raise bad_request("short_edge", f"short_edge must be {wanted} for this model, got {shown(edge)}")
        return edge

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds(cls, value: Any, info: ValidationInfo) -> float:
        return _seconds("seconds", value, info.context)

    @field_validator("fps", mode="before")
    @classmethod
    def _fps(cls, value: Any) -> int:
        if _int("fps", value) != FPS:
            raise bad_request("fps", f"fps must be {FPS}, the model's frame rate, got {shown(value)}")
        return FPS

    @field_validator("preview_every", mode="before")
    @classmethod
    def _preview_every(cls, value: Any, info: ValidationInfo) -> int:
        every, terms = _int("preview_every", value), info.context
        try:
            terms.admission.check_previews(every)
        except RequestError as err:
            raise bad_request("preview_every", err.message) from None
        if 0 < every < terms.previews.minimum:
            raise bad_request(
                "preview_every",
                f"preview_every must be 0 (none) or at least {terms.previews.minimum} forwards on this server "
                f"(H3_PREVIEW_MIN_EVERY), got {every}",
            )
        return every

    def _canvas_source(self) -> str:
        """The field that sets the canvas: size, else width and height, else aspect_ratio (else the model's
        default, which width names)."""
        if self.size is not None:
            return "size"
        if self.width is None and self.height is None and self.aspect_ratio is not None:
            return "aspect_ratio"
        return "width"

    def _length_source(self) -> str:
        """The one field that sets the length, of num_frames, seconds and extra_params.duration (else the model's
        default, which num_frames names)."""
        given = [p for p in ("num_frames", "seconds") if p in self.model_fields_set]
        given += ["extra_params.duration"] if self.extra_params.duration is not None else []
        if len(given) > 1:
            raise bad_request(
                given[1], f"give one of num_frames, seconds, extra_params.duration; got {', '.join(given)}"
            )
        return given[0] if given else "num_frames"

    def _num_frames(self) -> int | None:
        source = self._length_source()
        if source == "num_frames":
            return self.num_frames
        return seconds_to_frames(self.seconds if source == "seconds" else self.extra_params.duration)

    def _canvas(self, terms: ServerTerms) -> tuple[int | None, int | None]:
        source = self._canvas_source()
        if source == "size":
            return self.size
        if source == "aspect_ratio":
            return resolve_canvas(*ASPECT_RATIOS[self.aspect_ratio], terms.rules.canvas)
        return self.width, self.height

    def _steps(self, terms: ServerTerms) -> int:
        return terms.steps if self.steps is None else self.steps

    def _previews(self, terms: ServerTerms) -> int | None:
        """The request's preview interval, else the server's default where the request's grid points leave a
        forward to preview before the last, else none (and none from a split render)."""
        if self.preview_every is not None:
            return self.preview_every
        rule = terms.previews
        return rule.default if 0 < rule.default <= self._steps(terms) - 2 and terms.admission.previews else None

    def to_fields(self, uploads: list[Upload], terms: ServerTerms) -> RequestFields:
        """The engine's fields: the canvas and length from whichever field set them, the files as keyframes in
        packed order or as references, a seed drawn where none was sent. What the request leaves out of its
        sampler stays None: the server's sampler fills it (`Admission.sampler`)."""
        width, height = self._canvas(terms)
        num_frames = self._num_frames()
        seed = terms.draw_seed() if self.seed is None else self.seed
        task, ordered = _task_and_order(self.extra_params.task, self.extra_params.frame_indices, uploads)
        mute = _mute_references(task, self.extra_params.mute_references, uploads)
        if task == REF2VA:
            # The file name only appears in the engine's messages: capped as every echo is.
            files = {"references": [(named(u.filename) if u.filename else None, u.data) for u in ordered]}
        else:
            files = {"keyframes": [u.data for u in ordered]}
        return RequestFields(
            prompt=self.prompt, task=task, width=width, height=height, num_frames=num_frames, steps=self.steps,
            seed=seed, video_shift=self.video_shift, audio_shift=self.extra_params.audio_shift, mute_references=mute,
            quality=self.quality, preview_every=self._previews(terms),
            adapters=tuple((a.name, a.scale) for a in self._adapters), **files,
        )  # fmt: skip

    def api_name(self, field: str, files: str) -> str:
        """The API field that set the engine's `field`: the canvas and the length by what the request sent, the
        files by the name they were sent under (`files`), any other by its declared alias."""
        if field in ("width", "height"):
            source = self._canvas_source()
            return field if source == "width" else source
        if field == "num_frames":
            return self._length_source()
        if field in ("keyframes", "references"):
            return files
        if field == "adapters":
            return "lora_name" if self.lora_name is not None else "lora"
        for model in (type(self), ExtraParams):
            if field in model.model_fields:
                return model.param(field)
        return field  # the engine's own (an adapter's sigma positions)

    def refusal(self, err: RequestError, uploads: list[Upload], terms: ServerTerms) -> ApiError:
        """The engine's refusal under the API's names. One file is named by its position as the field was sent,
        e.g. `input_references[2]`, from the error's index (`RequestError.describe`); a mute_references refusal names
        the reference it points at the same way. Any other refusal is its field's, followed by the engine's message
        (which names the engine's field)."""
        if err.field == "preview_every":  # the engine knows 1 as the least; this server's least is its minimum
            return _preview_refusal(self._previews(terms), self._steps(terms), terms.previews)
        if err.field == "adapters":  # one adapter (`lora[1]`, `lora_name`) by its index, else the field that named them
            param = self.api_name("adapters", "") if err.index is None else self._adapters[err.index].param
            return bad_request(param, f"{param}: {err.message}")
        _, ordered = _task_and_order(self.extra_params.task, self.extra_params.frame_indices, uploads)
        default = "input_references" if err.of == "references" else "input_reference"
        files = ordered[0].field if ordered else default
        hint = ""
        if err.field == "task" and self.extra_params.task is None and ordered and REF2VA in terms.tasks:
            hint = "; to send the files as Ref2VA references instead, set extra_params.task to ref2va"
        param = self.api_name(err.field, files)
        names = {err.of: self.api_name(err.of, files), err.field: param}
        if err.index is not None and err.field == "references":
            return bad_request(f"{param}[{err.index}]", err.describe(names) + hint)
        if err.index is not None and err.field == "mute_references":
            why = " (only a video reference has a soundtrack to leave out)"
            return bad_request(param, err.describe(names) + why + hint)
        return bad_request(param, f"{param}: {err}{hint}")


def admit(
    fields: dict[str, Any], uploads: list[Upload], engine: RenderEngine, terms: ServerTerms
) -> tuple[VideoCreateRequest, RenderRequest]:
    """A request as sent, checked by the API's rules and then the engine's; ApiError names the field on any
    refusal. The model comes back with the engine's request: it knows what the client itself set."""
    asked = VideoCreateRequest.parse(fields, terms)
    try:
        return asked, engine.validate(asked.to_fields(uploads, terms))
    except RequestError as err:
        raise asked.refusal(err, uploads, terms) from err


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
    # The run-time adapters the render applies, each {"name", "scale"} in the request's order; [] for none.
    adapters: list[dict[str, Any]] = Field(default_factory=list)


def step_cache_mode(report, quality: str | None) -> str:
    """What a render's step caching was: `off` (the server has no step cache, or quality=lossless turned it off for
    this request), `server` (the server's H3_CACHE_CONFIG profile) or `high` (quality=high: the conservative one)."""
    if report is None or not report.enabled:
        return "off"
    return "high" if quality == "high" else "server"


def adapter_uses(request: RenderRequest) -> list[dict[str, Any]]:
    """A job record's `adapters`: the run-time adapters the validated request applies, with the scales that run."""
    return [{"name": name, "scale": scale} for name, scale in request.adapters]
