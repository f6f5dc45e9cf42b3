"""The HTTP app: `create_app(settings, engine)` builds the vLLM-Omni/OpenAI-compatible video API over a loaded engine.

    GET    /health                    liveness, readiness, warmup result, profile, tasks served (no auth)
    GET    /ready                     200 once the startup warmup has passed, else 503
    GET    /metrics                   Prometheus text
    GET    /v1/models                 the served model (its entry lists the tasks served, from H3_TASK_TYPE)
    POST   /v1/videos/sync            render and return the MP4 bytes (bounded by the sync timeout); step caching in
                                      the X-H3-Step-Cache / X-H3-Cached-Steps headers (`step_cache_headers`)
    POST   /v1/videos                 queue an async job; returns its record at once
    GET    /v1/videos                 jobs, newest first (limit, after)
    GET    /v1/videos/{id}            one job record
    GET    /v1/videos/{id}/content    the job's MP4
    DELETE /v1/videos/{id}            cancel a queued or running job; delete a finished one and its MP4

The app never touches kernels or tensors: it maps requests onto the engine's `RenderRequest` (schemas.py) and hands
them to the scheduler (scheduler.py), which renders them one at a time; the records are in the store (store.py).

`create_app` builds the store, the scheduler and the metrics and puts them on `app.state`; the routes live on
module-level routers and get them through dependencies (so `app.dependency_overrides` can replace one). Nothing
blocking runs on the event loop: the handlers that only call the store or the scheduler are plain `def`s, which
FastAPI runs in its threadpool, and the two POST routes read the body on the loop, then map it (which decodes the
uploaded media) and queue it in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from h3serve import __version__
from h3serve.pipeline.context import RenderCancelled
from h3serve.pipeline.engine import Engine
from h3serve.service.errors import ApiError, bad_request, internal_error
from h3serve.service.metrics import Metrics
from h3serve.service.scheduler import QueueFull, Scheduler, Work
from h3serve.service.schemas import (
    FILE_FIELDS,
    MAX_FILES,
    MAX_KEYFRAMES,
    MAX_REFERENCES,
    REF2VA,
    JobStatus,
    Mapped,
    Upload,
    VideoJob,
    decode_data_url,
    map_request,
    step_cache_mode,
)
from h3serve.service.security import BearerKey, require_key
from h3serve.service.store import ACTIVE, JobStore, job_record, new_job_id
from h3serve.settings import Settings

log = logging.getLogger(__name__)

MAX_FIELD_BYTES = 1 << 20  # any non-file form field (the prompt cap is far below this)
RETRY_AFTER_S = "5"
MAX_PAGE = 100
SYNC_POLL_S = 0.25  # how often a waiting sync route looks for a disconnected client


def create_app(settings: Settings, engine: Engine) -> FastAPI:
    store = JobStore(settings.output_dir)
    metrics = Metrics()
    scheduler = Scheduler(
        engine,
        store,
        max_queue=settings.max_queue,
        warmup=settings.startup_warmup,
        encoder_threads=settings.encoder_threads,
        metrics=metrics,
    )
    metrics.watch(scheduler, store)
    app = FastAPI(title="h3serve", version=__version__, lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.settings, app.state.engine, app.state.auth = settings, engine, BearerKey(settings.key)
    app.state.store, app.state.scheduler, app.state.metrics = store, scheduler, metrics
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _query_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(open_routes)
    app.include_router(routes)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    app.state.scheduler.start()
    try:
        yield
    finally:
        await asyncio.to_thread(app.state.scheduler.stop)
        app.state.store.close()


# ---- dependencies: the app's parts, from app.state ------------------------------------------------------------------
# async: each is one attribute read, not worth a trip to the threadpool.
async def _settings(request: Request) -> Settings:
    return request.app.state.settings


async def _engine(request: Request) -> Engine:
    return request.app.state.engine


async def _store(request: Request) -> JobStore:
    return request.app.state.store


async def _scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


async def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


SettingsDep = Annotated[Settings, Depends(_settings)]
EngineDep = Annotated[Engine, Depends(_engine)]
StoreDep = Annotated[JobStore, Depends(_store)]
SchedulerDep = Annotated[Scheduler, Depends(_scheduler)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]


# ---- errors: always {"error": {"code", "message", "param"}} ---------------------------------------------------------
async def _api_error(_: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "invalid_request")
    body = {"error": {"code": code, "message": str(err.detail), "param": None}}
    return JSONResponse(body, status_code=err.status_code, headers=getattr(err, "headers", None))


async def _query_error(_: Request, err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0] if err.errors() else {}
    param = str(first.get("loc", ["", ""])[-1]) or None
    message = f"{param}: {first.get('msg', 'invalid value')}, got {first.get('input')!r}"
    return JSONResponse(bad_request(param, message).body(), status_code=400)


async def _internal_error(request: Request, err: Exception) -> JSONResponse:
    request_id = uuid.uuid4().hex
    log.error("internal error, request id %s: %s %s", request_id, request.method, request.url.path, exc_info=err)
    answer = internal_error("internal_error", "the request failed", request_id)
    return JSONResponse(answer.body(), status_code=answer.status, headers=answer.headers)


# ---- open routes ----------------------------------------------------------------------------------------------------
open_routes = APIRouter()


@open_routes.get("/health")
def health(settings: SettingsDep, engine: EngineDep, scheduler: SchedulerDep) -> dict[str, Any]:
    warm = scheduler.warmup_result
    return {
        "status": "ok",
        "live": True,
        "ready": scheduler.ready,
        "readiness": scheduler.readiness.value,
        "warmup": {
            "enabled": settings.startup_warmup,
            "passed": None if warm is None else warm.passed,
            "seconds": None if warm is None else round(warm.seconds, 3),
            "request": None if warm is None else warm.request,
            "error": None if warm is None else warm.error,
        },
        "model": settings.model_id,
        "profile": engine.profile.__dict__,
        "tasks": list(engine.tasks),
        "queue_depth": scheduler.depth,
        "version": __version__,
    }


# ---- authenticated routes -------------------------------------------------------------------------------------------
routes = APIRouter(dependencies=[Depends(require_key)])


@routes.get("/ready")
def ready(scheduler: SchedulerDep) -> JSONResponse:
    body = {"ready": scheduler.ready, "readiness": scheduler.readiness.value}
    return JSONResponse(body, status_code=200 if scheduler.ready else 503)


@routes.get("/metrics")
def metrics_text(metrics: MetricsDep) -> Response:
    return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


@routes.get("/v1/models")
def models(settings: SettingsDep, engine: EngineDep) -> dict[str, Any]:
    entry = {"id": settings.model_id, "object": "model", "owned_by": "h3serve", "tasks": list(engine.tasks)}
    return {"object": "list", "data": [entry]}


def _require_ready(scheduler: Scheduler, metrics: Metrics) -> None:
    if scheduler.ready:
        return
    if scheduler.readiness.value == "failed":
        error = scheduler.warmup_result.error if scheduler.warmup_result else "unknown"
        message = f"the startup warmup failed ({error}); this server does not render (see /health)"
    else:
        message = "the server is warming up (the startup warmup has not passed yet); retry shortly"
    metrics.rejected.labels("not_ready").inc()
    raise ApiError(503, "not_ready", message, None, {"Retry-After": RETRY_AFTER_S})


async def _parse(
    request: Request, settings: Settings, engine: Engine, scheduler: Scheduler, metrics: Metrics
) -> Mapped:
    _require_ready(scheduler, metrics)
    # The body cap counts the files a request to this server can carry: 2 keyframes, or 12 Ref2VA references when the
    # Ref2VA DiT is loaded, each up to H3_MAX_UPLOAD_MB, plus the form fields.
    body_files = MAX_REFERENCES if REF2VA in engine.tasks else MAX_KEYFRAMES
    fields, uploads = await read_body(request, settings.max_upload_mb << 20, body_files)
    try:
        return await asyncio.to_thread(
            map_request, fields, uploads, engine, settings.model_id, settings.max_prompt_chars
        )
    except ApiError:
        metrics.rejected.labels("invalid").inc()
        raise


async def _submit(scheduler: Scheduler, metrics: Metrics, work: Work, record: VideoJob | None = None) -> None:
    try:
        await asyncio.to_thread(scheduler.submit, work, record)  # inserts the record: a store write
    except QueueFull:
        metrics.rejected.labels("queue_full").inc()
        raise ApiError(
            429,
            "queue_full",
            f"the render queue is full ({scheduler.max_queue} waiting); retry later",
            None,
            {"Retry-After": RETRY_AFTER_S},
        ) from None


@routes.post("/v1/videos/sync")
async def create_sync(
    request: Request, settings: SettingsDep, engine: EngineDep, scheduler: SchedulerDep, metrics: MetricsDep
) -> Response:
    mapped = await _parse(request, settings, engine, scheduler, metrics)
    work = Work(new_job_id(), mapped.request, persist=False)
    await _submit(scheduler, metrics, work)
    future = asyncio.wrap_future(work.future)
    # A render abandoned below (timeout, disconnect) still ends, with RenderCancelled: retrieve it, or asyncio logs
    # "exception was never retrieved" for every abandoned render.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    loop = asyncio.get_running_loop()
    timeout = settings.video_sync_timeout
    deadline = loop.time() + timeout
    while not future.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            work.ctx.cancel(f"the sync timeout of {timeout} s passed")
            raise ApiError(
                504,
                "timeout",
                f"the render did not finish within H3_VIDEO_SYNC_TIMEOUT={timeout} s and was cancelled; use the "
                "async API (POST /v1/videos) for long renders",
            )
        await asyncio.wait({future}, timeout=min(SYNC_POLL_S, remaining))
        if not future.done() and await request.is_disconnected():
            work.ctx.cancel("the client disconnected")
            log.info("sync render %s cancelled: the client disconnected", work.id)
            return Response(status_code=499)
    try:
        mp4 = future.result()
    except RenderCancelled as err:
        raise ApiError(503, "cancelled", f"the render was cancelled: {err}") from err
    except Exception as err:  # the scheduler has logged it with its traceback, under this id
        raise internal_error("render_failed", "the render failed", work.id) from err
    result = work.result
    stages = {k: round(v, 4) for k, v in result.timings.items() if k != "total"}
    headers = {
        "x-request-id": work.id,
        "x-inference-time-s": f"{result.timings['total']:.4f}",
        "x-peak-memory-mb": f"{result.peak_memory_mb:.1f}",
        "X-Stage-Durations": json.dumps(stages, separators=(",", ":")),
        "x-seed": str(mapped.request.seed),
        "x-num-frames": str(mapped.request.num_frames),
        **step_cache_headers(result.step_cache, mapped.request.quality),
    }
    return Response(mp4, media_type="video/mp4", headers=headers)


@routes.post("/v1/videos")
async def create_job(
    request: Request, settings: SettingsDep, engine: EngineDep, scheduler: SchedulerDep, metrics: MetricsDep
) -> dict[str, Any]:
    mapped = await _parse(request, settings, engine, scheduler, metrics)
    record = job_record(new_job_id(), mapped.request, settings.model_id)
    await _submit(scheduler, metrics, Work(record.id, mapped.request, persist=True), record)
    return record.model_dump()


@routes.get("/v1/videos")
def list_jobs(store: StoreDep, limit: int = 20, after: str | None = None) -> dict[str, Any]:
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request("limit", f"limit must be 1..{MAX_PAGE}, got {limit}")
    if after is not None and store.get(after) is None:
        raise bad_request("after", f"after: no job {after!r}")
    jobs, more = store.list(limit, after)
    data = [j.model_dump() for j in jobs]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}


def _find(store: JobStore, video_id: str) -> VideoJob:
    job = store.get(video_id)
    if job is None:
        raise ApiError(404, "not_found", f"no video job {video_id!r}", "video_id")
    return job


@routes.get("/v1/videos/{video_id}")
def get_job(store: StoreDep, video_id: str) -> dict[str, Any]:
    return _find(store, video_id).model_dump()


@routes.get("/v1/videos/{video_id}/content")
def content(store: StoreDep, video_id: str) -> Response:
    job = _find(store, video_id)
    path = store.path(job)
    if job.status != JobStatus.COMPLETED or path is None:
        raise ApiError(409, "not_completed", f"job {video_id} is {job.status}; only a completed job has content")
    if not path.is_file():
        raise ApiError(410, "gone", f"the MP4 of job {video_id} is no longer on disk", "video_id")
    return FileResponse(path, media_type="video/mp4", filename=job.file_name)


@routes.delete("/v1/videos/{video_id}")
def delete(store: StoreDep, scheduler: SchedulerDep, video_id: str) -> dict[str, Any]:
    job = _find(store, video_id)
    if job.status in ACTIVE:
        scheduler.cancel(video_id, "cancelled by DELETE /v1/videos/{id}")  # returns once the job has stopped
        job = _find(store, video_id)
        if job.status in (JobStatus.CANCELLED, *ACTIVE):
            return job.model_dump()
    store.delete(video_id)
    return {"id": video_id, "object": "video.deleted", "deleted": True}


def step_cache_headers(report, quality: str | None) -> dict[str, str]:
    """A sync render's step caching: `X-H3-Step-Cache` is `off` (no step cache on this server, or quality=lossless),
    `server` (H3_CACHE_CONFIG's profile) or `high` (quality=high's conservative one); `X-H3-Cached-Steps` lists the
    DiT forwards (0-based, in denoise order, comma-separated) that reused cached blocks, empty when none did; and
    `X-H3-DiT-Forwards` counts the forwards the render ran, present when the server has a step cache (which counts
    them)."""
    cached = report.cached if report is not None else ()
    headers = {"X-H3-Step-Cache": step_cache_mode(report, quality), "X-H3-Cached-Steps": ",".join(map(str, cached))}
    if report is not None:
        headers["X-H3-DiT-Forwards"] = str(report.forwards)
    return headers


def _capped(request: Request, cap: int) -> Request:
    """The request with its body stream counted: past `cap` bytes reading it raises 413, whatever Content-Length
    claimed (a chunked upload has none), so no upload is spooled to disk or memory beyond the cap."""
    receive, seen = request.receive, 0

    async def counted() -> dict:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > cap:
            raise ApiError(413, "too_large", f"the request body is over the limit of {cap} bytes")
        return message

    return Request(request.scope, counted)


async def read_body(
    request: Request, upload_cap: int, body_files: int = MAX_KEYFRAMES
) -> tuple[dict[str, Any], list[Upload]]:
    """The request's fields and file uploads (keyframes or references, in request order), from a multipart/urlencoded
    form or a JSON object, size-capped: each file at `upload_cap`, the body at `body_files` files plus the fields."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    body_cap = body_files * upload_cap + MAX_FIELD_BYTES
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > body_cap:
        raise ApiError(413, "too_large", f"the request body is {int(length)} bytes; the limit is {body_cap}")
    request = _capped(request, body_cap)
    if kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        return await _read_form(request, upload_cap)
    if kind == "application/json":
        body = await request.body()
        if len(body) > body_cap:
            raise ApiError(413, "too_large", f"the request body is {len(body)} bytes; the limit is {body_cap}")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as err:  # malformed, not UTF-8, too deep, or a number too long to parse
            raise bad_request(None, f"the body is not valid JSON ({type(err).__name__}: {err})") from err
        if not isinstance(data, dict):
            raise bad_request(None, f"the JSON body must be an object, got {type(data).__name__}")
        uploads = []
        for name in FILE_FIELDS:
            value = data.pop(name, None)
            values = value if isinstance(value, list) else [] if value is None else [value]
            uploads += [_upload(name, decode_data_url(name, v), upload_cap) for v in values]
        return data, uploads
    raise ApiError(
        415,
        "unsupported_media_type",
        f"content type {kind or 'none'!r} is not accepted; send multipart/form-data or application/json",
    )


async def _read_form(request: Request, upload_cap: int) -> tuple[dict[str, Any], list[Upload]]:
    try:
        form = await request.form(max_files=MAX_FILES, max_fields=64, max_part_size=MAX_FIELD_BYTES)
    except StarletteHTTPException as err:  # malformed multipart, too many files or fields
        if "files" in str(err.detail).lower():
            message = (
                f"input_references: at most {MAX_FILES} files ({MAX_REFERENCES} Ref2VA references, "
                f"{MAX_KEYFRAMES} keyframes) ({err.detail})"
            )
            raise bad_request("input_references", message) from err
        raise bad_request(None, f"the form could not be read: {err.detail}") from err
    fields: dict[str, Any] = {}
    uploads: list[Upload] = []
    for name in dict.fromkeys(form.keys()):
        values = form.getlist(name)
        if name in FILE_FIELDS:
            for value in values:
                if not isinstance(value, UploadFile):
                    raise bad_request(name, f"{name} must be an uploaded file (multipart file part)")
                data = await value.read(upload_cap + 1)
                uploads.append(_upload(name, data, upload_cap, value.filename or ""))
        elif len(values) > 1:
            raise bad_request(name, f"{name} is given {len(values)} times; give it once")
        elif isinstance(values[0], UploadFile):
            raise bad_request(name, f"{name} must be a text field, not a file")
        else:
            fields[name] = values[0]
    await form.close()
    return fields, uploads


def _upload(name: str, data: bytes, cap: int, filename: str = "") -> Upload:
    if len(data) > cap:
        raise ApiError(413, "too_large", f"{name}: the file is larger than H3_MAX_UPLOAD_MB ({cap >> 20} MiB)", name)
    if not data:
        raise bad_request(name, f"{name}: the file is empty")
    return Upload(name, data, filename)
