"""The processes of a render split over N GPUs: N spawned workers (rank r on cuda:r, or N gloo processes on the
CPU), each a `RankWorker`, kept by a `WorkerPool`, and `ParallelEngine`, the `RenderEngine` the CLI and the service
use in the parent. What they tell each other are `parallel.messages`.

The parent owns the request: it validates it (with rank 0's admission), sends it to every rank
(`pool.call("render", request)`, vLLM's `collective_rpc` shape), forwards rank 0's progress, sets the shared cancel
flag the ranks agree on, and gets the result from rank 0 (frames and audio through shared memory). Every rank reports
how its part of each call ended. A render that failed on every rank alike (a refusal, non-finite latents) fails with
that message and the workers stay. A rank that fails alone may leave the others waiting in a collective: the parent
does not wait for the group's timeout, it ends the render with that rank's message (after ERROR_GRACE_S for the
others' reports), stops every worker and starts them again (`problem` says so meanwhile, and the service is not
ready). A worker that dies, in a render or idle, does the same; a restart that fails leaves `problem` set.

Over several hosts (`parallel.nodes`) this process is node 0's: it spawns its own GPUs' workers, the other nodes
spawn theirs (`NodeRanks`) when node 0's rendezvous starts the group, and their events come back over the nodes'
connections into the same queue. The commands reach rank 0 alone, which broadcasts each to every rank. A node lost
counts as a dead worker: the render fails (`NodeLost`), and the restart waits for the node to join again.

Noticing a dead peer: four checks, each for what the others cannot see.
1. The pool looks at its peers (`WorkerPool._lost`): a worker of this host that exited (its exit code), a joined
   node's rank that exited (that node's own look at its processes, `NodeRanks.dead`, sent as `Dead`), a node the
   rendezvous lost. A call in flight looks between events (each POLL_S); the watcher thread looks while no call
   runs, woken by a worker's exit (its sentinel) or each second.
2. The nodes' heartbeats (`parallel.nodes`, BEAT_S both ways, lost after H3_NODE_GRACE): a host that is silent
   without closing its connection (stopped, its link down) has no exit code here and no closed socket.
3. A worker looks at its own peers while idle (`RankWorker._next_command`): its parent gone (the pool's process
   killed: nothing else would end a worker waiting for commands, and it would hold its GPU), and with several nodes
   the group broken under the idle broadcast (it exits with code 3, which check 1 sees on its host).
4. The group's timeout (`WorkerSpec.timeout_s`): a peer alive but stuck in a collective, or that never reaches it;
   the last bound on any wait inside the group, where the checks above see nothing wrong.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing.connection
import os
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
from h3serve.checkpoint.adapters.library import AdapterLibrary, Declaration
from h3serve.checkpoint.folder import ModelFolder
from h3serve.config import TINY_DIT, DiTConfig
from h3serve.parallel.group import Group, GroupStore, free_port
from h3serve.parallel.messages import (
    Call,
    Dead,
    Ended,
    EngineInfo,
    Failed,
    Mailbox,
    Message,
    Outcome,
    Progress,
    Ready,
    Stop,
    Tick,
    decode,
    encode,
)
from h3serve.parallel.plan import check_split
from h3serve.parallel.ranks import AgreedContext, Ranks
from h3serve.pipeline.admission import Admission
from h3serve.pipeline.budget import Budget
from h3serve.pipeline.context import NodeLost, RenderCancelled, RenderContext
from h3serve.pipeline.engine import Engine, RenderResult
from h3serve.pipeline.placement import RESIDENT, Placement
from h3serve.pipeline.request import RenderRequest, RequestFields
from h3serve.pipeline.rules import RequestRules
from h3serve.pipeline.spread import Spread
from h3serve.vocab import TaskType

if TYPE_CHECKING:
    from h3serve.parallel.nodes import NodePlan, Rendezvous

log = logging.getLogger(__name__)

ERROR_GRACE_S = 5.0  # after one rank's error, how long the others may take to report theirs before a restart
POLL_S = 0.05
TICK_S = 1.0  # an idle worker's wait for a command, between its looks at its parent (and, over nodes, rank 0's tick)


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
    placement: Placement = RESIDENT  # what each rank keeps in host memory and streams (its own copy)
    nnodes: int = 1  # hosts the ranks are spread over (`parallel.nodes`), num_gpus on each
    declaration: Declaration | None = None  # the run-time adapters: each rank opens its own library from it

    @property
    def world(self) -> int:
        return self.num_gpus * self.nnodes


@dataclass(frozen=True)
class RankPlace:
    """What one rank builds its engine for: its rank, its profile (on its own GPU) and its part of the split."""

    rank: int
    profile: Profile
    spread: Spread

    @property
    def keep_text_encoder(self) -> bool:
        """Only rank 0 encodes prompts (its states are broadcast): the others free the text encoder."""
        return self.rank == 0


# Builds one rank's engine: `load_rank_engine`, or a test's or benchmark's own (a module-level function: the spawned
# workers receive it by name).
EngineFactory = Callable[[WorkerSpec, RankPlace], Engine]


def load_rank_engine(spec: WorkerSpec, place: RankPlace) -> Engine:
    """`spec.model` loaded as this rank runs it (with its own library of the run-time adapters)."""
    library = None
    if spec.declaration is not None:
        library = spec.declaration.open(spec.model.dit if spec.model is not None else TINY_DIT, pin=place.profile.cuda)
    return Engine.load(spec.model, place.profile, task_type=spec.task_type, step_cache=spec.step_cache,
                       adapters=spec.adapters, placement=spec.placement, spread=place.spread,
                       keep_text_encoder=place.keep_text_encoder, library=library)  # fmt: skip


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
    library: AdapterLibrary | None = None,
) -> Engine | ParallelEngine:
    """`Engine.load` for one GPU (or the CPU), else a `ParallelEngine` of `num_gpus` workers (on each of `nodes`:
    this is node 0, whose rendezvous the other nodes join)."""
    nnodes = 1 if nodes is None else nodes.nnodes
    if num_gpus * nnodes == 1:
        return Engine.load(model, profile, task_type=task_type, step_cache=step_cache, adapters=adapters,
                           placement=placement, library=library)  # fmt: skip
    from h3serve.checkpoint.folder import resolve_model_folder

    folder = model if model is None or isinstance(model, ModelFolder) else resolve_model_folder(model)
    declaration = library.declaration if library is not None else None
    spec = WorkerSpec(folder, profile, num_gpus, task_type, step_cache, tuple(adapters), timeout_s, placement=placement,
                      nnodes=nnodes, declaration=declaration)  # fmt: skip
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
    of itself (name, tasks, admission, memory) is rank 0's engine's, as it described itself at start.
    `engine_factory` builds each rank's engine (tests and benchmarks pass their own); `dit_config` is the config of
    the DiT it builds, which the split is checked against (None: the model's, or the tiny model's)."""

    def __init__(
        self,
        spec: WorkerSpec,
        rendezvous: Rendezvous | None = None,
        *,
        engine_factory: EngineFactory = load_rank_engine,
        dit_config: DiTConfig | None = None,
    ):
        from h3serve.model.tiny import TINY_DIT

        check_split(dit_config or (spec.model.dit if spec.model is not None else TINY_DIT), spec.profile, spec.world)
        self.spec = spec
        self.profile = spec.profile
        self.placement = spec.placement
        self.pool = WorkerPool(spec, rendezvous, engine_factory)

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
        return self.pool.info.name

    @property
    def admission(self) -> Admission:
        return self.pool.info.admission

    @property
    def rules(self) -> RequestRules:
        return self.pool.info.rules

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        return self.pool.info.adapters

    @property
    def merge_seconds(self) -> float:
        return self.pool.info.merge_seconds

    @property
    def tasks(self) -> tuple[str, ...]:
        return self.admission.tasks

    def validate(self, fields: RequestFields) -> RenderRequest:
        return self.admission.validate(fields)

    def memory_budget(self) -> Budget:
        """Rank 0's memory as the plan counts it: what each GPU holds."""
        return self.pool.info.budget

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
        payload = self.pool.call("render", request, ctx=ctx, on_step=on_step)
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
        return self.pool.call("prepare_tables")

    def close(self) -> None:
        self.pool.close()


class WorkerPool:
    """The worker processes of a split: spawned (rank r on cuda:r, or gloo processes on the CPU), watched, and
    started again after a failure that may have left them out of step. One call at a time (a lock), whoever calls."""

    def __init__(self, spec: WorkerSpec, rendezvous: Rendezvous | None = None,
                 engine_factory: EngineFactory = load_rank_engine):  # fmt: skip
        self.spec = spec
        self.num_gpus = spec.num_gpus  # this node's
        self.world = spec.world  # every node's
        self.rendezvous = rendezvous
        self.engine_factory = engine_factory
        self.lock = threading.Lock()
        self.problem: str | None = None
        self.info: EngineInfo  # rank 0's engine as it described itself at its last start
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

    def call(self, method: str, *args: Any, ctx: RenderContext | None = None, on_step=None) -> Any:
        """Run `method` of every rank's `RankWorker` with `args` and wait for every rank's outcome; rank 0's result.
        At once while the workers restart (the restart holds the lock)."""
        self._usable()
        with self.lock:
            self._usable()
            return self._call(method, args, ctx or RenderContext(), on_step)

    def close(self) -> None:
        """Stop every worker: a render in progress is cancelled at its next check point; they are killed after a
        few seconds."""
        if self._closed:
            return
        self._closed = True
        self._cancel.set()
        for commands in self._commands if self.rendezvous is None else self._commands[:1]:
            commands.put(Stop())  # with several nodes rank 0 passes it on to every rank
        self._stop_workers(wait=10.0)
        if self.rendezvous is not None:
            self.rendezvous.close()

    def _start(self, first: bool = False) -> None:
        """Start this node's workers (with several nodes: once every node has joined, for `H3_NODE_TIMEOUT` at the
        first start and for as long as it takes at a restart) and wait until every rank of every node is ready."""
        spawn = mp.get_context("spawn")
        self._events = Mailbox(spawn)
        self._cancel = spawn.Event()
        self._commands = [Mailbox(spawn) for _ in range(self.num_gpus)]
        store, port = None, 0
        if self.rendezvous is not None:
            self.rendezvous.wait_joined(self.rendezvous.plan.timeout_s if first else None, self._waiting)
            store = self.rendezvous.start(self._events.put)
        else:
            port = free_port()
        procs = [
            spawn.Process(target=_rank_main, name=f"h3serve-rank{rank}",
                          args=(rank, rank, self.spec, self.engine_factory, port, store, self._commands[rank],
                                self._events, self._cancel))
            for rank in range(self.num_gpus)
        ]  # fmt: skip
        for proc in procs:
            proc.start()
        self.procs = procs  # all started: the watcher and `_next_event` may look at them
        ready: set[int] = set()
        try:
            while len(ready) < self.world:
                event = self._next_event()
                if isinstance(event, Failed):
                    raise WorkerError(event.rank, f"failed to start: {event.message}", event.input_error)
                if isinstance(event, Ready):
                    ready.add(event.rank)
                    if event.info is not None:  # rank 0's
                        self.info = event.info
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

    def _next_event(self) -> Message | None:
        """The next event from the workers; None after POLL_S without one. A dead peer (check 1) raises WorkerError
        or NodeLost."""
        event = self._events.get(timeout=POLL_S)
        if isinstance(event, Dead):  # a joined node's worker
            raise WorkerError(event.rank, event.text)
        if event is None and (lost := self._lost()) is not None:
            raise lost
        return event

    def _lost(self) -> WorkerError | NodeLost | None:
        """Check 1 of the module's: a worker of this host that exited, or a node the rendezvous lost."""
        if (exited := _exited(self.procs)) is not None:
            rank, proc = exited
            return WorkerError(rank, f"the process (pid {proc.pid}) exited with {_exit_text(proc.exitcode)}")
        return None if self.rendezvous is None else self.rendezvous.problem()

    def _call(self, method: str, args: tuple, ctx: RenderContext, on_step) -> Any:
        """Send a call to every rank and wait for every rank's outcome; rank 0's result."""
        self._seq += 1
        seq = self._seq
        self._cancel.clear()
        for commands in self._commands if self.rendezvous is None else self._commands[:1]:
            commands.put(Call(seq, method, args))  # with several nodes rank 0 broadcasts it to every rank
        outcomes: dict[int, Outcome] = {}
        first_error: Outcome | None = None
        grace_end = 0.0
        while len(outcomes) < self.world:
            if ctx.cancelled:
                self._cancel.set()
            try:
                event = self._next_event()
            except (WorkerError, NodeLost) as err:
                self._restart(str(err))
                raise
            if isinstance(event, Progress) and event.seq == seq:
                progress = event.stage_progress()
                if ctx.on_progress is not None:
                    ctx.on_progress(progress)
                if on_step is not None and progress.stage == "denoise" and progress.done:
                    on_step(progress.done, progress.total)
            elif isinstance(event, Outcome) and event.seq == seq:
                outcomes[event.rank] = event
                if event.ended is Ended.ERROR and first_error is None:
                    first_error, grace_end = event, time.monotonic() + ERROR_GRACE_S
            elif event is None and first_error is not None and time.monotonic() > grace_end:
                self._restart(f"rank {first_error.rank} failed alone: {first_error.error}")
                raise WorkerError(first_error.rank, first_error.error or "")
        return self._ended(outcomes, first_error, ctx)

    def _ended(self, outcomes: dict[int, Outcome], first_error: Outcome | None, ctx: RenderContext) -> Any:
        """Every rank ended the call: rank 0's result, or the error or the cancel it ended with."""
        if first_error is not None:
            # Failed at one collective count, the ranks are in step (a refusal, non-finite latents, rank 0's stage
            # failing: the others raise after agreeing on it); else some rank has a collective in flight that the
            # next call would meet, so the workers start afresh.
            failed = outcomes[0] if outcomes[0].ended is Ended.ERROR else first_error
            calls = {o.calls for o in outcomes.values() if o.ended is Ended.ERROR}
            if len(calls) > 1 or any(o.ended is not Ended.ERROR for o in outcomes.values()):
                self._restart(f"rank {failed.rank} failed out of step with the others: {failed.error}")
            raise WorkerError(failed.rank, failed.error or "")
        if any(o.ended is Ended.CANCELLED for o in outcomes.values()):
            raise RenderCancelled(ctx.reason or "cancelled")
        return outcomes[0].result

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
                self._call("prepare_tables", (), RenderContext(), None)
            except Exception as err:
                self._restarting = None
                self.problem = f"the GPU workers did not restart after {reason}: {err}"
                log.error("%s", self.problem)
                return
            self.problem = self._restarting = None
            log.info("GPU workers restarted")

    def _watch(self) -> None:
        """Check 1 while no call runs (a call in flight makes it itself): woken by a worker's exit, or each second."""
        while not self._closed:
            multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=1.0)
            if self._closed or self.problem is not None or not self.lock.acquire(blocking=False):
                time.sleep(POLL_S)
                continue
            try:
                if (exited := _exited(self.procs)) is not None:
                    rank, proc = exited
                    self._restart(f"rank {rank} (pid {proc.pid}) exited with {_exit_text(proc.exitcode)}")
                elif (lost := self._lost()) is not None:  # a node
                    self._restart(str(lost))
            finally:
                self.lock.release()

    def _stop_workers(self, wait: float) -> None:
        for mailbox in (self._events, *self._commands):  # unread messages must not hold up this process's exit
            mailbox.cancel_join_thread()
        deadline = time.monotonic() + wait
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join(5.0)


class RankWorker:
    """One rank, in its process: it joins the group and builds its engine (`load`), then runs the calls the pool
    makes of every rank by name (`CALLS`) until told to `stop`; each call's `Outcome` goes to `events`. With several
    nodes the commands reach rank 0 only, which broadcasts each to every rank (`_next_command`)."""

    CALLS = frozenset({"render", "prepare_tables"})

    def __init__(self, rank: int, local: int, spec: WorkerSpec, events: Mailbox, cancel: Any):
        self.rank, self.local, self.spec = rank, local, spec  # `local`: its GPU on this host
        self.events, self.cancel = events, cancel
        self.seq = 0  # the call being answered: its progress is tagged with it

    def load(self, port: int, store: GroupStore | None, factory: EngineFactory) -> Ready:
        """Join the group (at `127.0.0.1:port`, or at node 0's `store` with several nodes) and build the engine."""
        spec, profile, device = self.spec, self.spec.profile, torch.device("cpu")
        if not profile.cuda:
            if spec.cpu_threads or "OMP_NUM_THREADS" not in os.environ:  # else torch's own count, from that variable
                torch.set_num_threads(spec.cpu_threads or max(1, (os.cpu_count() or 1) // spec.num_gpus))
        else:
            device = torch.device("cuda", self.local)
            torch.cuda.set_device(device)
            profile = dataclasses.replace(profile, device=f"cuda:{self.local}")
        self.broadcast = store is not None
        self.group = Group.join(self.rank, spec.world, port, device, spec.timeout_s, store)
        self.ranks = Ranks(self.group)
        self.engine = factory(spec, RankPlace(self.rank, profile, self.ranks))
        self.ranks.install(self.engine)  # the split swaps the loaded DiTs' attention kernels (gpt-fast's tp shape)
        return Ready(self.rank, EngineInfo.of(self.engine) if self.group.lead else None)

    def render(self, request: RenderRequest) -> dict[str, Any] | None:
        """This rank's part of the render; rank 0's result, for the parent (`_result_payload`)."""

        def progress(p, seq: int = self.seq) -> None:
            self.events.put(Progress(seq, p.stage, p.done, p.total))

        ctx = AgreedContext(self.group, self.cancel, progress if self.group.lead else None)
        result = self.engine.render(request, ctx)
        return _result_payload(result, self.ranks.sizes) if self.group.lead else None

    def prepare_tables(self) -> float:
        return self.engine.prepare_tables()

    def stop(self) -> None:
        self.group.leave()

    def serve(self, commands: Mailbox | None) -> None:
        """Answer calls until a Stop (`commands`: None on a rank that takes them from rank 0's broadcast)."""
        while not isinstance(command := self._next_command(commands), Stop):
            if isinstance(command, Call):
                self.events.put(self._answer(command))
        self.stop()

    def _answer(self, call: Call) -> Outcome:
        self.seq = call.seq
        try:
            if call.method not in self.CALLS:
                raise ValueError(f"no call {call.method!r} (one of {', '.join(sorted(self.CALLS))})")
            result = getattr(self, call.method)(*call.args)
        except RenderCancelled:
            return Outcome(call.seq, self.rank, Ended.CANCELLED)
        except Exception as err:  # reported; the parent decides whether the group is whole
            log.debug("rank %d:\n%s", self.rank, traceback.format_exc())
            if self.spec.profile.cuda:
                torch.cuda.empty_cache()  # what the failed render held goes back (a cancel does this in the engine)
            return Outcome(call.seq, self.rank, Ended.ERROR, _message(err), self.group.calls)
        return Outcome(call.seq, self.rank, Ended.DONE, result=result if self.group.lead else None)

    def _next_command(self, commands: Mailbox | None) -> Message:
        """The next command, a Tick when none came within TICK_S. From the pool's queue; with several nodes rank 0
        reads it and broadcasts it (or the Tick) to every rank. Check 3 of the module's: a worker whose parent is
        gone, or whose group broke while idle, exits."""
        command: Message = Tick()
        if not self.broadcast or self.group.lead:
            assert commands is not None
            command = commands.get(timeout=TICK_S) or Tick()
            parent = mp.parent_process()
            if isinstance(command, Tick) and parent is not None and not parent.is_alive():
                os._exit(0)
            if not self.broadcast:
                return command
        try:
            sent = self.group.broadcast_object(encode(command, local=True))
        except Exception as err:  # gloo/NCCL: a peer's connection closed, or the group's timeout
            log.error("rank %d: the group broke while idle (%s)", self.rank, _message(err))
            os._exit(3)
        return decode(sent, local=True)


def _rank_main(rank: int, local: int, spec: WorkerSpec, factory: EngineFactory, port: int, store: GroupStore | None,
               commands: Mailbox | None, events: Mailbox, cancel: Any) -> None:  # fmt: skip
    """A rank's process: load and say so (or why not: every failure is the parent's to report), then serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops the workers
    worker = RankWorker(rank, local, spec, events, cancel)
    try:
        events.put(worker.load(port, store, factory))
    except BaseException as err:
        events.put(Failed(rank, _message(err), isinstance(err, ValueError | OSError)))
        log.debug("rank %d failed to start:\n%s", rank, traceback.format_exc())
        return
    worker.serve(commands)


class NodeRanks:
    """A joined node's ranks for one start of the group (`parallel.nodes.join_node`): this node's GPUs, ranks
    `node * num_gpus` onward; their events, read by the node's loop and passed on to node 0."""

    def __init__(self, spec: WorkerSpec, node: int, store: GroupStore,
                 engine_factory: EngineFactory = load_rank_engine):  # fmt: skip
        spawn = mp.get_context("spawn")
        self._events = Mailbox(spawn)
        # Never set: rank 0's cancel reaches every rank by the agreed check. Held here: the children open its
        # semaphore after their start, and it goes with the last reference.
        self._cancel = cancel = spawn.Event()
        first = node * spec.num_gpus
        self.procs = [
            spawn.Process(target=_rank_main, name=f"h3serve-rank{first + local}",
                          args=(first + local, local, spec, engine_factory, 0, store, None, self._events, cancel))
            for local in range(spec.num_gpus)
        ]  # fmt: skip
        self.first, self.node = first, node
        for proc in self.procs:
            proc.start()
        log.info("node %d: ranks %d-%d started (pids %s)", node, first, first + spec.num_gpus - 1,
                 ", ".join(str(p.pid) for p in self.procs))  # fmt: skip

    def events(self) -> list[Message]:
        out = []
        while (event := self._events.get(timeout=0)) is not None:
            out.append(event)
        return out

    def dead(self) -> Dead | None:
        """A rank that failed (its process ended other than by a stop), and how: check 1 of the module's, here."""
        exited = _exited(self.procs, stopped_ok=True)
        if exited is None:
            return None
        local, proc = exited
        text = f"the process (pid {proc.pid}) on node {self.node} exited with {_exit_text(proc.exitcode)}"
        return Dead(self.first + local, text)

    def stop(self) -> None:
        """Stop them now: a stop may come while they wait in a collective that will never complete."""
        self._events.cancel_join_thread()
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join(5.0)


def _exited(procs: list[Any], stopped_ok: bool = False) -> tuple[int, Any] | None:
    """The first of `procs` (its index, it) that has exited (`stopped_ok`: other than with code 0, a stop's)."""
    for i, proc in enumerate(procs):
        if proc.exitcode is not None and not (stopped_ok and proc.exitcode == 0):
            return i, proc
    return None


def _exit_text(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


def _message(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


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
