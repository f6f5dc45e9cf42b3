"""What every bench script records and how it times: the run's header (date, GPU, versions, the exact command) and a
median-ready list of per-call times from CUDA events (wall time on a CPU dry run, which is not a benchmark)."""

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


def gpu_used_mib() -> list[int]:
    """Each visible GPU's used memory as nvidia-smi reports it (every process's, MiB); [] without nvidia-smi. For
    engines whose memory is in worker processes."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(line) for line in out.split() if line.strip().isdigit()]


def call_peer(peer, x: dict):
    """One forward of diffusers' MiniMaxH3Transformer3DModel on packed inputs named as our scripts name them."""
    return peer(
        hidden_states=x["video"][None],
        audio_hidden_states=x["audio"][None],
        encoder_hidden_states=x["text_states"][None],
        timestep=x["timesteps"],
        timestep_indices=x["timestep_indices"],
        token_tags=x["token_tags"],
        position_ids=x["position_ids"],
        video_indices=x["video_indices"],
        audio_indices=x["audio_indices"],
        text_indices=x["text_indices"],
        return_dict=False,
    )


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


def evict(files) -> None:
    """Drop the files' pages from the page cache (written back first: clean pages go without root), so that the next
    read of them comes from the disk."""
    import os

    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")  # torch's pinned memory shows as RssShmem


def proc_status() -> dict[str, int]:
    """This process's resident-memory fields of /proc/self/status (`STATUS_FIELDS`), in bytes."""
    from pathlib import Path

    lines = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(lines[k].split()[0]) * 1024 for k in STATUS_FIELDS if k in lines}


class StatusPeaks:
    """The peaks of `proc_status()` over a `with` block (bytes), sampled every `interval` seconds by a thread and
    once more at the end."""

    def __init__(self, interval: float = 0.005):
        import threading

        self.interval = interval
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for k, v in proc_status().items():
            self.peak[k] = max(self.peak.get(k, 0), v)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> StatusPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
