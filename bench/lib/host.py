"""The host's side of a run: GPU memory as nvidia-smi sees it (every process's), page-cache eviction, and this
process's resident memory and its peaks."""

from __future__ import annotations


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
