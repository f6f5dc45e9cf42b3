"""`h3serve accept URL`: the seed's two-render acceptance against a running server.

1. `GET /health` answers and reports ready; `GET /v1/models` lists exactly the expected model id.
2. The fixed request (seed 42, 768x448, duration 2.0 s -> 56 frames, 20 steps unless told otherwise) is rendered
   twice through `POST /v1/videos/sync`. A value not given is the smoke request's where the server's limits
   (`/v1/models`) admit it, else the server's default (the tiny model's canvas is 224x128). Each body is written
   to `NAME.part`; a non-2xx answer is kept as `NAME.error.json` and fails; a body that is not the contract's MP4
   (H.264 yuv420p of the right size and frame count at 24 fps, AAC-LC stereo at 32 kHz) is kept as `NAME.invalid`
   and fails; otherwise it becomes `NAME.mp4`.
   A refusal's reason (the API's `error.message`) is in the check's detail, so the console shows it.
3. The two renders' decoded frames must be byte-identical and their audio must match by PSNR (identical PCM is
   infinite PSNR).

A JSON report records every check, the render times (client and engine), file hashes and the verdict; the command
exits 0 only if every check passed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from h3serve.config import AUDIO_SHIFT, FPS, SAMPLE_RATE, VIDEO_SHIFT
from h3serve.media.mp4 import audio_psnr, decode_audio, decode_frames, frame_hashes, verify_mp4
from h3serve.vocab import SMOKE_REQUEST, Task, seconds_to_frames, snap_up

ACCEPT_PROMPT = SMOKE_REQUEST.prompt
SMOKE_STEPS = 20


@dataclass
class AcceptPlan:
    """What to ask for. `width`, `height`, `duration` and `steps` left None are chosen from the server's limits
    (`fit_request`): the smoke request's where they admit it, else the server's defaults."""

    url: str
    out_dir: Path
    key: str | None = None
    expect_model: str | None = None
    prompt: str = ACCEPT_PROMPT
    width: int | None = None
    height: int | None = None
    duration: float | None = None
    steps: int | None = None
    seed: int = 42
    min_audio_psnr: float = math.inf
    timeout: float = 7200.0
    wait_ready: float = 0.0  # seconds to wait for /health to report ready

    @property
    def num_frames(self) -> int:
        return snap_up(seconds_to_frames(self.duration if self.duration is not None else SMOKE_REQUEST.seconds))

    def form(self) -> dict[str, str]:
        """The seed's smoke request, field for field; a value left None is the smoke request's (`fit_request` without
        a server's limits), never the text "None"."""
        plan = fit_request(self, None)[0]
        extra = {"task": Task.T2VA, "duration": plan.duration, "audio_flow_shift": AUDIO_SHIFT}
        return {
            "prompt": plan.prompt,
            "width": str(plan.width),
            "height": str(plan.height),
            "fps": str(FPS),
            "num_inference_steps": str(plan.steps),
            "flow_shift": f"{VIDEO_SHIFT:g}",
            "seed": str(plan.seed),
            "extra_params": json.dumps(extra),
        }

    def parts(self) -> dict[str, tuple[None, str]]:
        """The form as multipart/form-data text parts (what `curl -F` sends; the server takes no urlencoded form)."""
        return {name: (None, value) for name, value in self.form().items()}


@dataclass
class Report:
    checks: list[dict[str, Any]] = field(default_factory=list)
    renders: list[dict[str, Any]] = field(default_factory=list)
    comparison: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, passed: bool, detail: Any = None) -> bool:
        self.checks.append({"check": name, "passed": bool(passed), "detail": detail})
        return passed

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c["passed"] for c in self.checks)


def fit_request(plan: AcceptPlan, limits: dict[str, Any] | None) -> tuple[AcceptPlan, list[str]]:
    """The plan with each value left None chosen: the smoke request's (768x448, 2.0 s, 20 steps) where the server's
    `limits` (its /v1/models entry's) admit it, else the server's default; without limits, the smoke request's.
    Returns the plan and a note for each value that is not the smoke request's."""
    limits = limits if isinstance(limits, dict) else {}
    notes: list[str] = []
    width, height, duration, steps = plan.width, plan.height, plan.duration, plan.steps
    if width is None and height is None:
        width, height = SMOKE_REQUEST.width, SMOKE_REQUEST.height
        size = limits.get("size")
        if isinstance(size, dict) and not _size_fits(width, height, size) and _size(size.get("default")):
            width, height = _size(size["default"])
            notes.append(f"size {width}x{height}: the server's default (768x448 is beyond its limits)")
    width = SMOKE_REQUEST.width if width is None else width
    height = SMOKE_REQUEST.height if height is None else height
    if duration is None:
        duration, frames = SMOKE_REQUEST.seconds, limits.get("frames")
        wanted = snap_up(seconds_to_frames(duration))
        if isinstance(frames, dict) and not _within(wanted, frames) and isinstance(frames.get("default"), int):
            duration = frames["default"] / FPS
            notes.append(f"{frames['default']} frames: the server's default ({wanted} is beyond its limits)")
    if steps is None:
        steps, bounds = SMOKE_STEPS, limits.get("num_inference_steps")
        if isinstance(bounds, dict) and not _within(steps, bounds) and isinstance(bounds.get("default"), int):
            steps = bounds["default"]
            notes.append(f"{steps} steps: the server's default ({SMOKE_STEPS} is beyond its limits)")
    return dataclasses.replace(plan, width=width, height=height, duration=duration, steps=steps), notes


def _size(text: Any) -> tuple[int, int] | None:
    """`"224x128"` -> (224, 128), or None."""
    w, x, h = str(text).partition("x")
    return (int(w), int(h)) if x and w.isascii() and w.isdigit() and h.isascii() and h.isdigit() else None


def _size_fits(width: int, height: int, size: dict[str, Any]) -> bool:
    try:
        multiple, max_pixels = int(size["multiple"]), int(size["max_pixels"])
        low, high = float(size["min_aspect"]), float(size["max_aspect"])
    except (KeyError, TypeError, ValueError):
        return True  # limits this client cannot read: ask, and the server says
    return (
        not width % multiple
        and not height % multiple
        and width * height <= max_pixels
        and low <= width / height <= high
    )


def _within(value: int, bounds: dict[str, Any]) -> bool:
    low, high = bounds.get("min"), bounds.get("max")
    return (not isinstance(low, int) or value >= low) and (not isinstance(high, int) or value <= high)


def run_accept(plan: AcceptPlan) -> tuple[bool, dict[str, Any]]:
    """Run the acceptance; return (passed, report as a dict). Writes the MP4s (or error bodies) into plan.out_dir.
    Values the plan leaves None are chosen from the server's limits once its identity is checked (`fit_request`)."""
    report = Report()
    headers = {"Authorization": f"Bearer {plan.key}"} if plan.key else {}
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    notes: list[str] = []
    with httpx.Client(
        base_url=plan.url.rstrip("/"), headers=headers, timeout=httpx.Timeout(plan.timeout, connect=10)
    ) as client:
        limits = _identity(client, plan, report)
        plan, notes = fit_request(plan, limits)
        if report.passed:
            outputs = [_render(client, plan, report, i) for i in (1, 2)]
            if all(outputs):
                _compare(outputs, plan, report)
    result = {
        "passed": report.passed,
        "url": plan.url,
        "started_at": started,
        "request": plan.form(),
        "expected": {"width": plan.width, "height": plan.height, "num_frames": plan.num_frames, "fps": FPS},
        "notes": notes,
        "checks": report.checks,
        "renders": report.renders,
        "comparison": report.comparison,
    }
    return report.passed, result


def _identity(client: httpx.Client, plan: AcceptPlan, report: Report) -> dict[str, Any] | None:
    """Health, readiness and the model's id, each a check; the model's request limits (None where not listed)."""
    deadline = time.monotonic() + plan.wait_ready
    while True:
        try:
            health = client.get("/health")
            body = health.json() if health.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as err:
            health, body = None, {"error": f"{type(err).__name__}: {err}"}
        if body.get("ready") or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    ok = report.check("health", health is not None and health.status_code == 200, body)
    ok = report.check("ready", bool(body.get("ready")), body.get("readiness")) and ok
    if not ok:
        return None
    try:
        models = client.get("/v1/models")
        data = models.json().get("data", []) if models.status_code == 200 else []
        ids = [m.get("id") for m in data]
        detail: Any = {"status": models.status_code, "ids": ids}
    except (httpx.HTTPError, ValueError, AttributeError) as err:
        data, ids, detail = [], [], f"{type(err).__name__}: {err}"
    if plan.expect_model is not None:
        report.check("model identity", ids == [plan.expect_model], detail)
    else:
        report.check("model identity", len(ids) == 1, detail)
    return data[0].get("limits") if len(data) == 1 and isinstance(data[0], dict) else None


def _render(client: httpx.Client, plan: AcceptPlan, report: Report, index: int) -> Path | None:
    name = plan.out_dir / f"accept-{index}"
    part = name.with_suffix(".part")
    start = time.perf_counter()
    try:
        with client.stream("POST", "/v1/videos/sync", files=plan.parts()) as response, open(part, "wb") as fh:
            for chunk in response.iter_bytes():
                fh.write(chunk)
    except httpx.HTTPError as err:
        part.unlink(missing_ok=True)
        report.check(f"render {index}", False, f"{type(err).__name__}: {err}")
        return None
    client_s = time.perf_counter() - start
    record: dict[str, Any] = {
        "index": index,
        "status": response.status_code,
        "client_seconds": round(client_s, 3),
        "inference_time_s": _float(response.headers.get("x-inference-time-s")),
        "peak_memory_mb": _float(response.headers.get("x-peak-memory-mb")),
        "stage_durations": _json(response.headers.get("x-stage-durations")),
    }
    report.renders.append(record)
    if response.status_code != 200:
        target = name.with_suffix(".error.json")
        part.replace(target)
        record["file"] = str(target)
        reason = _reason(target)
        report.check(f"render {index}", False, f"HTTP {response.status_code}{reason} (body kept in {target})")
        return None
    try:
        info = verify_mp4(part, width=plan.width, height=plan.height, num_frames=plan.num_frames, fps=FPS,
                          sample_rate=SAMPLE_RATE)  # fmt: skip
    except ValueError as err:
        target = name.with_suffix(".invalid")
        part.replace(target)
        record["file"] = str(target)
        report.check(f"render {index}", False, f"{err} (kept as {target})")
        return None
    target = name.with_suffix(".mp4")
    part.replace(target)
    record.update(file=str(target), sha256=hashlib.sha256(target.read_bytes()).hexdigest(), stream=info.__dict__)
    report.check(f"render {index}", True, f"{info.frame_count} frames {info.width}x{info.height}, {info.video_codec} + "
                 f"{info.audio_codec} {info.audio_profile} {info.channels} ch")  # fmt: skip
    return target


def _compare(outputs: list[Path], plan: AcceptPlan, report: Report) -> None:
    a, b = (decode_frames(p) for p in outputs)
    same_shape = a.shape == b.shape
    hashes_a, hashes_b = frame_hashes(a), frame_hashes(b)
    differing = [i for i, (x, y) in enumerate(zip(hashes_a, hashes_b, strict=False)) if x != y]
    identical = same_shape and not differing
    psnr = audio_psnr(decode_audio(outputs[0]), decode_audio(outputs[1]))
    report.comparison = {
        "frames_identical": identical,
        "differing_frames": differing,
        "frames_sha256": hashlib.sha256("".join(hashes_a).encode()).hexdigest(),
        "audio_psnr_db": "inf" if math.isinf(psnr) else round(psnr, 3),
        "files_identical": outputs[0].read_bytes() == outputs[1].read_bytes(),
    }
    report.check("decoded frames byte-identical", identical, {"differing_frames": differing[:20]})
    report.check(
        f"audio PSNR >= {plan.min_audio_psnr:g} dB", psnr >= plan.min_audio_psnr, report.comparison["audio_psnr_db"]
    )


def _reason(path: Path) -> str:
    """`: the server's message` from an API error body (`{"error": {"message", "param"}}`), or nothing."""
    try:
        error = json.loads(path.read_bytes()).get("error", {})
        message, param = str(error["message"]), error.get("param")
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return ""
    return f": {message[:500]}" + (f" (param {param})" if param else "")


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _json(value: str | None) -> Any:
    try:
        return json.loads(value) if value else None
    except json.JSONDecodeError:
        return value
