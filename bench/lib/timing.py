"""How every bench script records and times: the run's header (date, GPU, versions, the exact command), per-call times
from CUDA events (wall time on a CPU dry run, which is not a benchmark), peak memory, and a timed render."""

from __future__ import annotations

import datetime
import platform
import sys
import time
from collections.abc import Callable

import torch


def run_header(device: torch.device | str | None = None) -> dict:
    """date, gpu, torch, python and the command line, for a result file."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(device) if cuda else "none (CPU dry run)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
    }


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    """Milliseconds per call of `fn` after `warmup` calls: CUDA events on a GPU, wall time on a CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if not torch.cuda.is_available():
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of `fn` on `device` (CUDA events; wall time on a CPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _cuda(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def allocated(device: torch.device | str | None = None) -> int:
    """Bytes the caching allocator holds in tensors on `device` (the current CUDA device when None); 0 on a CPU."""
    return torch.cuda.memory_allocated(device) if _cuda(device) else 0


def peak(device: torch.device | str | None = None) -> int:
    """The allocator's peak since `reset_peak` (bytes); 0 on a CPU."""
    return torch.cuda.max_memory_allocated(device) if _cuda(device) else 0


def reset_peak(device: torch.device | str | None = None, empty_cache: bool = False) -> None:
    """Start a new peak (after giving the allocator's cached blocks back, with `empty_cache`)."""
    if _cuda(device):
        if empty_cache:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def sync(device: torch.device | str | None = None) -> None:
    """Wait for `device`'s queued work (nothing to wait for on a CPU)."""
    if _cuda(device):
        torch.cuda.synchronize(device)


def timed_render(engine, request) -> dict:
    """A warmup render (compile, tables), then a timed one: its stage times, per forward, peak, whether it is
    byte-identical to the warmup, the compile's graphs and recompiles; an error instead, as text."""
    entry: dict = {"steps": request.steps, "forwards": request.forwards}
    try:
        start = time.perf_counter()
        first = engine.render(request)
        entry["first_render_s"] = round(time.perf_counter() - start, 2)
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        second = engine.render(request)
        entry["end_to_end_s"] = round(time.perf_counter() - start, 3)
        entry["timings_s"] = {k: round(v, 3) for k, v in second.timings.items()}
        entry["per_forward_s"] = round(second.timings["denoise"] / request.forwards, 4)
        entry["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        entry["identical_to_first"] = bool(
            (first.frames == second.frames).all() and (first.audio == second.audio).all()
        )
        if engine.compiled is not None:
            entry["graphs"], entry["recompiles"] = engine.compiled.graphs, engine.compiled.recompiles
    except Exception as err:  # recorded, so that the other runs of the script still run
        entry["error"] = f"{type(err).__name__}: {err}"[:2000]
    return entry
