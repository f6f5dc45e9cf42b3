"""The fleet's claims (issue 58, step 2): several servers on one PostgreSQL store share one queue. What a queued job
needs of the server that renders it (`Needs`, stored on its claim row at submit), what a server can render
(`Capabilities`, compared with them in the claim's SQL), the request as stored so that any server can render it again
(`encode_request`, `decode_request`), a claim held (`Claim`) and `Fleet`, the scheduler's view of it all.

Across the fleet (item 4 of issue 58): the events of a held job that the holder relays (`Relayed`, `StoredEvent`), the
notices servers send each other (`Notice`: events stored, a cancel for a job's holder, a job deleted) and
`StoreUnreachable`, what any call raises while the database does not answer (the store reconnects by itself).

The request is stored whole and already validated (the keyframes' and references' decoded pixels and samples, the
sampler the admitting server filled in), so a claiming server renders the same request the submitting server admitted:
same seed, same profile, the same bytes. Its codec is an `.npz` of plain arrays (no pickle: `allow_pickle=False`), the
scalar fields as one JSON entry.
"""

from __future__ import annotations

import enum
import io
import json
import math
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from PIL import Image

from h3serve.pipeline.layout import MediaGeometry, build_ref2va_layout
from h3serve.pipeline.references import DecodedReference, reference_descriptors
from h3serve.pipeline.request import RenderRequest
from h3serve.service.schemas import JobError, JobStatus, VideoJob
from h3serve.vocab import ReferenceKind, Task

if TYPE_CHECKING:
    from h3serve.pipeline.engine import RenderEngine
    from h3serve.settings import Settings

CODEC_VERSION = 1
_META = "meta"
_SCALARS = ("prompt", "width", "height", "num_frames", "steps", "seed", "video_shift", "audio_shift", "quality",
            "preview_every")  # fmt: skip
_REFERENCE_SCALARS = ("index", "source_size", "source_fps", "source_frames", "source_sample_rate",
                      "source_channels", "name")  # fmt: skip


class QueueLimit(Exception):
    """The fleet's queue holds `limit` jobs waiting already (a 429 for the client): nothing was written."""

    def __init__(self, limit: int):
        super().__init__(f"the fleet's queue holds {limit} waiting jobs")
        self.limit = limit


class StoreUnreachable(Exception):
    """The fleet's database does not answer now (stopped, restarted, the network): nothing was written by the call
    that raised it, unless `unknown` (the connection was lost while a commit was on its way: it may have been made).
    `where`: the store as shown (no password); `reason`: the driver's words. The store reconnects at its next use."""

    def __init__(self, where: str, reason: str, unknown: bool = False):
        super().__init__(f"the job store {where} does not answer ({reason})")
        self.where, self.reason, self.unknown = where, reason, unknown


class LeaseLost(Exception):
    """A write for a job whose claim this server no longer holds (its lease ran out and another server claimed it
    again, or the job was deleted): refused, nothing was written. `job_id`: which."""

    def __init__(self, job_id: str):
        super().__init__(f"job {job_id}: this server no longer holds its claim (its lease ran out, or it was deleted)")
        self.job_id = job_id


def new_server_id() -> str:
    """A server's name when H3_SERVER_ID is unset: the host's name (cut to the allowed characters) and 8 random hex
    digits, new at each start."""
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())[:40] or "h3serve"
    return f"{host}-{uuid.uuid4().hex[:8]}"


# ---- what a job needs, and what a server can do -------------------------------------------------------------------
@dataclass(frozen=True)
class Needs:
    """What a queued job asks of its renderer, stored on its claim row. `build`: the server build it was admitted by
    (model, profile, merged adapters, step cache, ranks: what decides its bytes), which the renderer's must equal;
    `task` one the renderer serves; `adapters` the run-time adapters it applies, each declared by the renderer;
    `rows` its packed rows, within the renderer's memory plan."""

    build: str
    task: str
    adapters: tuple[str, ...]
    rows: int


@dataclass(frozen=True)
class Capabilities:
    """What a server can render (`Needs` it meets), from its settings and its loaded engine (`of`)."""

    build: str
    tasks: tuple[str, ...]
    adapters: tuple[str, ...]
    max_rows: int

    @classmethod
    def of(cls, settings: Settings, engine: RenderEngine) -> Capabilities:
        admission = engine.admission
        build = {
            "model": settings.model_id,
            "profile": {k: str(v) for k, v in vars(engine.profile).items() if k != "device"},
            "device": engine.profile.device.split(":")[0],  # which CUDA card is no difference in the bytes
            "merged": [[a.path.name, a.scale] for a in engine.adapters],
            # The config as data: the same options written with other spacing are the same build.
            "step_cache": [str(settings.cache_backend), json.loads(settings.cache_config or "null")],
            "ranks": admission.ranks,
        }
        return cls(
            build=json.dumps(build, sort_keys=True, separators=(",", ":")),
            tasks=tuple(str(t) for t in engine.tasks),
            adapters=tuple(admission.catalog.names),
            max_rows=admission.row_limit,
        )

    def needs(self, request: RenderRequest, engine: RenderEngine) -> Needs:
        """A request's needs, as this (its admitting) server states them."""
        return Needs(
            self.build, str(request.task), tuple(n for n, _ in request.adapters), request_rows(request, engine)
        )

    def takes(self, needs: Needs) -> bool:
        """Whether a server of these capabilities may claim a job of these needs (the claim's SQL says the same)."""
        return (
            needs.build == self.build
            and needs.task in self.tasks
            and set(needs.adapters) <= set(self.adapters)
            and needs.rows <= self.max_rows
        )


def request_rows(request: RenderRequest, engine: RenderEngine) -> int:
    """Packed rows of a request's media (its prompt's apart), as the memory plan counts them
    (`Admission.check_memory`, `Admission.check_rows`)."""
    admission = engine.admission
    if request.task != Task.REF2VA:
        return admission.media_rows(request.task, request.width, request.height, request.num_frames)
    geometry = MediaGeometry.from_pixels(request.height, request.width, request.num_frames)
    blocks = reference_descriptors(request.references)
    layout = build_ref2va_layout([], blocks, geometry, patch_size=admission.dit_config.patch_size)
    return int(
        layout.num_reference_video_rows
        + layout.num_reference_audio_rows
        + layout.num_video_rows
        + layout.num_audio_rows
    )


# ---- the request as stored --------------------------------------------------------------------------------------
def encode_request(request: RenderRequest) -> bytes:
    """A validated request as bytes: the scalars as JSON, the keyframes' RGB pixels and the references' pixels and
    samples as arrays. Nothing a client sent is kept beyond what the render reads."""
    arrays: dict[str, np.ndarray] = {}
    for i, image in enumerate(request.keyframes):
        arrays[f"keyframe_{i}"] = np.asarray(image.convert("RGB"), dtype=np.uint8)  # (H, W, 3)
    references = []
    for i, ref in enumerate(request.references):
        for part in ("pixels", "audio"):
            value = getattr(ref, part)
            if value is not None:
                arrays[f"reference_{i}_{part}"] = np.ascontiguousarray(value)
        references.append({"kind": str(ref.kind), **{k: getattr(ref, k) for k in _REFERENCE_SCALARS}})
    meta = {
        "version": CODEC_VERSION,
        "task": str(request.task),
        **{k: getattr(request, k) for k in _SCALARS},
        "keyframes": len(request.keyframes),
        "references": references,
        "notices": list(request.notices),
        "positions": None if request.positions is None else list(request.positions),
        "adapters": [[name, scale] for name, scale in request.adapters],
    }
    arrays[_META] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def decode_request(blob: bytes) -> RenderRequest:
    """The request `encode_request` stored; ValueError when the bytes are not one (a damaged or foreign row)."""
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        meta = json.loads(arrays.pop(_META).tobytes().decode("utf-8"))
        if meta.get("version") != CODEC_VERSION:
            raise ValueError(f"codec version {meta.get('version')!r}, not {CODEC_VERSION}")
        keyframes = tuple(Image.fromarray(arrays[f"keyframe_{i}"], "RGB") for i in range(meta["keyframes"]))
        references = []
        for i, ref in enumerate(meta["references"]):
            scalars = {k: ref[k] for k in _REFERENCE_SCALARS}
            if scalars["source_size"] is not None:
                scalars["source_size"] = tuple(scalars["source_size"])
            references.append(
                DecodedReference(
                    kind=ReferenceKind(ref["kind"]),
                    pixels=arrays.get(f"reference_{i}_pixels"),
                    audio=arrays.get(f"reference_{i}_audio"),
                    **scalars,
                )
            )
        return RenderRequest(
            task=Task(meta["task"]),
            **{k: meta[k] for k in _SCALARS},
            keyframes=keyframes,
            references=tuple(references),
            notices=tuple(meta["notices"]),
            positions=None if meta["positions"] is None else tuple(meta["positions"]),
            adapters=tuple((name, float(scale)) for name, scale in meta["adapters"]),
        )
    except (OSError, KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
        raise ValueError(f"the stored request cannot be read ({type(err).__name__}: {err})") from err


# ---- a claim, and the fleet -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredEvent:
    """One event of a job as the fleet's database holds it (`postgres.PostgresJobStore.publish`): the id the
    rendering server gave it, its name and its data."""

    id: int
    name: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Relayed:
    """An event a holder relays to the fleet (`events.Relay`): the job and the claim's generation it was made under
    (a holder that lost the claim relays nothing more), the event, and a preview event's PNG."""

    job_id: str
    generation: int
    event: StoredEvent
    png: bytes | None = None


@dataclass(frozen=True)
class Claim:
    """A job this server holds: its id, the claim's `generation` (raised by every claim, so a write checked against
    it is refused once another server has claimed the job again), the request to render, and the job's events stored
    so far (`history`: its `queued`, and an earlier holder's), which its log here continues."""

    job_id: str
    generation: int
    request: RenderRequest
    history: tuple[StoredEvent, ...] = ()


@dataclass(frozen=True)
class Renewal:
    """A heartbeat's answer: the held jobs whose claims are gone (`lost`), and cancels asked for held ones by another
    server's DELETE ({job id: reason})."""

    lost: frozenset[str]
    cancels: dict[str, str]


class ClaimStore(Protocol):
    """What `Fleet` asks of the store (`postgres.PostgresJobStore`)."""

    server_id: str
    problem: str | None

    def register(self, capabilities: Capabilities, lease_s: float) -> None: ...

    def enqueue(
        self, job: VideoJob, request: bytes, needs: Needs, queued_at: float, limit: int, waiting: int
    ) -> None: ...

    def queued_count(self) -> int: ...

    def claim(
        self, capabilities: Capabilities, before: float, lease_s: float
    ) -> tuple[str, int, bytes, tuple[StoredEvent, ...]] | None: ...

    def renew(self, held: list[tuple[str, int]], lease_s: float) -> Renewal: ...

    def write_held(self, job_id: str, generation: int, ending: bool, **changes: Any) -> bool: ...

    def release(self, job_id: str, generation: int) -> bool: ...

    def cancel_queued(self, job_id: str, changes: dict[str, Any], reason: str) -> str | None: ...

    def fail_unreadable(self, job_id: str, generation: int, changes: dict[str, Any]) -> None: ...

    def queue(self) -> list[tuple[str, int]]: ...

    def publish(self, batch: list[Relayed]) -> None: ...

    def events_since(self, job_id: str, last: int) -> list[StoredEvent]: ...

    def preview(self, job_id: str) -> bytes | None: ...

    def holders(self, job_ids: list[str] | None = None) -> dict[str, str]: ...

    def probe(self) -> None: ...

    def listen(self, on_notice: Callable[[Notice], None], stop: threading.Event) -> None: ...


class Fleet:
    """This server in the fleet: its store's claims, its capabilities and its lease. The scheduler's one way to the
    shared queue (`scheduler.Scheduler`, when given one)."""

    def __init__(self, store: ClaimStore, capabilities: Capabilities, engine: RenderEngine, lease_s: float,
                 heartbeat_s: float):  # fmt: skip
        if not 0 < heartbeat_s <= lease_s / 2:
            raise ValueError(f"heartbeat_s must be within 0..lease_s/2 ({lease_s / 2:g}), got {heartbeat_s:g}")
        self.store, self.capabilities, self.engine = store, capabilities, engine
        self.lease_s, self.heartbeat_s = lease_s, heartbeat_s
        self.server_id = store.server_id
        store.register(capabilities, lease_s)

    @classmethod
    def of(cls, store: Any, settings: Settings, engine: RenderEngine) -> Fleet | None:
        """The fleet of a store that has claims (PostgreSQL's); None for one that has none (SQLite's: one server)."""
        if not hasattr(store, "claim"):
            return None
        return cls(store, Capabilities.of(settings, engine), engine, settings.lease, settings.heartbeat)

    def enqueue(self, job: VideoJob, request: RenderRequest, queued_at: float, limit: int, waiting: int) -> None:
        """Queue a job for the fleet: its record and its claim row (the stored request, its needs), in one
        transaction; QueueLimit when the fleet's queued jobs and this server's `waiting` sync renders reach `limit`."""
        needs = self.capabilities.needs(request, self.engine)
        self.store.enqueue(job, encode_request(request), needs, queued_at, limit, waiting)

    def claim(self, before: float = math.inf) -> Claim | None:
        """The oldest queued job (or one whose lease ran out) this server can render and that was queued before
        `before` (a waiting sync render's time), claimed with a new lease; None when there is none. A job whose stored
        request cannot be read is failed here, and the next one looked for."""
        while True:
            found = self.store.claim(self.capabilities, before, self.lease_s)
            if found is None:
                return None
            job_id, generation, blob, history = found
            try:
                return Claim(job_id, generation, decode_request(blob), history)
            except ValueError as err:
                error = JobError(code="unreadable_request", message=f"{err}; submit it again")
                self.store.fail_unreadable(job_id, generation, {"status": JobStatus.FAILED, "error": error})

    def queued(self) -> int:
        return self.store.queued_count()

    def queue(self) -> list[tuple[str, int]]:
        """The fleet's queued jobs in claim order, each with the number of live servers that can render it."""
        return self.store.queue()

    def renew(self, held: list[Claim]) -> Renewal:
        return self.store.renew([(c.job_id, c.generation) for c in held], self.lease_s)

    def write(self, claim: Claim, ending: bool, **changes: Any) -> None:
        """Write a held job's record; LeaseLost (nothing written) when this server no longer holds its claim."""
        if not self.store.write_held(claim.job_id, claim.generation, ending, **changes):
            raise LeaseLost(claim.job_id)

    def release(self, claim: Claim) -> bool:
        """Give a held job back to the queue (a shutdown): queued again for any server; False if no longer held."""
        return self.store.release(claim.job_id, claim.generation)

    def cancel(self, job_id: str, changes: dict[str, Any], reason: str) -> str | None:
        """A DELETE's cancel of a job this server does not hold: `cancelled` (it was queued: its record now says so,
        and its streams get the end), `held` (another server renders it: asked to stop by a notice at once, and at its
        next heartbeat should the notice be missed), or None (not active)."""
        return self.store.cancel_queued(job_id, changes, reason)

    def publish(self, batch: list[Relayed]) -> None:
        """Store relayed events for every server's streams (`events.Relay` calls this on its own thread)."""
        self.store.publish(batch)

    def events_since(self, job_id: str, last: int) -> list[StoredEvent]:
        """A job's stored events after the id `last`, in order."""
        return self.store.events_since(job_id, last)

    def preview(self, job_id: str) -> bytes | None:
        """A job's latest preview as its holder relayed it; None when there is none."""
        return self.store.preview(job_id)

    def holders(self, job_ids: list[str] | None = None) -> dict[str, str]:
        """{job id: the server that holds (or last held, and rendered) it}, for `job_ids`; None: the jobs held now."""
        return self.store.holders(job_ids)

    @property
    def problem(self) -> str | None:
        """Why the database does not answer now (the last call found it lost); None while it does."""
        return self.store.problem

    def probe(self) -> None:
        """One round trip to the database (reconnecting if the connection was lost); StoreUnreachable if it fails."""
        self.store.probe()

    def listen(self, on_notice: Callable[[Notice], None], stop: threading.Event) -> None:
        """Hand each fleet notice (an event stored, a cancel for this server, a job deleted) to `on_notice` until
        `stop` is set; reconnects by itself when the database goes away."""
        self.store.listen(on_notice, stop)

    def describe(self) -> dict[str, Any]:
        """What /health shows of this server in the fleet."""
        return {"server_id": self.server_id, "lease_s": self.lease_s, "heartbeat_s": self.heartbeat_s}


class NoticeKind(enum.StrEnum):
    """What a fleet notice (PostgreSQL NOTIFY, `postgres.CHANNELS`) says: a job's events were stored, a cancel for a
    job a server holds, a job deleted."""

    EVENTS = "events"
    CANCEL = "cancel"
    DELETED = "deleted"
    RECONNECTED = "reconnected"  # (not sent: the listener's own, after a gap in which notices may have been missed)


@dataclass(frozen=True)
class Notice:
    """One notice between the fleet's servers: its kind, the job, and for a cancel its holder and reason."""

    kind: NoticeKind
    job_id: str = ""
    server_id: str | None = None
    reason: str | None = None
