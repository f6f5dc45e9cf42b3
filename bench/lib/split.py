"""DiT forwards split over N processes (Ulysses sequence parallelism, `h3serve.parallel`) at one packed shape, for
`dit_step.py --num-gpus` and the multi-GPU tests: N spawned processes (rank r on cuda:r over NCCL, or gloo
processes on the CPU), each building the same DiT from seed 0, each running the engine's per-step callable for the
shape (`Ranks.bind`, or the one-GPU `sampling.bind_model` for a plain group of one) under every profile asked for.

Per profile and rank: the first call's time (compile happens there), the median of `iters` forwards after `warmup`
(CUDA events, the ranks lined up by a barrier before each), peak memory, and with `comm` one forward under
torch.profiler: the kernel time in NCCL collectives by kind, and the GPU's idle time in the forward (its span minus
the union of its kernels). Compiled profiles run one more forward at a second text length (`other_text` rows), which
must not recompile. Rank 0 returns the forward's outputs (float32 NumPy arrays), so that the caller can compare
them with a group of one's.
"""

from __future__ import annotations

import contextlib
import os
import queue
import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from h3serve.accel.compile import uncompile_repeated_blocks
from lib import models, shapes, variants
from lib.profiler import comm_profile
from lib.timing import allocated, peak, reset_peak, sync, timed


@dataclass(frozen=True)
class Job:
    """What every rank runs (picklable: it travels to the spawned processes).

    model: "full" (the released DiT, `blocks` of its blocks when given) or "tiny" (the built-in tiny DiT).
    shape: height, width, frames, text (rows) and other_text (the second length), as `shapes.SHAPES`.
    profiles: names as `variants`', ATTENTION+execution+LINEAR; run grouped by linear, BF16 first.
    split: run the split path (`Ranks`) even for a group of one; False is the plain one-GPU forward (one rank).
    simulate: one process runs rank 0's part of a split over `n` (`StandIn`: its peers' messages are copies of its
    own), so one GPU shows a rank's own work at that count: a projection of the compute, no interconnect in it.
    timeout_s: how long a collective may wait for a peer; the group gets this much per profile, plus one."""

    model: str
    shape: dict
    profiles: tuple[str, ...]
    blocks: int | None = None
    warmup: int = 1
    iters: int = 3
    comm: bool = True
    split: bool = True
    cuda: bool = True
    timeout_s: float = 300.0
    simulate: bool = False


def run_group(n: int, job: Job) -> list[dict]:
    """Run `job` on `n` spawned ranks; each rank's result in rank order. A rank that fails raises RuntimeError with
    its traceback, and every rank is stopped."""
    from h3serve.parallel.group import free_port

    if not job.split and n != 1:
        raise ValueError(f"the plain forward runs on one rank, not {n}")
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    port = free_port()
    ranks = 1 if job.simulate and job.split else n
    procs = [spawn.Process(target=_rank, args=(r, n, port, job, results), name=f"split-rank{r}") for r in range(ranks)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    deadline = time.monotonic() + job.timeout_s * (1 + len(job.profiles))
    try:
        while len(out) < ranks:
            try:
                kind, rank, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(f"rank {dead[0][0]} exited with {dead[0][1]}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the group of {n} did not finish in time") from None
                continue
            if kind == "failed":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            out[rank] = payload
    finally:
        for p in procs:
            p.join(30 if len(out) == ranks else 1)
            if p.exitcode is None:
                p.kill()
                p.join(5)
    return [out[r] for r in range(ranks)]


def _rank(rank: int, n: int, port: int, job: Job, results) -> None:
    threading.Thread(target=_exit_with_parent, daemon=True).start()  # a killed run leaves no rank holding a GPU
    try:
        results.put(("done", rank, _run(rank, n, port, job)))
    except BaseException:
        results.put(("failed", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_with_parent() -> None:
    parent = mp.parent_process()
    while parent is not None and parent.is_alive():
        time.sleep(1.0)
    os._exit(1)


@torch.no_grad()
def _run(rank: int, n: int, port: int, job: Job) -> dict:
    from h3serve.accel import attention
    from h3serve.accel.adaln import AdalnTables
    from h3serve.parallel.group import Group
    from h3serve.parallel.ranks import Ranks
    from h3serve.pipeline.spread import ONE_DEVICE

    if job.cuda:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # a CPU GEMM over threads can round a row differently with the row count
    ranks = None
    if job.split and job.simulate:
        ranks = Ranks(StandIn(0, n, device))
    elif job.split:
        ranks = Ranks(Group.join(rank, n, port, device, job.timeout_s))
    spread = ranks if ranks is not None else ONE_DEVICE
    torch.manual_seed(0)
    dit = models.tiny_dit() if job.model == "tiny" else models.build_dit(device, blocks=job.blocks)
    dit = dit.to(device)
    out: dict = {"rank": rank, "weights_gib": round(allocated(device) / 2**30, 2), "profiles": {}, "outputs": {}}
    runs = {}
    for key, text in (("main", job.shape["text"]), ("other", job.shape["other_text"])):
        layout, timesteps, t_index = shapes.t2va_layout(job.shape, text)
        cfg = dit.config
        runs[key] = SimpleNamespace(
            layout=layout,
            text=shapes.text_states(text, cfg.text_dim, 0),
            video=torch.randn(layout.num_video_rows, cfg.video_patch_dim,
                              generator=torch.Generator().manual_seed(100)).to(device),
            audio=torch.randn(layout.num_audio_rows, cfg.audio_latents_dim,
                              generator=torch.Generator().manual_seed(200)).to(device),
            timesteps=timesteps.to(device),
            t_index=t_index.to(device),
        )  # fmt: skip
    out["rows"] = int(runs["main"].layout.token_tags.shape[0])
    tables = AdalnTables(dit, weights="device")
    for r in runs.values():
        r.tables = tables.for_steps([r.timesteps.cpu()])
    dev = "cuda" if job.cuda else "cpu"
    for linear in dict.fromkeys(name.split("+")[2] for name in sorted(job.profiles, key=_linear_order)):
        replaced = variants.swap_linears(dit, linear)
        for name in (p for p in job.profiles if p.split("+")[2] == linear):
            attn, execution, _ = name.split("+")
            uncompile_repeated_blocks(dit)
            torch._dynamo.reset()
            counter = variants.configure(dit, attn, execution, linear, dev)
            if ranks is not None:
                ranks.install(SimpleNamespace(components=SimpleNamespace(dits={"dit": dit}), step_caches={}))
            entry, outputs = _measure(spread, dit, runs, job, ranks, device, counter)
            out["profiles"][name] = entry
            if rank == 0:
                out["outputs"][name] = outputs
            print(f"rank {rank}/{n} {name}", {k: v for k, v in entry.items() if k != "ms"}, flush=True)
        uncompile_repeated_blocks(dit)
        if replaced is not None:
            variants.restore(dit, replaced)
    attention.set_kernel(dit, "TORCH_SDPA")
    return out


class StandIn:
    """Rank 0 of a group of `size` with no peers (`Job.simulate`): every tensor has its split shape and the kernels
    their split sizes. The peers' parts of a message are filled with this rank's own (zeros would not do: a GEMM or
    attention on zeros draws less power and runs faster on the H200; 8.7x at 8 ranks was seen with zeros)."""

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank, self.size, self.device, self.calls = rank, size, device, 0
        self._spans: list | None = None  # (start, end) CUDA events around each message's copies, while timed

    def time_copies(self) -> None:
        """From now until `take_ms`, time the copies standing in for messages (the timed forwards are left alone)."""
        self._spans = []

    def take_ms(self) -> float:
        """The GPU time of those copies since `time_copies` (0 on a CPU), and timing off."""
        spans, self._spans = self._spans or [], None
        if spans:
            torch.cuda.synchronize(self.device)
        return sum(start.elapsed_time(end) for start, end in spans)

    @contextlib.contextmanager
    def _span(self):
        if self.device.type != "cuda" or self._spans is None:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._spans.append((start, end))

    @property
    def lead(self) -> bool:
        return True

    def agree(self, flag: bool) -> bool:
        return flag

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def broadcast_object(self, obj):
        return obj

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_sizes: list[int], in_sizes: list[int]) -> None:
        with self._span():
            own = inp[: in_sizes[0]]
            for part in out.split(out_sizes):
                _fill(part, own)

    def all_gather(self, flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        with self._span():
            return [flat.clone(), *(_fill(flat.new_empty(n), flat) for n in sizes[1:])]


def _fill(part: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """`part` (1-D) filled with `own`'s elements, repeated as far as it goes (zeros where it has none)."""
    if own.numel() == 0:
        return part.zero_()
    for start in range(0, part.numel(), max(1, own.numel())):
        n = min(own.numel(), part.numel() - start)
        part[start : start + n].copy_(own[:n])
    return part


def _linear_order(name: str) -> int:
    return 0 if name.endswith("+BF16") else 1  # the BF16 weights first: a swap quantizes a copy, restored after


def _measure(spread, dit, runs, job: Job, ranks, device: torch.device, counter) -> tuple[dict, tuple]:
    main = runs["main"]
    fn = spread.bind(dit, main.layout, main.text, main.tables)

    def forward():
        return fn(main.video, main.audio, main.timesteps, main.t_index, 0)

    def barrier():
        if ranks is not None:
            ranks.group.agree(False)

    entry: dict = {}
    reset_peak(device, empty_cache=True)
    start = time.perf_counter()
    forward()
    sync(device)
    entry["first_call_s"] = round(time.perf_counter() - start, 2)
    for _ in range(job.warmup):
        forward()
    ms = []
    for _ in range(job.iters):
        barrier()
        ms.append(timed(forward, device))
    entry["ms"] = [round(m, 2) for m in ms]
    entry["ms_median"] = round(statistics.median(ms), 2)
    v, a = forward()
    entry["peak_gib"] = round(peak(device) / 2**30, 2)
    if job.comm:
        barrier()
        stand_in = ranks.group if ranks is not None and isinstance(ranks.group, StandIn) else None
        entry["comm"] = comm_profile(forward, device, stand_in)
    if counter is not None:
        other = runs["other"]
        spread.bind(dit, other.layout, other.text, other.tables)(other.video, other.audio, other.timesteps,
                                                                 other.t_index, 0)  # fmt: skip
        entry["graphs"], entry["recompiles"] = counter.graphs, counter.recompiles
    return entry, (v.float().cpu().numpy(), a.float().cpu().numpy())


def scaling(groups: dict[int, list[dict]], compare: bool = True) -> dict:
    """Per GPU count and profile, from `run_group`'s results: the forward's time (the slowest rank's median), the
    speed-up and efficiency against one GPU, peak memory per GPU, rank 0's and the worst rank's collectives and
    idle time, graphs and recompiles, and rank 0's outputs against one GPU's (bit for bit, relative error; not where
    `compare` is off: a simulated split's outputs are not a render's)."""
    import numpy as np

    base = groups.get(1, [None])[0]
    table: dict = {}
    for n, ranks in sorted(groups.items()):
        for name, first in ranks[0]["profiles"].items():
            entries = [r["profiles"][name] for r in ranks]
            ms = max(e["ms_median"] for e in entries)
            row: dict = {
                "ms_median": ms,
                "ms_median_per_rank": [e["ms_median"] for e in entries],
                "first_call_s": max(e["first_call_s"] for e in entries),
                "peak_gib_per_gpu": [e["peak_gib"] for e in entries],
                "weights_gib_per_gpu": [r["weights_gib"] for r in ranks],
            }
            if "comm" in first:
                row["comm_rank0"] = first["comm"]
                row["all_to_all_ms_max"] = max(e["comm"]["collectives_ms"]["all_to_all"] for e in entries)
                if "idle_ms" in first["comm"]:
                    row["idle_ms_max"] = max(e["comm"]["idle_ms"] for e in entries)
            if "recompiles" in first:
                row["graphs"] = max(e["graphs"] for e in entries)
                row["recompiles"] = max(e["recompiles"] for e in entries)
            one = base["profiles"].get(name) if base is not None else None
            if one is not None:
                row["speedup_vs_1"] = round(one["ms_median"] / ms, 3)
                row["efficiency"] = round(one["ms_median"] / ms / n, 3)
                if n > 1 and compare:
                    mine, theirs = ranks[0]["outputs"][name], base["outputs"][name]
                    row["bitwise_equal_to_1"] = all(np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True))
                    row["rel_err_vs_1"] = [_rel(a, b) for a, b in zip(mine, theirs, strict=True)]
            table.setdefault(name, {})[str(n)] = row
    return table


def _rel(a, b) -> float:
    import numpy as np

    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def environment() -> dict:
    """What the run's NCCL saw: the visible GPUs and the NCCL, multicast and device variables set (for the record)."""
    prefixes = ("NCCL_", "TORCH_NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_", "CUDA_VISIBLE_")
    return {
        "visible_gpus": torch.cuda.device_count(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(prefixes)},
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
    }
