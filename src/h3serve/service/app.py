"""The HTTP app: `create_app(settings, engine)` builds the vLLM-Omni/OpenAI-compatible video API over a loaded engine.

    GET    /health                    liveness, readiness, warmup result, profile, tasks served (no auth; HEAD too)
    GET    /ready                     200 once the startup warmup has passed, else 503 (HEAD too)
    GET    /openapi.json              the API's OpenAPI schema (unless H3_API_SCHEMA is off)
    GET    /metrics                   Prometheus text
    GET    /v1/models                 the served model: the tasks served (H3_TASK_TYPE), adapters (merged, and those a
                                      request may apply: `runtime_adapters`), request limits
    POST   /v1/videos/sync            render and return the MP4 bytes (bounded by the sync timeout); step caching in
                                      the X-H3-Step-Cache / X-H3-Cached-Steps headers (`step_cache_headers`), run-time
                                      adapters in X-H3-Adapters (`adapter_headers`)
    POST   /v1/videos                 queue an async job; returns its record at once
    GET    /v1/videos                 jobs, newest first (limit, after, order); a record the store cannot read is
                                      listed with status `damaged` (store.DamagedRecord), the rest are served
    GET    /v1/videos/{id}            one job record (with `live`: an unfinished job's stage and step)
    GET    /v1/videos/{id}/content    the job's MP4 (variant: video, the only one kept), from videos/ or the bucket
                                      (H3_OUTPUT_URL); a Range header's byte range (206, 416); H3_S3_PRESIGN: a 307;
                                      a fleet without H3_OUTPUT_URL: 421 naming the server that holds it
    GET    /v1/videos/{id}/events     the job's events (server-sent events), from any server of a fleet
    GET    /v1/videos/{id}/preview    the job's latest preview PNG, from any server of a fleet
    DELETE /v1/videos/{id}            cancel a queued or running job (answers once it has stopped; 202 if it has not
                                      within CANCEL_WAIT_S); delete a finished one and its MP4
    GET    /, /web/{name}             the web page (page.py, docs/web.md; HEAD / too): static files, no key, not in
                                      the schema

In a fleet (a PostgreSQL store, docs/fleet.md "One API across the fleet") every route answers for every job, whichever
server holds it: a record shows its `server_id`, /health its `fleet_jobs`; while the database does not answer, the
routes that need it answer 503 `store_unavailable` and /health is not ready, naming why.

The app never touches kernels or tensors: it maps requests onto the engine's `RenderRequest` (schemas.py) and hands
them to the scheduler (scheduler.py), which renders them one at a time; the records are in the store (store.py).

`create_app` builds the store, the scheduler and the metrics and puts them on `app.state`; the routes live on
module-level routers and get them through dependencies (so `app.dependency_overrides` can replace one). Nothing
blocking runs on the event loop: the handlers that only call the store or the scheduler are plain `def`s, which
FastAPI runs in its threadpool, and the two POST routes read the body on the loop (bodies.py: strict, capped, under
a deadline), then map it, which decodes the uploaded media, in a small pool of its own (DECODE_WORKERS threads, so
that a burst of large uploads cannot take every thread), and queue it in a thread.

Every route refuses a query parameter it does not declare, and any query string that is not UTF-8 once unescaped:
a parameter the server would not honour must not look accepted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import json
import logging
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, NoReturn
from urllib.parse import unquote_to_bytes

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match, Route

from h3serve import __version__
from h3serve.pipeline.context import NodeLost, RenderCancelled
from h3serve.pipeline.engine import RenderEngine
from h3serve.pipeline.request import RenderRequest
from h3serve.service.bodies import BodyLimits, ClientGone, read_body
from h3serve.service.errors import ApiError, bad_request, internal_error, named, shown
from h3serve.service.events import MAX_STREAMS, TERMINAL, Event, Streams
from h3serve.service.folders import service_folders
from h3serve.service.metrics import Metrics
from h3serve.service.page import INDEX, WebPage
from h3serve.service.scheduler import QueueFull, Scheduler, Work, WriteFailed
from h3serve.service.schemas import (
    MAX_KEYFRAMES,
    MAX_REFERENCES,
    REF2VA,
    JobStatus,
    PreviewRule,
    ServerTerms,
    VideoCreateRequest,
    VideoJob,
    admit,
    request_limits,
    step_cache_mode,
)
from h3serve.service.security import BearerKey, require_key
from h3serve.service.store import (
    ACTIVE,
    DamagedRecord,
    Fleet,
    FolderLock,
    JobRecords,
    RecordDamaged,
    ValueRefused,
    job_record,
    new_job_id,
    open_store,
)
from h3serve.service.store.claims import StoreUnreachable
from h3serve.service.store.objects import Body, ObjectGone, ObjectsUnavailable, open_outputs
from h3serve.settings import Settings

log = logging.getLogger(__name__)

RETRY_AFTER_S = "5"
DECODE_WORKERS = 2  # threads that map requests and decode their uploads
MAX_PAGE = 100
SYNC_POLL_S = 0.25  # how often a waiting sync route looks for a disconnected client
CANCEL_WAIT_S = 30.0  # how long a DELETE waits for an unfinished job to stop before it answers 202


def create_app(
    settings: Settings, engine: RenderEngine, page: WebPage | None = None, *, folder_lock: FolderLock | None = None
) -> FastAPI:
    page = page or WebPage.load()  # before the store opens: nothing to give back if the install lacks the page
    store = open_store(settings.output_dir, settings.store, lock=folder_lock, server_id=settings.server_id)
    metrics = Metrics()
    try:
        fleet = Fleet.of(store, settings, engine)  # a PostgreSQL store's claims (issue 58); None with SQLite
        scheduler = Scheduler(
            engine,
            store,
            max_queue=settings.max_queue,
            warmup=settings.startup_warmup,
            encoding=settings.encoding,
            metrics=metrics,
            folders=service_folders(settings.output_dir),
            outputs=open_outputs(settings, store.videos),
            fleet=fleet,
        )
    except BaseException:
        store.close()  # (and the output folder's lock with it, unless the caller holds it)
        raise
    metrics.watch(scheduler, store)
    if fleet is not None and not scheduler.outputs.remote:
        log.warning(
            "H3_STORE is PostgreSQL and H3_OUTPUT_URL is unset: each MP4 stays in the output folder of the server that "
            "rendered it, and /content on another server of the fleet answers 421 naming that server; set "
            "H3_OUTPUT_URL on every server for downloads through any of them (docs/fleet.md)"
        )
    # The schema is served by a route of our own, behind the key; there is no /docs page (it would fetch its
    # scripts from the internet, and these servers are often offline).
    # No redirect to the path with(out) a trailing slash: a 307 with an empty body, which a POST's client rarely
    # follows; the 404 names the path instead (`_http_error`).
    app = FastAPI(
        title="h3serve",
        version=__version__,
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
        dependencies=[Depends(literal_paths_first)],
    )
    app.state.settings, app.state.engine, app.state.auth = settings, engine, BearerKey(settings.key)
    app.state.store, app.state.scheduler, app.state.metrics = store, scheduler, metrics
    app.state.streams = Streams(MAX_STREAMS)  # the open event streams, woken by the scheduler's publishes
    scheduler.events.on_publish = app.state.streams.poke
    scheduler.events.on_gap = app.state.streams.poke_all
    app.state.decoder = ThreadPoolExecutor(DECODE_WORKERS, thread_name_prefix="h3-decode")
    app.state.page = page
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RecordDamaged, _damaged_record)
    app.add_exception_handler(ValueRefused, _value_refused)
    app.add_exception_handler(StoreUnreachable, _store_unreachable)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _query_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(open_routes)
    app.include_router(page_routes)
    app.include_router(routes)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    app.state.scheduler.start()
    try:
        yield
    finally:
        await asyncio.to_thread(app.state.scheduler.stop)
        app.state.decoder.shutdown(wait=False, cancel_futures=True)
        app.state.store.close()


# ---- dependencies: the app's parts, from app.state ------------------------------------------------------------------
# async: each is one attribute read, not worth a trip to the threadpool.
async def _settings(request: Request) -> Settings:
    return request.app.state.settings


async def _engine(request: Request) -> RenderEngine:
    return request.app.state.engine


async def _store(request: Request) -> JobRecords:
    return request.app.state.store


async def _scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


async def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


SettingsDep = Annotated[Settings, Depends(_settings)]
EngineDep = Annotated[RenderEngine, Depends(_engine)]
StoreDep = Annotated[JobRecords, Depends(_store)]
SchedulerDep = Annotated[Scheduler, Depends(_scheduler)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]


# ---- errors: always {"error": {"code", "message", "param"}} ---------------------------------------------------------
async def _api_error(_: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _damaged_record(request: Request, err: RecordDamaged) -> JSONResponse:
    """A job whose stored record does not decode, asked for by a route that needs the record (its content, its
    delete): 409, which a retry does not change; the list and the job's own record show it as `damaged`."""
    message = f"the record of job {shown(err.record.id)} is damaged in the server's store (h3serve store check)"
    return await _api_error(request, ApiError(409, "damaged_record", message, "video_id"))


async def _value_refused(request: Request, err: ValueRefused) -> JSONResponse:
    """A request value the job store cannot hold (H3_STORE's PostgreSQL and a NUL character): refused before it was
    queued, naming the parameter."""
    message = f"{err.field}: the server's job store cannot hold this value ({err.why})"
    return await _api_error(request, bad_request(err.field, message))


async def _store_unreachable(request: Request, err: StoreUnreachable) -> JSONResponse:
    """The fleet's database does not answer (PostgreSQL restarted or out of reach): 503 with Retry-After, while the
    server reconnects by itself; /health says not ready meanwhile. A request refused here changed nothing, except where
    the connection went during its commit (`unknown`): then it may have been made, and the message says so."""
    outcome = (
        "whether this request was made is unknown (the connection went during its commit): look (GET /v1/videos) "
        "before sending it again"
        if err.unknown
        else "nothing was changed; retry"
    )
    message = f"the server's job store does not answer ({err.reason}); {outcome}"
    return await _api_error(request, ApiError(503, "store_unavailable", message, None, {"Retry-After": RETRY_AFTER_S}))


async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "invalid_request")
    message, headers = str(err.detail), getattr(err, "headers", None)
    path = request.scope.get("path", "")
    if err.status_code == 405:  # Starlette's Allow names only the first route at the path: all of them here
        allowed = ", ".join(methods_at(request.scope))
        message, headers = f"{request.method} is not allowed on {shown(path)}; it takes {allowed}", {"Allow": allowed}
    elif err.status_code == 404 and "route" not in request.scope:  # no route at this path, whatever the method
        message = f"no such path: {shown(path)}"
        bare = path.rstrip("/")
        if bare and bare != path and methods_at({**request.scope, "path": bare}):
            message += f"; the path is {shown(bare)}, without the trailing slash"
    body = {"error": {"code": code, "message": message, "param": None}}
    return JSONResponse(body, status_code=err.status_code, headers=headers)


async def _query_error(_: Request, err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0] if err.errors() else {}
    param = named(str(first.get("loc", ["", ""])[-1])) or None
    message = f"{param}: {first.get('msg', 'invalid value')}, got {shown(first.get('input'))}"
    return JSONResponse(bad_request(param, message).body(), status_code=400)


async def _client_gone(request: Request, _: Exception) -> Response:
    """A client that left before its request was read: nobody to answer, nothing went wrong here."""
    log.info("%s %s: the client disconnected before its request body was complete", request.method, request.url.path)
    return Response(status_code=499)


async def _internal_error(request: Request, err: Exception) -> JSONResponse:
    request_id = uuid.uuid4().hex
    log.error("internal error, request id %s: %s %s", request_id, request.method, request.url.path, exc_info=err)
    answer = internal_error("internal_error", "the request failed", request_id)
    return JSONResponse(answer.body(), status_code=answer.status, headers=answer.headers)


# ---- methods: a path a route names literally is that route's ------------------------------------------------------
def _routes() -> list[Route]:
    """Every route of the app, from the routers that declare them (FastAPI keeps an included router whole, so the
    app's own list holds routers, not routes)."""
    return [r for router in (open_routes, page_routes, routes) for r in router.routes if isinstance(r, Route)]


def methods_at(scope: dict) -> list[str]:
    """The methods the routes at `scope`'s path take. A path that a route names literally (/v1/videos/sync) is that
    route's alone, not also a value of a parameterised route's (/v1/videos/{video_id})."""
    found = [r for r in _routes() if r.matches(scope)[0] is not Match.NONE]
    literal = [r for r in found if not r.param_convertors]
    return sorted({m for r in literal or found for m in r.methods or ()})


async def literal_paths_first(request: Request) -> None:
    """405 for a method that the literal route at this path does not take, where a parameterised route would
    otherwise take it (GET /v1/videos/sync is not the job `sync`); the message and Allow come from `_http_error`."""
    literal = [r for r in _routes() if not r.param_convertors and r.matches(request.scope)[0] is not Match.NONE]
    if literal and not any(request.method in (r.methods or ()) for r in literal):
        raise StarletteHTTPException(405)


# ---- query strings: declared parameters only, UTF-8 once unescaped ---------------------------------------------------
async def strict_query(request: Request) -> None:
    """400 for a query parameter the route does not declare, or one whose name or value is not UTF-8 (Starlette would
    read a bad escape as U+FFFD and go on)."""
    raw = request.scope.get("query_string", b"")
    if not raw:
        return
    route = request.scope.get("route")
    declared = {p.alias for p in route.dependant.query_params} if route is not None else set()
    for pair in raw.split(b"&"):
        if not pair:
            continue
        name, _, value = pair.partition(b"=")
        try:
            key = unquote_to_bytes(name.replace(b"+", b" ")).decode("utf-8")
            unquote_to_bytes(value.replace(b"+", b" ")).decode("utf-8")
        except UnicodeDecodeError:
            shown_name = shown(name.decode("latin-1"))
            raise bad_request(None, f"the query parameter {shown_name} is not UTF-8 once unescaped") from None
        if key not in declared:
            allowed = ", ".join(sorted(declared)) or "none"
            raise bad_request(named(key), f"unknown query parameter {shown(key)}; this route takes: {allowed}")


# ---- open routes ----------------------------------------------------------------------------------------------------
open_routes = APIRouter(dependencies=[Depends(strict_query)])


@open_routes.get("/health")
@open_routes.head("/health", include_in_schema=False)
def health(settings: SettingsDep, engine: EngineDep, scheduler: SchedulerDep) -> dict[str, Any]:
    warm = scheduler.warmup_result
    scheduler.look_at_store()  # a fleet's database: answering now, or why not (in `problem`)
    standing = scheduler.standing()  # one look at the folders for ready, problem and unwritable_folders alike
    return {
        "status": "ok",
        "live": True,
        "ready": standing.ready,
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
        "adapters": adapter_entries(engine),
        "runtime_adapters": runtime_adapters(engine),
        "sampler": engine.admission.sampler.describe(),
        "queue_depth": scheduler.depth,
        # A fleet on one PostgreSQL store: this server's name (H3_SERVER_ID), its lease and heartbeat; null alone.
        "fleet": scheduler.fleet.describe() if scheduler.fleet is not None else None,
        # ... and which server holds which job in progress ({job id: server id}, this server's included); null alone,
        # or while the database does not answer (then `ready` is false and `problem` says why).
        "fleet_jobs": fleet_jobs(scheduler),
        "num_gpus": engine.num_gpus,
        # Several hosts: each node, its ranks, whether it has joined (and why it was lost); null on one host.
        "nodes": engine.nodes,
        # Where the weights live (`pipeline.placement`): what streams from page-locked host memory, the largest
        # request the device memory admits.
        "placement": engine.placement.as_dict(),
        "problem": standing.problem,
        # {name: why} for each folder the service cannot write now (output_dir, videos, temp): names, not paths,
        # since /health answers without a key; the log has the paths.
        "unwritable_folders": standing.unwritable,
        "version": __version__,
    }


def fleet_jobs(scheduler: Scheduler) -> dict[str, str] | None:
    """{job id: the server that holds it} for the fleet's jobs in progress; None without a fleet or a database."""
    if scheduler.fleet is None:
        return None
    try:
        return scheduler.fleet.holders()
    except StoreUnreachable:
        return None


# ---- the web page: no key (its files hold nothing private; what it does, it does through the routes below) --------
# Not in the schema: the schema describes the API, and the page is one of its clients.
page_routes = APIRouter(dependencies=[Depends(strict_query)], include_in_schema=False)


@page_routes.get("/")
@page_routes.head("/")  # a load balancer's or uptime probe's HEAD / answers as GET / does, without the body
async def page(request: Request) -> Response:
    return request.app.state.page.response(INDEX)


@page_routes.get("/web/{name}")
async def page_file(request: Request, name: str) -> Response:
    return request.app.state.page.response(name)  # a 404 for any name but the page's own files


# ---- authenticated routes -------------------------------------------------------------------------------------------
routes = APIRouter(dependencies=[Depends(require_key), Depends(strict_query)])


@routes.get("/openapi.json", include_in_schema=False)
def openapi(request: Request, settings: SettingsDep) -> dict[str, Any]:
    if not settings.api_schema:
        raise ApiError(404, "not_found", "the OpenAPI schema is off on this server (H3_API_SCHEMA)")
    return request.app.openapi()


@routes.get("/ready")
@routes.head("/ready", include_in_schema=False)
def ready(scheduler: SchedulerDep) -> JSONResponse:
    scheduler.look_at_store()
    standing = scheduler.standing()  # one look at the folders for the status and the body alike
    body = {"ready": standing.ready, "readiness": scheduler.readiness.value,
            "problem": None if standing.ready else standing.problem}  # fmt: skip
    return JSONResponse(body, status_code=200 if standing.ready else 503)


@routes.get("/metrics")
def metrics_text(metrics: MetricsDep) -> Response:
    return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


@routes.get("/v1/models")
def models(settings: SettingsDep, engine: EngineDep) -> dict[str, Any]:
    entry = {
        "id": settings.model_id,
        "object": "model",
        "owned_by": "h3serve",
        "tasks": list(engine.tasks),
        "adapters": adapter_entries(engine),
        "runtime_adapters": runtime_adapters(engine),
        "limits": request_limits(engine, settings.max_prompt_chars, settings.max_upload_mb),
    }
    return {"object": "list", "data": [entry]}


def _require_ready(scheduler: Scheduler, metrics: Metrics) -> None:
    standing = scheduler.standing()
    if standing.ready:
        return
    if scheduler.readiness.value == "failed":
        error = scheduler.warmup_result.error if scheduler.warmup_result else "unknown"
        message = f"the startup warmup failed ({error}); this server does not render (see /health)"
    elif scheduler.readiness.value == "ready":
        message = f"the server cannot render now: {standing.problem or 'see /health'}; retry later"
    else:
        message = "the server is warming up (the startup warmup has not passed yet); retry shortly"
    metrics.rejected.labels("not_ready").inc()
    raise ApiError(503, "not_ready", message, None, {"Retry-After": RETRY_AFTER_S})


async def _parse(
    request: Request, settings: Settings, engine: RenderEngine, scheduler: Scheduler, metrics: Metrics
) -> tuple[VideoCreateRequest, RenderRequest]:
    _require_ready(scheduler, metrics)
    # The body cap counts the files a request to this server can carry: 2 keyframes, or 12 Ref2VA references when the
    # Ref2VA DiT is loaded, each up to H3_MAX_UPLOAD_MB, plus the form fields.
    body_files = MAX_REFERENCES if REF2VA in engine.tasks else MAX_KEYFRAMES
    limits = BodyLimits(settings.max_upload_mb << 20, body_files, float(settings.body_timeout))
    try:
        body = await read_body(request, limits)
        previews = PreviewRule(settings.preview_every, settings.preview_min_every)
        terms = ServerTerms.of(engine, settings.model_id, settings.max_prompt_chars, previews)
        admitting = functools.partial(admit, body.fields, body.uploads, engine, terms)
        return await asyncio.get_running_loop().run_in_executor(request.app.state.decoder, admitting)
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
    asked, render_request = await _parse(request, settings, engine, scheduler, metrics)
    if render_request.preview_every:
        if "preview_every" in asked.model_fields_set:  # not the server's default
            raise bad_request(
                "preview_every",
                "previews come with async jobs (POST /v1/videos, then GET /v1/videos/{id}/events); a sync render "
                "answers only when it is done: send preview_every 0 or leave it out",
            )
        render_request = dataclasses.replace(render_request, preview_every=0)
    work = Work(new_job_id(), render_request, persist=False)
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
    except WriteFailed as err:  # the scheduler has logged the OS error with the path
        raise ApiError(500, "write_failed", str(err), None, {"x-request-id": work.id}) from err
    except NodeLost as err:  # several hosts: a node was lost mid-render (its name and rank only)
        message = f"the render failed: {err}; the server renders again when the node joins again"
        raise ApiError(
            503, "node_lost", message, None, {"x-request-id": work.id, "Retry-After": RETRY_AFTER_S}
        ) from err
    except Exception as err:  # the scheduler has logged it with its traceback, under this id
        raise internal_error("render_failed", "the render failed", work.id) from err
    result = work.result
    stages = {k: round(v, 4) for k, v in result.timings.items() if k != "total"}
    headers = {
        "x-request-id": work.id,
        "x-inference-time-s": f"{result.timings['total']:.4f}",
        "x-peak-memory-mb": f"{result.peak_memory_mb:.1f}",
        "x-num-gpus": str(max(1, len(result.split))),
        "X-Stage-Durations": json.dumps(stages, separators=(",", ":")),
        "x-seed": str(render_request.seed),
        "x-num-frames": str(render_request.num_frames),
        "x-num-inference-steps": str(render_request.steps),
        "x-flow-shift": f"{render_request.video_shift:g}",
        "x-audio-flow-shift": f"{render_request.audio_shift:g}",
        **step_cache_headers(result.step_cache, render_request.quality),
        **adapter_headers(render_request),
    }
    return Response(mp4, media_type="video/mp4", headers=headers)


@routes.post("/v1/videos")
async def create_job(
    request: Request, settings: SettingsDep, engine: EngineDep, scheduler: SchedulerDep, metrics: MetricsDep
) -> dict[str, Any]:
    _, render_request = await _parse(request, settings, engine, scheduler, metrics)
    record = job_record(new_job_id(), render_request, settings.model_id)
    await _submit(scheduler, metrics, Work(record.id, render_request, persist=True), record)
    return shown_record(record, scheduler.live(), {} if scheduler.fleet is not None else None)


@routes.get("/v1/videos")
def list_jobs(
    store: StoreDep,
    scheduler: SchedulerDep,
    limit: int = 20,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """Jobs by creation time: newest first (order=desc, the default) or oldest first (asc); `after` continues from
    the job of that id in the same order."""
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request("limit", f"limit must be 1..{MAX_PAGE}, got {limit}")
    if after is not None and store.entry(after) is None:
        raise bad_request("after", f"after: no job {shown(after)}")
    jobs, more = store.list(limit, after, oldest_first=order == "asc")
    live, holders = scheduler.live(), _holders(scheduler, [j.id for j in jobs])
    data = [shown_record(j, live, holders) for j in jobs]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}


def _find(store: JobRecords, video_id: str) -> VideoJob:
    job = store.get(video_id)
    if job is None:
        raise ApiError(404, "not_found", f"no video job {shown(video_id)}", "video_id")
    return job


@routes.get("/v1/videos/{video_id}")
def get_job(store: StoreDep, scheduler: SchedulerDep, video_id: str) -> dict[str, Any]:
    job = store.entry(video_id)  # a record that does not decode is shown as damaged, as in the list
    if job is None:
        raise ApiError(404, "not_found", f"no video job {shown(video_id)}", "video_id")
    return shown_record(job, scheduler.live(), _holders(scheduler, [job.id]))


def _holders(scheduler: Scheduler, job_ids: list[str]) -> dict[str, str] | None:
    """In a fleet, the server that holds (or last held, and rendered) each job, for its record's `server_id`."""
    return scheduler.fleet.holders(job_ids) if scheduler.fleet is not None else None


@routes.get("/v1/videos/{video_id}/content")
def content(
    request: Request,
    store: StoreDep,
    scheduler: SchedulerDep,
    settings: SettingsDep,
    video_id: str,
    variant: str = "video",
) -> Response:
    """The MP4, from where it is kept (`store.objects`: videos/, or H3_OUTPUT_URL's bucket): whole (200), or the one
    byte range a `Range: bytes=...` header asks for (206 with Content-Range; 416 for a range past its end; If-Range
    honoured); with H3_S3_PRESIGN, a 307 to the object's URL signed for that many seconds.

    It is opened before the answer starts: a file is streamed from a descriptor opened here, which survives a DELETE
    that unlinks it (POSIX), so a download answered 200 always sends its whole Content-Length (Starlette's FileResponse
    would check the path here and open it later, after a racing DELETE: a 500, or a 200 header and no body); an object
    is read from a GET begun here, so one deleted before is a 410, never a 200 without its body."""
    if variant != "video":
        raise bad_request(
            "variant", f"variant {shown(variant)} is not kept here: a job has only its MP4 (variant=video)"
        )
    job = _find(store, video_id)
    if job.status != JobStatus.COMPLETED or not job.file_name:
        raise ApiError(409, "not_completed", f"job {video_id} is {job.status}; only a completed job has content")
    outputs, name = scheduler.outputs, job.file_name
    try:
        opened = outputs.open(name)
    except (ObjectGone, FileNotFoundError, NotADirectoryError, IsADirectoryError):
        _elsewhere(scheduler, video_id)
        _gone(store, video_id)
    except ObjectsUnavailable as err:
        raise _unavailable(video_id, "read", err) from None
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.EINVAL, errno.ENXIO):
            raise  # out of descriptors, a permission: the server's trouble (a 500), not a file gone for good
        # A link, a FIFO, a device where the MP4 was: nothing the server wrote.
        log.warning("job %s: %s in %s is not a regular file; not served", video_id, name, outputs.where)
        _gone(store, video_id)
    try:
        if outputs.remote and settings.s3_presign:
            url = outputs.presign(name, settings.s3_presign)  # signed: never the bucket's bare URL
            return Response(status_code=307, headers={"location": url, "cache-control": "no-store"})
        span = byte_range(request.headers.get("range"), request.headers.get("if-range"), opened.size, opened.etag)
        start, length = span if span is not None else (0, opened.size)
        body = opened.body(start, length)
    except ObjectGone:
        opened.close()
        _gone(store, video_id)
    except ObjectsUnavailable as err:
        opened.close()
        raise _unavailable(video_id, "read", err) from None
    except BaseException:
        opened.close()
        raise
    return MP4Response(body, name, opened.size, opened.etag, span)


def _elsewhere(scheduler: Scheduler, video_id: str) -> None:
    """A fleet without shared storage (H3_OUTPUT_URL unset): a job another server rendered has its MP4 in that
    server's folder. 421 Misdirected Request (RFC 9110: this server cannot answer for it), naming the server in the
    message and in `X-H3-Server-Id`, rather than a 410 that says the MP4 is gone when it is not."""
    fleet = scheduler.fleet
    if fleet is None or scheduler.outputs.remote:
        return
    holder = fleet.holders([video_id]).get(video_id)
    if holder is None or holder == fleet.server_id:
        return
    message = (
        f"the MP4 of job {video_id} is in the output folder of server {holder!r}, which rendered it; this server "
        f"({fleet.server_id}) keeps only its own MP4s, the fleet having no shared storage (H3_OUTPUT_URL unset). "
        f"Download it from {holder!r}, or set H3_OUTPUT_URL on every server"
    )
    raise ApiError(421, "on_another_server", message, "video_id", {"X-H3-Server-Id": holder})


def _gone(store: JobRecords, video_id: str) -> NoReturn:
    """A completed job's MP4 that is not there: 404 if its record went too (a DELETE drops the MP4 and the record),
    else 410."""
    _find(store, video_id)
    raise ApiError(410, "gone", f"the MP4 of job {video_id} is no longer stored", "video_id") from None


def _unavailable(video_id: str, doing: str, err: ObjectsUnavailable, outcome: str = "") -> ApiError:
    """A 503 for an MP4 the output bucket (H3_OUTPUT_URL) would not let be `doing` (read, removed) now."""
    log.error("job %s: the output bucket did not let its MP4 be %s: %s", video_id, doing, err.reason)
    message = f"the MP4 of job {video_id} could not be {doing} in the output bucket ({err.reason}){outcome}; retry"
    return ApiError(503, "storage_unavailable", message, None, {"Retry-After": RETRY_AFTER_S})


BYTE_RANGE = re.compile(r"bytes=([0-9]{0,19})-([0-9]{0,19})")  # one range; 19 digits hold any size there is


def byte_range(header: str | None, if_range: str | None, size: int, etag: str) -> tuple[int, int] | None:
    """(start, length) of the one byte range a Range header asks for, cut at the MP4's end; None to send it whole: no
    header, an If-Range naming another version than `etag`, several ranges, another unit or a malformed one (RFC 9110
    lets a server ignore those). ApiError 416 (Content-Range: bytes */SIZE) for a range that starts past the end."""
    if not header or (if_range is not None and if_range.strip() != etag):
        return None
    found = BYTE_RANGE.fullmatch(header.strip())
    if found is None or found.groups() == ("", ""):
        return None
    first, last = found.groups()
    if not first:  # bytes=-N: the last N bytes
        start, end = max(0, size - int(last)), size - 1
        if int(last) == 0 or size == 0:
            raise _unsatisfiable(header, size)
    else:
        start, end = int(first), min(int(last) if last else size - 1, size - 1)
        if last and int(last) < start:
            return None  # malformed: ignored
        if start >= size:
            raise _unsatisfiable(header, size)
    return start, end - start + 1


def _unsatisfiable(header: str, size: int) -> ApiError:
    message = f"Range {shown(header)} lies past the MP4's end ({size} bytes)"
    return ApiError(416, "range_not_satisfiable", message, "Range", {"content-range": f"bytes */{size}"})


class MP4Response(Response):
    """A stored MP4 (`Opened.body`), whole or one byte range of it (`span`: (start, length), a 206), streamed in chunks
    off the event loop; its length is fixed before the first byte goes. The body is closed when the response ends,
    however it ends."""

    chunk_size = 1 << 20
    media_type = "video/mp4"

    def __init__(self, body: Body, filename: str, size: int, etag: str, span: tuple[int, int] | None = None):
        self.fh = body
        start, length = span if span is not None else (0, size)
        headers = {
            "content-length": str(length),
            "content-disposition": f'attachment; filename="{filename}"',  # a server-chosen name: <id>.mp4
            "accept-ranges": "bytes",
        }
        if etag:
            headers["etag"] = etag
        if span is not None:
            headers["content-range"] = f"bytes {start}-{start + length - 1}/{size}"
        super().__init__(content=None, status_code=206 if span is not None else 200, media_type=self.media_type,
                         headers=headers)  # fmt: skip
        self.size = length

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if scope["method"] == "HEAD":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            left = self.size
            if left == 0:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            while left > 0:
                chunk = await asyncio.to_thread(self.fh.read, min(self.chunk_size, left))
                if not chunk:  # a file truncated in place under an open fd, an object's GET cut short
                    raise OSError(f"the MP4 ended {left} bytes short of its length")
                left -= len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
        finally:
            self.fh.close()

    def __del__(self) -> None:  # a response built and never sent (an exception in between): its body still closes
        fh = getattr(self, "fh", None)
        if fh is not None:
            fh.close()


KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing a quiet stream
EVENT_ID = re.compile(r"[0-9]{1,20}")  # what Last-Event-ID may be: an event id, in ASCII digits


@routes.get("/v1/videos/{video_id}/events")
async def events(request: Request, store: StoreDep, scheduler: SchedulerDep, video_id: str) -> Response:
    """The job's events as `text/event-stream` (`service.events`): queued, stage, progress, preview, then completed,
    failed or cancelled, each with its id; `Last-Event-ID` resumes after the event it names. A job whose events this
    server no longer holds (finished long ago, or before a restart) gets one event from its record: how it ended, or
    where it is. The stream ends after the end event; a client that goes away costs nothing. At most MAX_STREAMS are
    open at once (429 past it); each waits for its job's next event, woken by the publish (`events.Streams`).

    In a fleet, a job another server holds (or held) is streamed from the events its holder stored, with the same ids
    (`_stored_events`), woken by the fleet's notice; the stream switches to this server's own log when this server
    claims the job, and back to the stored events if it loses the claim. It ends with the job's end as the holder's
    does; a job that ended with no stored end (its holder killed between its record and its relay) gets one event
    from its record, found at the next keep-alive."""
    job = _find(store, video_id)
    header = request.headers.get("last-event-id", "").strip()  # latin-1 as Starlette reads it: no byte is lost
    if header and not EVENT_ID.fullmatch(header):
        message = (
            "Last-Event-ID must be an event id: a non-negative integer of 1 to 20 ASCII digits (0-9), "
            f"got {shown(header)}"
        )
        raise bad_request("Last-Event-ID", message)
    last = int(header) if header else 0
    log = scheduler.events.log(video_id)
    streams: Streams = request.app.state.streams
    signal = streams.claim(video_id)
    if signal is None:
        raise ApiError(
            429,
            "too_many_streams",
            f"this server holds at most {streams.limit} open event streams (MAX_STREAMS) and all are open; close one, "
            f"or poll GET /v1/videos/{video_id}, and retry",
            None,
            {"Retry-After": RETRY_AFTER_S},
        )

    fleet = scheduler.fleet

    async def stream():
        nonlocal last
        if log is None and fleet is None:
            name = str(job.status) if job.status not in ACTIVE else "status"
            yield Event(last + 1, name, shown_record(job, scheduler.live())).wire
            return
        look = True  # whether the stored events' reader also looks at the record (first, then at each keep-alive)
        while True:
            signal.clear()  # before the read: a publish after it sets the signal again, so none is missed
            # In a fleet this server may claim the job, or lose it, meanwhile: its log is looked for each time.
            here = scheduler.events.log(video_id) if fleet is not None else log
            if here is not None:
                fresh, ended = here.since(last)
            else:
                fresh, ended = await asyncio.to_thread(_stored_events, scheduler, store, video_id, last, look)
            look = False
            if fresh:
                yield "".join(event.wire for event in fresh)  # one write for what came since the last
                last = fresh[-1].id
            if ended:
                return
            try:
                await asyncio.wait_for(signal.wait(), KEEPALIVE_S)
            except TimeoutError:
                look = True
                yield ": keep-alive\n\n"

    return EventStream(stream(), streams, video_id)


def _stored_events(
    scheduler: Scheduler, store: JobRecords, video_id: str, last: int, look: bool
) -> tuple[list[Event], bool]:
    """A fleet job's stored events after `last` up to its end, and whether the stream ends. With nothing new and
    `look`: the record too. A job deleted ends the stream; one ended with no stored end (its holder killed between its
    record and its events, or a job never of the fleet's queue) gets one event from its record, as a job without a
    log does. While the database does not answer: nothing yet (the stream waits, and reads again)."""
    fleet = scheduler.fleet
    try:
        fresh = []
        for stored in fleet.events_since(video_id, last):
            fresh.append(Event(stored.id, stored.name, stored.data))
            if stored.name in TERMINAL:
                return fresh, True
        if fresh or not look:
            return fresh, False
        job = store.entry(video_id)
        if job is None:
            return [], True  # deleted
        if job.status in ACTIVE:
            return [], False
        if any(e.name in TERMINAL for e in fleet.events_since(video_id, 0)):
            return [], True  # its end was before `last`: this client has it
        name = str(job.status) if job.status != "damaged" else "status"
        record = shown_record(job, {}, _holders(scheduler, [video_id]))
        return [Event(last + 1, name, record)], True
    except StoreUnreachable:
        return [], False


class EventStream(StreamingResponse):
    """An event stream that gives its place in `Streams` back when it ends, however it ends (the end event, the
    client gone: Starlette cancels the stream when the server reports the disconnect)."""

    def __init__(self, content, streams: Streams, job_id: str):
        super().__init__(content, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})  # fmt: skip
        self.streams, self.job_id, self.released = streams, job_id, False

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.release()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.streams.release(self.job_id)

    def __del__(self) -> None:  # built and never sent (an exception in between): its place still goes back, on the
        if not getattr(self, "released", True):  # loop (the collector may run this on any thread)
            self.released = True
            self.streams.release_soon(self.job_id)


@routes.get("/v1/videos/{video_id}/preview")
def preview(store: StoreDep, scheduler: SchedulerDep, video_id: str, forward: int | None = None) -> Response:
    """The job's latest preview (a PNG strip: `pipeline.preview`), kept until the job is deleted. `forward` (what a
    preview event's URL carries, so each event's URL is its own) is accepted and not checked: the latest one is sent."""
    job = _find(store, video_id)
    png = scheduler.events.preview(video_id)
    if png is None and scheduler.fleet is not None:  # rendered by another server: as its holder relayed it
        png = scheduler.fleet.preview(video_id)
    if png is None:
        asked = "asked for previews" if job.preview_every else "asked for none (preview_every)"
        raise ApiError(404, "no_preview", f"job {video_id} has no preview (yet): it {asked}", "video_id")
    return Response(png, media_type="image/png", headers={"cache-control": "no-store"})


@routes.delete("/v1/videos/{video_id}", responses={202: {"description": "cancel requested; the job has not stopped"}})
def delete(store: StoreDep, scheduler: SchedulerDep, video_id: str) -> Response:
    """A finished job: its record and MP4 go (200, `video.deleted`; with H3_OUTPUT_URL the object first, and a bucket
    that does not answer is a 503 with nothing deleted). An unfinished one is cancelled, and the answer
    waits until it has stopped (a render stops within one denoise step or decode window, an encode before its next
    frame): 200 with the record, now `cancelled`. Only a job still not stopped after CANCEL_WAIT_S (a GPU worker that
    does not answer) is a 202 with the record as it is then; its cancel stands, and a later GET shows the end."""
    job = _find(store, video_id)
    if job.status in ACTIVE:
        scheduler.cancel(video_id, "cancelled by DELETE /v1/videos/{id}", wait=CANCEL_WAIT_S)
        job = _find(store, video_id)
        holders = _holders(scheduler, [video_id])
        if job.status in ACTIVE:
            return JSONResponse(shown_record(job, scheduler.live(), holders), status_code=202)
        if job.status == JobStatus.CANCELLED:
            if scheduler.outputs.remote:
                _drop_object(scheduler, job.id)
            return JSONResponse(shown_record(job, scheduler.live(), holders))
    if scheduler.outputs.remote:
        # The object first, then the record: a DELETE stopped between them (or refused by the bucket: a 503, nothing
        # deleted) can be sent again, where the record gone first would leave an object nothing names. The job's own
        # key whatever its record says: a job failed after its upload completed (a stop in between) has one too.
        try:
            scheduler.outputs.delete(f"{job.id}.mp4")
        except ObjectsUnavailable as err:
            raise _unavailable(video_id, "removed", err, "; nothing was deleted") from None
    store.delete(video_id)
    scheduler.events.forget(video_id)
    return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})


def _drop_object(scheduler: Scheduler, job_id: str) -> None:
    """A cancelled fleet job's object, if any: one that a holder killed after its upload completed and before its
    record was written left under the job's key (the job was then queued again, and cancelled before another server
    completed it), which no completed record would ever name. A bucket that does not answer now is logged; the record
    stays `cancelled`, and its DELETE (which removes the job's key whatever its record says) can be sent again."""
    try:
        scheduler.outputs.delete(f"{job_id}.mp4")
    except ObjectsUnavailable as err:
        log.warning("job %s: cancelled; its key in the output bucket could not be checked for an MP4 a killed holder "
                    "left (%s): DELETE it again to remove it", job_id, err.reason)  # fmt: skip


def shown_record(
    job: VideoJob | DamagedRecord, live: dict[str, dict[str, Any]], holders: dict[str, str] | None = None
) -> dict[str, Any]:
    """A job record as the API shows it: the stored fields, and `live` (`Scheduler.live`: where an unfinished job is
    now, its stage and step; null once its record says it has finished, even while the scheduler still lets go of
    it). In a fleet (`holders` given: `Fleet.holders`), `server_id`: the server that holds the job, or held it last
    and rendered it (its MP4 is in that server's folder without H3_OUTPUT_URL); null while it waits in the queue."""
    shown = {**job.model_dump(), "live": live.get(job.id) if job.status in ACTIVE else None}
    if holders is not None:
        shown["server_id"] = holders.get(job.id)
    return shown


def trained_sampler(preset) -> dict[str, Any] | None:
    """The sampler an adapter's preset gives (`checkpoint.adapters.Preset`), as /health and /v1/models list it; None
    where the file says none."""
    if preset is None:
        return None
    return {
        "num_inference_steps": preset.points,
        "flow_shift": preset.video_shift,
        "audio_flow_shift": preset.audio_shift,
        "sigma_positions": list(preset.sigmas) if preset.sigmas else None,
        "tasks": list(preset.tasks) if preset.tasks else None,
    }


def adapter_entries(engine: RenderEngine) -> list[dict[str, Any]]:
    """The merged adapters as /health and /v1/models list them: file, format, scale, and the sampler it was trained
    for where known."""
    return [
        {"file": a.path.name, "format": a.format, "scale": a.scale, "trained": trained_sampler(a.preset)}
        for a in engine.adapters
    ]


def runtime_adapters(engine: RenderEngine) -> dict[str, Any]:
    """The adapters a request may apply at run time (H3_ADAPTERS), as /health and /v1/models list them: how many one
    request may apply at once, and each by the name a request gives, its file, format, default scale, distinct ranks,
    the DiT it was trained for and the sampler its preset gives (where the file says), its factors' GiB, and whether
    the host cache holds it now (null where the engine's processes each hold their own: a split render's)."""
    catalog = engine.admission.catalog
    library = getattr(engine, "library", None)  # `parallel.workers.ParallelEngine`'s workers hold theirs
    held = set(library.held) if library is not None else None
    return {
        "max_active": catalog.max_active,
        "adapters": [
            {
                "name": entry.name,
                "file": entry.path.name,
                "format": entry.adapter.format,
                "scale": entry.scale,
                "ranks": list(entry.adapter.ranks),
                "dit_kind": entry.dit_kind,
                "trained": trained_sampler(entry.preset),
                "gib": round(entry.nbytes / 2**30, 6),
                "held": None if held is None else entry.name in held,
            }
            for entry in catalog.entries.values()
        ],
    }


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


def adapter_headers(request: RenderRequest) -> dict[str, str]:
    """A sync render's run-time adapters: `X-H3-Adapters` names each as NAME:SCALE in the request's order
    (`turbo:1,style:0.5`); absent when the render applied none. Declared names are header-safe (letters, digits, '.',
    '_', '-': `settings.parse_adapter_setting`)."""
    if not request.adapters:
        return {}
    return {"X-H3-Adapters": ",".join(f"{name}:{scale:g}" for name, scale in request.adapters)}
