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
them to the scheduler (jobs.py), which runs them one at a time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from h3serve import __version__
from h3serve.pipeline.context import RenderCancelled
from h3serve.pipeline.engine import Engine
from h3serve.service.errors import ApiError, bad_request
from h3serve.service.jobs import ACTIVE, JobStatus, JobStore, QueueFull, Scheduler, Work, job_record, new_job_id
from h3serve.service.metrics import Metrics
from h3serve.service.schemas import (
    FILE_FIELDS,
    MAX_FILES,
    MAX_KEYFRAMES,
    MAX_REFERENCES,
    REF2VA,
    Upload,
    decode_data_url,
    map_request,
    step_cache_mode,
)
from h3serve.service.security import bearer_auth
from h3serve.settings import Settings

log = logging.getLogger(__name__)

MAX_FIELD_BYTES = 1 << 20  # any non-file form field (the prompt cap is far below this)
RETRY_AFTER_S = "5"
MAX_PAGE = 100


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
    model_id = settings.model_id
    upload_cap = settings.max_upload_mb << 20
    # The body cap counts the files a request to this server can carry: 2 keyframes, or 12 Ref2VA references when the
    # Ref2VA DiT is loaded, each up to H3_MAX_UPLOAD_MB, plus the form fields.
    body_files = MAX_REFERENCES if REF2VA in engine.tasks else MAX_KEYFRAMES

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)
            store.close()

    app = FastAPI(title="h3serve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings, app.state.engine, app.state.store, app.state.scheduler = settings, engine, store, scheduler

    # ---- errors: always {"error": {"code", "message", "param"}} ------------------------------------------------
    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "invalid_request")
        body = {"error": {"code": code, "message": str(err.detail), "param": None}}
        return JSONResponse(body, status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def query_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        param = str(first.get("loc", ["", ""])[-1]) or None
        message = f"{param}: {first.get('msg', 'invalid value')}, got {first.get('input')!r}"
        return JSONResponse(bad_request(param, message).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        log.exception("internal error")
        body = {"error": {"code": "internal_error", "message": f"{type(err).__name__}: {err}", "param": None}}
        return JSONResponse(body, status_code=500)

    # ---- open routes ----------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict[str, Any]:
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
            "model": model_id,
            "profile": engine.profile.__dict__,
            "tasks": list(engine.tasks),
            "queue_depth": scheduler.depth,
            "version": __version__,
        }

    # ---- authenticated routes -------------------------------------------------------------------------------------
    router = APIRouter(dependencies=[Depends(bearer_auth(settings.key))])

    @router.get("/ready")
    async def ready() -> JSONResponse:
        body = {"ready": scheduler.ready, "readiness": scheduler.readiness.value}
        return JSONResponse(body, status_code=200 if scheduler.ready else 503)

    @router.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {"id": model_id, "object": "model", "owned_by": "h3serve", "tasks": list(engine.tasks)}
        return {"object": "list", "data": [entry]}

    def require_ready() -> None:
        if scheduler.ready:
            return
        if scheduler.readiness.value == "failed":
            error = scheduler.warmup_result.error if scheduler.warmup_result else "unknown"
            message = f"the startup warmup failed ({error}); this server does not render (see /health)"
        else:
            message = "the server is warming up (the startup warmup has not passed yet); retry shortly"
        metrics.rejected.labels("not_ready").inc()
        raise ApiError(503, "not_ready", message, None, {"Retry-After": RETRY_AFTER_S})

    async def parse(request: Request):
        require_ready()
        fields, uploads = await read_body(request, upload_cap, body_files)
        try:
            return map_request(fields, uploads, engine, model_id, settings.max_prompt_chars)
        except ApiError:
            metrics.rejected.labels("invalid").inc()
            raise

    def submit(work: Work, record=None) -> None:
        try:
            scheduler.submit(work, record)
        except QueueFull:
            metrics.rejected.labels("queue_full").inc()
            raise ApiError(
                429,
                "queue_full",
                f"the render queue is full ({settings.max_queue} waiting); retry later",
                None,
                {"Retry-After": RETRY_AFTER_S},
            ) from None

    @router.post("/v1/videos/sync")
    async def create_sync(request: Request) -> Response:
        mapped = await parse(request)
        work = Work(new_job_id(), mapped.request, persist=False)
        submit(work)
        future = asyncio.wrap_future(work.future)
        # A render abandoned below (timeout, disconnect) still ends, with RenderCancelled: retrieve it, or asyncio
        # logs "exception was never retrieved" for every abandoned render.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.video_sync_timeout
        while not future.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                work.ctx.cancel(f"the sync timeout of {settings.video_sync_timeout} s passed")
                raise ApiError(
                    504,
                    "timeout",
                    f"the render did not finish within H3_VIDEO_SYNC_TIMEOUT={settings.video_sync_timeout} s and "
                    "was cancelled; use the async API (POST /v1/videos) for long renders",
                )
            await asyncio.wait({future}, timeout=min(0.25, remaining))
            if not future.done() and await request.is_disconnected():
                work.ctx.cancel("the client disconnected")
                log.info("sync render %s cancelled: the client disconnected", work.id)
                return Response(status_code=499)
        try:
            mp4 = future.result()
        except RenderCancelled as err:
            raise ApiError(503, "cancelled", f"the render was cancelled: {err}") from err
        except Exception as err:
            raise ApiError(500, "render_failed", f"the render failed: {type(err).__name__}: {err}") from err
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

    @router.post("/v1/videos")
    async def create_job(request: Request) -> dict[str, Any]:
        mapped = await parse(request)
        record = job_record(new_job_id(), mapped.request, model_id)
        submit(Work(record.id, mapped.request, persist=True), record)
        return record.model_dump()

    @router.get("/v1/videos")
    async def list_jobs(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        if not 1 <= limit <= MAX_PAGE:
            raise bad_request("limit", f"limit must be 1..{MAX_PAGE}, got {limit}")
        if after is not None and store.get(after) is None:
            raise bad_request("after", f"after: no job {after!r}")
        jobs, more = store.list(limit, after)
        data = [j.model_dump() for j in jobs]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}

    def find(video_id: str):
        job = store.get(video_id)
        if job is None:
            raise ApiError(404, "not_found", f"no video job {video_id!r}", "video_id")
        return job

    @router.get("/v1/videos/{video_id}")
    async def get_job(video_id: str) -> dict[str, Any]:
        return find(video_id).model_dump()

    @router.get("/v1/videos/{video_id}/content")
    async def content(video_id: str) -> Response:
        job = find(video_id)
        path = store.path(job)
        if job.status != JobStatus.COMPLETED or path is None:
            raise ApiError(409, "not_completed", f"job {video_id} is {job.status}; only a completed job has content")
        if not path.is_file():
            raise ApiError(410, "gone", f"the MP4 of job {video_id} is no longer on disk", "video_id")
        return FileResponse(path, media_type="video/mp4", filename=job.file_name)

    @router.delete("/v1/videos/{video_id}")
    async def delete(video_id: str) -> dict[str, Any]:
        job = find(video_id)
        if job.status in ACTIVE:
            await asyncio.to_thread(scheduler.cancel, video_id, "cancelled by DELETE /v1/videos/{id}")
            job = find(video_id)
            if job.status in (JobStatus.CANCELLED, *ACTIVE):
                return job.model_dump()
        store.delete(video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    app.include_router(router)
    return app


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
