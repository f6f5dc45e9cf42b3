"""The processes of a render split over N GPUs: N spawned workers (rank r on cuda:r, or N gloo processes on the
CPU), kept by a `WorkerPool`, and `ParallelEngine`, the `RenderEngine` the CLI and the service use in the parent.

The parent owns the request: it validates it (with rank 0's admission), sends it to every rank, forwards rank 0's
progress, sets the shared cancel flag the ranks agree on, and gets the result from rank 0 (frames and audio through
shared memory). Every rank reports how its part of each render ended. A render that failed on every rank alike (a
refusal, non-finite latents) fails with that message and the workers stay. A rank that fails alone may leave the
others waiting in a collective: the parent does not wait for the group's timeout, it ends the render with that
rank's message, stops every worker and starts them again (`problem` says so meanwhile, and the service is not
ready). A worker that dies, in a render or idle, does the same; a restart that fails leaves `problem` set.

Over several hosts (`parallel.nodes`) this process is node 0's: it spawns its own GPUs' workers, the other nodes
spawn theirs (`NodeRanks`) when node 0's rendezvous starts the group, and their events come back over the nodes'
connections into the same queue. The commands reach rank 0 alone, which broadcasts each to every rank. A node lost
(its connection closed, or silent for H3_NODE_GRACE) counts as a dead worker: the render fails (`NodeLost`), and the
restart waits for the node to join again.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from h3serve.accel.profile import Profile
from h3serve.accel.stepcache import StepCacheConfig
from h3serve.checkpoint.adapters import Adapter
from h3serve.checkpoint.folder import ModelFolder
from h3serve.config import DiTConfig
from h3serve.parallel.group import Group, GroupStore, free_port
from h3serve.parallel.plan import check_split
from h3serve.parallel.ranks import AgreedContext, Ranks
from h3serve.pipeline.admission import Admission
from h3serve.pipeline.budget import Budget
from h3serve.pipeline.context import NodeLost, Progress, RenderCancelled, RenderContext
from h3serve.pipeline.engine import Engine, RenderResult
from h3serve.pipeline.placement import RESIDENT, Placement
from h3serve.pipeline.request import RenderRequest
from h3serve.pipeline.rules import RequestRules
from h3serve.vocab import TaskType

if TYPE_CHECKING:
    from h3serve.parallel.nodes import NodePlan, Rendezvous

log = logging.getLogger(__name__)

ERROR_GRACE_S = 5.0  # after one rank's error, how long the others may take to report theirs before a restart
POLL_S = 0.05


class WorkerError(RuntimeError):
    """A GPU worker failed (its rank and message); the render it was in did not finish. `input_error`: it failed on
    what it was given to load (a ValueError or OSError: the checkpoint, an adapter), not on the GPUs."""

    def __init__(self, rank: int, message: str, input_error: bool = False):
        super().__init__(f"GPU worker rank {rank}: {message}")
        self.rank = rank
        self.input_error = input_error


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker builds its engine from (picklable: it travels to the spawned processes)."""

    model: ModelFolder | None
    profile: Profile
    num_gpus: int
    task_type: str = TaskType.FL2VA
    step_cache: StepCacheConfig | None = None
    adapters: tuple[Adapter, ...] = ()
    timeout_s: float = 600.0  # a collective waiting longer than this fails (a rank that never comes)
    # CPU threads per gloo worker (None: the cores shared out). A CPU GEMM split over threads can round a row
    # differently with the row count, so the CPU renders are the one-process render's bits at one thread each.
    cpu_threads: int | None = None
    setup: Callable[[Engine, int], None] | None = None  # run in each worker after its load (tests inject faults)
    # Builds the engine instead of a load from `model` (benchmarks: full-size random weights drawn on each GPU), and
    # the config of the DiT it builds, which the split is checked against (without it: the tiny model's).
    build: Callable[[Profile], Engine] | None = None
    build_config: DiTConfig | None = None
    placement: Placement = RESIDENT  # what each rank keeps in host memory and streams (its own copy)
    nnodes: int = 1  # hosts the ranks are spread over (`parallel.nodes`), num_gpus on each

    @property
    def world(self) -> int:
        return self.num_gpus * self.nnodes


def load_engine(
    model: str | Path | ModelFolder | None,
    profile: Profile,
    *,
    task_type: str = TaskType.FL2VA,
    step_cache: StepCacheConfig | None = None,
    adapters: Sequence[Adapter] = (),
    num_gpus: int = 1,
    timeout_s: float = 600.0,
    placement: Placement = RESIDENT,
    nodes: NodePlan | None = None,
) -> Engine | ParallelEngine:
    """`Engine.load` for one GPU (or the CPU), else a `ParallelEngine` of `num_gpus` workers (on each of `nodes`:
    this is node 0, whose rendezvous the other nodes join)."""
    nnodes = 1 if nodes is None else nodes.nnodes
    if num_gpus * nnodes == 1:
        return Engine.load(
            model, profile, task_type=task_type, step_cache=step_cache, adapters=adapters, placement=placement
        )
    from h3serve.checkpoint.folder import resolve_model_folder

    folder = model if model is None or isinstance(model, ModelFolder) else resolve_model_folder(model)
    spec = WorkerSpec(folder, profile, num_gpus, task_type, step_cache, tuple(adapters), timeout_s, placement=placement,
                      nnodes=nnodes)  # fmt: skip
    if nodes is None:
        return ParallelEngine(spec)
    from h3serve.parallel.nodes import Rendezvous

    rendezvous = Rendezvous(nodes)
    try:
        return ParallelEngine(spec, rendezvous)
    except BaseException:
        rendezvous.close()
        raise


class ParallelEngine:
    """A `RenderEngine` whose renders run split over `spec.num_gpus` worker processes (`WorkerPool`); what it tells
    of itself (name, tasks, admission, memory) is rank 0's engine's, as it described itself at start."""

    def __init__(self, spec: WorkerSpec, rendezvous: Rendezvous | None = None):
        from h3serve.model.tiny import TINY_DIT

        check_split(spec.model.dit if spec.model is not None else spec.build_config or TINY_DIT, spec.profile,
                    spec.world)  # fmt: skip
        self.spec = spec
        self.profile = spec.profile
        self.placement = spec.placement
        self.pool = WorkerPool(spec, rendezvous)

    @property
    def num_gpus(self) -> int:
        """GPUs one render runs on: every node's."""
        return self.spec.world

    @property
    def recovering(self) -> bool:
        return self.pool.recovering

    @property
    def nodes(self) -> list[dict[str, Any]] | None:
        """Each node, its ranks and whether it has joined (several hosts), else None."""
        return None if self.pool.rendezvous is None else self.pool.rendezvous.status()

    @property
    def problem(self) -> str | None:
        """Why renders cannot run now (a worker lost, the workers restarting), or None."""
        return self.pool.problem

    @property
    def name(self) -> str:
        return self.pool.info["name"]

    @property
    def admission(self) -> Admission:
        return self.pool.info["admission"]

    @property
    def rules(self) -> RequestRules:
        return self.pool.info["rules"]

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        return self.pool.info["adapters"]

    @property
    def merge_seconds(self) -> float:
        return self.pool.info["merge_seconds"]

    @property
    def tasks(self) -> tuple[str, ...]:
        return self.admission.tasks

    def validate(self, prompt: str, **fields: Any) -> RenderRequest:
        return self.admission.validate(prompt, **fields)

    def memory_budget(self) -> Budget:
        """Rank 0's memory as the plan counts it: what each GPU holds."""
        return self.pool.info["budget"]

    def render(
        self,
        request: RenderRequest,
        ctx: RenderContext | None = None,
        on_step: Callable[[int, int], None] | None = None,
    ) -> RenderResult:
        """`Engine.render` over the workers: progress and `on_step` from rank 0, a cancel reaches every rank at its
        next check point; a failed rank's message is raised as WorkerError. A `ctx.frames_to` gets the audio and
        then the frames whole when the render ends (rank 0's come through shared memory, not window by window)."""
        ctx = ctx or RenderContext()
        payload = self.pool.run("render", request, ctx, on_step)[0]
        frames = payload["frames"].numpy()
        if ctx.frames_to is not None:
            ctx.frames_to.begin(payload["audio"].numpy(), payload["sample_rate"], payload["fps"], request.width,
                                request.height)  # fmt: skip
            ctx.frames_to.put(frames)
            frames = None
        return RenderResult(
            frames=frames,
            audio=payload["audio"].numpy(),
            sample_rate=payload["sample_rate"],
            fps=payload["fps"],
            request=request,
            timings=payload["timings"],
            peak_memory_mb=payload["peak_memory_mb"],
            step_cache=payload["step_cache"],
            split=tuple(payload["split"]),
        )

    def prepare_tables(self) -> float:
        return self.pool.run("tables", None, RenderContext(), None)[0]

    def close(self) -> None:
        self.pool.close()


class WorkerPool:
    """The worker processes of a split: spawned (rank r on cuda:r, or gloo processes on the CPU), watched, and
    started again after a failure that may have left them out of step. One command at a time (a lock), whoever
    calls."""

    def __init__(self, spec: WorkerSpec, rendezvous: Rendezvous | None = None):
        self.spec = spec
        self.num_gpus = spec.num_gpus  # this node's
        self.world = spec.world  # every node's
        self.rendezvous = rendezvous
        self.lock = threading.Lock()
        self.problem: str | None = None
        self.info: dict[str, Any] = {}  # rank 0's engine as it described itself at its last start
        self.procs: list[Any] = []
        self._seq = 0
        self._closed = False
        self._restarting: str | None = None  # why, while the workers restart
        self._start(first=True)
        self._monitor = threading.Thread(target=self._watch, name="h3serve-gpu-workers", daemon=True)
        self._monitor.start()
        atexit.register(self.close)

    @property
    def recovering(self) -> bool:
        """The workers are restarting (or waiting for a node to join again); False once up, or once a restart failed."""
        return self._restarting is not None

    def run(self, kind: str, payload: Any, ctx: RenderContext, on_step) -> dict[int, Any]:
        """Send a command to every rank and wait for every rank's outcome; each rank's result by rank. At once while
        the workers restart (the restart holds the lock)."""
        self._usable()
        with self.lock:
            self._usable()
            return self._run(kind, payload, ctx, on_step)

    def close(self) -> None:
        """Stop every worker: a render in progress is cancelled at its next check point; they are killed after a
        few seconds."""
        if self._closed:
            return
        self._closed = True
        self._cancel.set()
        for commands in self._commands if self.rendezvous is None else self._commands[:1]:
            commands.put(("stop", 0, None))  # with several nodes rank 0 passes it on to every rank
        self._stop_workers(wait=10.0)
        if self.rendezvous is not None:
            self.rendezvous.close()

    def _start(self, first: bool = False) -> None:
        """Start this node's workers (with several nodes: once every node has joined, for `H3_NODE_TIMEOUT` at the
        first start and for as long as it takes at a restart) and wait until every rank of every node is ready."""
        spawn = mp.get_context("spawn")
        self._events = spawn.Queue()
        self._cancel = spawn.Event()
        self._commands = [spawn.Queue() for _ in range(self.num_gpus)]
        store, port = None, 0
        if self.rendezvous is not None:
            self.rendezvous.wait_joined(self.rendezvous.plan.timeout_s if first else None, self._waiting)
            store = self.rendezvous.start(self._events.put)
        else:
            port = free_port()
        procs = [
            spawn.Process(target=_worker, name=f"h3serve-rank{rank}",
                          args=(rank, rank, self.spec, port, store, self._commands[rank], self._events, self._cancel))
            for rank in range(self.num_gpus)
        ]  # fmt: skip
        for proc in procs:
            proc.start()
        self.procs = procs  # all started: the watcher and `_next_event` may look at them
        ready: set[int] = set()
        try:
            while len(ready) < self.world:
                event = self._next_event()
                if event is None:
                    continue
                kind, rank, payload = event[0], event[1], event[2]
                if kind == "failed":
                    message, input_error = payload
                    raise WorkerError(rank, f"failed to start: {message}", input_error)
                if kind == "ready":
                    ready.add(rank)
                    if rank == 0:
                        self.info = payload
        except BaseException:  # one failed or died (or Ctrl-C): none may be left running
            self._stop_workers(wait=2.0)
            raise
        nodes = f" of {self.world} on {self.spec.nnodes} nodes" if self.rendezvous is not None else ""
        log.info("%d GPU workers%s ready (pids %s)", self.num_gpus, nodes, ", ".join(str(p.pid) for p in self.procs))

    def _waiting(self, text: str) -> None:
        """While the nodes are awaited: in the log, and in `problem` during a restart."""
        log.warning("waiting for the nodes: %s", text)
        if self._restarting is not None:
            self.problem = f"restarting the GPU workers: {self._restarting}; {text}"

    def _next_event(self) -> tuple | None:
        """The next event from the workers; None after POLL_S without one. A dead worker raises WorkerError."""
        try:
            event = self._events.get(timeout=POLL_S)
        except queue.Empty:
            event = None
        if event is not None and event[0] == "dead":  # a joined node's worker
            raise WorkerError(event[1], event[2])
        if event is not None:
            return event
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                raise WorkerError(rank, f"the process (pid {proc.pid}) exited with {_exit_text(proc.exitcode)}")
        if self.rendezvous is not None and (lost := self.rendezvous.problem()) is not None:
            raise lost
        return None

    def _run(self, kind: str, payload: Any, ctx: RenderContext, on_step) -> dict[int, Any]:
        """Send a command to every rank and wait for every rank's outcome; the lead's result by rank."""
        self._seq += 1
        seq = self._seq
        self._cancel.clear()
        for commands in self._commands if self.rendezvous is None else self._commands[:1]:
            commands.put((kind, seq, payload))  # with several nodes rank 0 broadcasts it to every rank
        outcomes: dict[int, tuple[str, Any]] = {}
        first_error: tuple[int, str] | None = None
        calls: set[int] = set()  # the collective count of each failed rank
        grace_end = None
        while len(outcomes) < self.world:
            if ctx.cancelled:
                self._cancel.set()
            try:
                event = self._next_event()
            except (WorkerError, NodeLost) as err:
                self._restart(str(err))
                raise
            if event is None:
                if grace_end is not None and time.monotonic() > grace_end:
                    rank, message = first_error
                    self._restart(f"rank {rank} failed alone: {message}")
                    raise WorkerError(rank, message)
                continue
            if event[0] == "progress" and event[1] == seq:
                progress = Progress(*event[2:])
                if ctx.on_progress is not None:
                    ctx.on_progress(progress)
                if on_step is not None and progress.stage == "denoise" and progress.done:
                    on_step(progress.done, progress.total)
            elif event[0] == "outcome" and event[1] == seq:
                _, _, rank, what, result = event
                if what == "error":
                    result, count = result
                    calls.add(count)
                    if first_error is None:
                        first_error, grace_end = (rank, result), time.monotonic() + ERROR_GRACE_S
                outcomes[rank] = (what, result)
        if first_error is not None:
            # Every rank ended the render. Failed at one collective count, they are in step (a refusal, non-finite
            # latents, rank 0's stage failing: the others raise after agreeing on it); else some rank has a
            # collective in flight that the next command would meet, so the workers start afresh.
            rank, message = (0, outcomes[0][1]) if outcomes[0][0] == "error" else first_error
            if len(calls) > 1 or any(what != "error" for what, _ in outcomes.values()):
                self._restart(f"rank {rank} failed out of step with the others: {message}")
            raise WorkerError(rank, message)
        if any(what == "cancelled" for what, _ in outcomes.values()):
            raise RenderCancelled(ctx.reason or "cancelled")
        return {rank: result for rank, (_, result) in outcomes.items()}

    def _usable(self) -> None:
        if self.problem is not None:
            raise RuntimeError(self.problem)

    def _restart(self, reason: str) -> None:
        """Stop every worker now and start them again in the background; `problem` says why until they are up."""
        log.error("GPU workers: %s; restarting them", reason)
        self.problem = f"restarting the GPU workers: {reason}"
        self._restarting = reason
        self._stop_workers(wait=1.0)
        if self.rendezvous is not None:
            self.rendezvous.stop()
        threading.Thread(target=self._restart_workers, args=(reason,), name="h3serve-gpu-restart", daemon=True).start()

    def _restart_workers(self, reason: str) -> None:
        with self.lock:
            if self._closed:
                return
            try:
                self._start()
                if self._closed:  # closed while they started
                    self._stop_workers(wait=2.0)
                    return
                self._run("tables", None, RenderContext(), None)
            except Exception as err:
                self._restarting = None
                self.problem = f"the GPU workers did not restart after {reason}: {err}"
                log.error("%s", self.problem)
                return
            self.problem = self._restarting = None
            log.info("GPU workers restarted")

    def _watch(self) -> None:
        """Notice a worker that dies while no render runs (a render notices it itself)."""
        while not self._closed:
            sentinels = [p.sentinel for p in self.procs]
            multiprocessing.connection.wait(sentinels, timeout=1.0)
            if self._closed or self.problem is not None or not self.lock.acquire(blocking=False):
                time.sleep(POLL_S)
                continue
            try:
                for rank, proc in enumerate(self.procs):
                    if proc.exitcode is not None and self.problem is None:
                        self._restart(f"rank {rank} (pid {proc.pid}) exited with {_exit_text(proc.exitcode)}")
                lost = None if self.rendezvous is None else self.rendezvous.problem()
                if lost is not None and self.problem is None:
                    self._restart(str(lost))
            finally:
                self.lock.release()

    def _stop_workers(self, wait: float) -> None:
        for q in (self._events, *self._commands):  # unread messages must not hold up this process's exit
            q.cancel_join_thread()
        deadline = time.monotonic() + wait
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join(5.0)


def _exit_text(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


def _message(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _worker(
    rank: int, local: int, spec: WorkerSpec, port: int, store: GroupStore | None, commands, events, cancel
) -> None:
    """One rank (`local`: its GPU on this host): join the group (at `127.0.0.1:port`, or at node 0's `store` with
    several nodes), load, then run commands until told to stop (or the parent is gone). With several nodes the
    commands reach rank 0 only, which broadcasts each to every rank, and a tick each TICK_S while idle (a rank waits
    in that broadcast, which fails with the group's timeout)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops the workers
    parent = mp.parent_process()
    try:
        profile = spec.profile
        device = torch.device("cpu")
        if not profile.cuda:
            if spec.cpu_threads or "OMP_NUM_THREADS" not in os.environ:  # else torch's own count, from that variable
                torch.set_num_threads(spec.cpu_threads or max(1, (os.cpu_count() or 1) // spec.num_gpus))
        else:
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
            profile = dataclasses.replace(profile, device=f"cuda:{local}")
        group = Group.join(rank, spec.world, port, device, spec.timeout_s, store)
        if spec.build is not None:
            engine = spec.build(profile)
        else:
            engine = Engine.load(
                spec.model,
                profile,
                task_type=spec.task_type,
                step_cache=spec.step_cache,
                adapters=spec.adapters,
                placement=spec.placement,
            )
        ranks = Ranks(group)
        ranks.install(engine)
        engine.spread = ranks
        if rank != 0:  # only rank 0 encodes the prompt (its states are broadcast): the others free the text encoder
            engine.components.text_encoder.to("meta")
            engine.offloaded.drop_text()  # and its layers' page-locked copies, where they streamed
        if spec.setup is not None:
            spec.setup(engine, rank)
        info = None
        if rank == 0:
            info = {
                "name": engine.name,
                "admission": engine.admission,
                "rules": engine.rules,
                "adapters": engine.adapters,
                "merge_seconds": engine.merge_seconds,
                "budget": engine.memory_budget(),
            }
        events.put(("ready", rank, info))
    except BaseException as err:  # every failure is the parent's to report
        events.put(("failed", rank, (_message(err), isinstance(err, ValueError | OSError))))
        log.debug("rank %d failed to start:\n%s", rank, traceback.format_exc())
        return
    while True:
        command = _next_command(group, store is not None, commands, parent)
        if command is None:
            continue
        kind, seq, payload = command
        if kind == "stop":
            break
        try:
            if kind == "render":

                def progress(p: Progress, seq: int = seq) -> None:
                    events.put(("progress", seq, p.stage, p.done, p.total))

                ctx = AgreedContext(group, cancel, progress if rank == 0 else None)
                result = engine.render(payload, ctx)
                out = _result_payload(result, ranks.sizes) if rank == 0 else None
            else:  # tables
                out = engine.prepare_tables()
        except RenderCancelled:
            events.put(("outcome", seq, rank, "cancelled", None))
        except Exception as err:  # reported; the parent decides whether the group is whole
            log.debug("rank %d:\n%s", rank, traceback.format_exc())
            if profile.cuda:
                torch.cuda.empty_cache()  # what the failed render held goes back (a cancel does this in the engine)
            events.put(("outcome", seq, rank, "error", (_message(err), group.calls)))
        else:
            events.put(("outcome", seq, rank, "done", out))
    group.leave()


TICK_S = 1.0


def _next_command(group: Group, broadcast: bool, commands, parent) -> tuple | None:
    """The next command (None: none yet). From the parent's queue; with several nodes rank 0 reads it and broadcasts
    it (or a tick) to every rank. A rank whose group broke (a node gone) exits: its parent or node sees it."""
    command = None
    if not broadcast or group.lead:
        try:
            command = commands.get(timeout=TICK_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                os._exit(0)
        if not broadcast:
            return command
    try:
        command = group.broadcast_object(command or ("tick", 0, None))
    except Exception as err:  # gloo/NCCL: a peer's connection closed, or the group's timeout
        log.error("rank %d: the group broke while idle (%s)", group.rank, _message(err))
        os._exit(3)
    return None if command[0] == "tick" else command


class NodeRanks:
    """A joined node's ranks for one start of the group (`parallel.nodes.join_node`): this node's GPUs, ranks
    `node * num_gpus` onward; their events, read by the node's loop and passed on to node 0."""

    def __init__(self, spec: WorkerSpec, node: int, store: GroupStore):
        spawn = mp.get_context("spawn")
        self._events = spawn.Queue()
        self._cancel = cancel = spawn.Event()  # never set: rank 0's cancel reaches every rank by the agreed check
        first = node * spec.num_gpus
        self.procs = [
            spawn.Process(target=_worker, name=f"h3serve-rank{first + local}",
                          args=(first + local, local, spec, 0, store, None, self._events, cancel))
            for local in range(spec.num_gpus)
        ]  # fmt: skip
        self.first, self.node = first, node
        for proc in self.procs:
            proc.start()
        log.info("node %d: ranks %d-%d started (pids %s)", node, first, first + spec.num_gpus - 1,
                 ", ".join(str(p.pid) for p in self.procs))  # fmt: skip

    def events(self) -> list[tuple]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def dead(self) -> tuple[int, str] | None:
        """A rank that failed (its process ended other than by a stop), and how."""
        for local, proc in enumerate(self.procs):
            if proc.exitcode not in (None, 0):
                text = f"the process (pid {proc.pid}) on node {self.node} exited with {_exit_text(proc.exitcode)}"
                return self.first + local, text
        return None

    def stop(self) -> None:
        """Stop them now: a stop may come while they wait in a collective that will never complete."""
        self._events.cancel_join_thread()
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join(5.0)


def _result_payload(result: RenderResult, sizes: list[int]) -> dict[str, Any]:
    """Rank 0's result for the parent: frames and audio as tensors (shared memory, not pickled bytes)."""
    return {
        "frames": torch.from_numpy(result.frames),
        "audio": torch.from_numpy(result.audio),
        "sample_rate": result.sample_rate,
        "fps": result.fps,
        "timings": result.timings,
        "peak_memory_mb": result.peak_memory_mb,
        "step_cache": result.step_cache,
        "split": list(sizes),
    }
