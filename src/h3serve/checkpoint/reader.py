"""Safetensors files read at the storage's speed: the header parsed here, the data read with large positional reads
(`os.preadv`) into fresh buffers by a few threads, with a bounded read-ahead.

Why not safetensors' mmap: a load through the mapping is one page fault per 4 KiB page (the kernel's fault-around and
readahead help a little) taken by the one thread that copies, so it runs at a fraction of what the NVMe drive or the
page cache delivers. A positional read of megabytes per call, several calls in flight, lets the kernel stream: it
reads ahead in large requests and copies with several cores. And the buffers are the loader's own: a tensor read at
its final dtype for the CPU is its final allocation (64-byte aligned, as torch's CPU allocator aligns every one), with
no second copy.

Memory: tensors are read in the order asked, at most `window_bytes` of them ahead of the one the caller holds
(at least one tensor, however large); the default window is the largest tensor asked for, at least `MIN_WINDOW`. So
beside what the caller keeps, a load holds at most the window plus the tensor in hand: about two of the largest
tensor (2 x 520 MB for the released DiT, whose AdaLN projections are the largest), whatever the checkpoint's size.
Buffers over glibc's mmap threshold (32 MiB; every block tensor of the released DiT) go back to the system when
freed; smaller ones stay in the heap for later allocations, so a load of small tensors holds a little more (measured
in tests/test_reader.py; bench/load.py measures the real one).
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors' dtype names -> torch dtypes (those H3's checkpoints and their tests use).
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

HEADER_LIMIT = 100_000_000  # bytes of JSON header safetensors itself accepts at most
DEFAULT_THREADS = 8
CHUNK_BYTES = 8 << 20  # one read call; a larger tensor is split into chunks read by several threads
MIN_WINDOW = 64 << 20  # read-ahead at least this deep: 8 threads x 8 MiB in flight when the tensors are small


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the file and the key."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it."""

    file: Path
    key: str
    dtype: str  # safetensors' name, e.g. "BF16" (see DTYPES)
    shape: tuple[int, ...]
    offset: int  # of the first data byte, from the start of the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise CheckpointError(f"{self.file}: cannot read key {self.key!r}: dtype {self.dtype} is not supported")
        return DTYPES[self.dtype]


def _pread_exactly(file: Path, fd: int, buffer: memoryview, offset: int, key: str | None) -> None:
    """Fill `buffer` from `offset` of the file; a short file is a CheckpointError (naming `key` when given)."""
    done = 0
    what = f"cannot read key {key!r}" if key is not None else "cannot read the header"
    while done < len(buffer):
        try:
            n = os.preadv(fd, [buffer[done:]], offset + done)
        except OSError as err:
            raise CheckpointError(f"{file}: {what}: {err}") from err
        if n == 0:
            raise CheckpointError(
                f"{file}: {what}: the file ends at byte {offset + done}, before byte {offset + len(buffer)} "
                f"(truncated?)"
            )
        done += n


def _parse_header(file: Path, fd: int) -> dict[str, TensorEntry]:
    """The tensors of an open safetensors file: an 8-byte little-endian header length, then that much JSON of
    `{key: {"dtype", "shape", "data_offsets": [begin, end]}}` (offsets from the end of the header;
    `__metadata__` ignored), then the data. Every entry is checked against the file's size."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise CheckpointError(f"{file}: not a safetensors file: {size} bytes, less than the 8-byte header length")
    raw = bytearray(8)
    _pread_exactly(file, fd, memoryview(raw), 0, None)
    length = int.from_bytes(raw, "little")
    if length > HEADER_LIMIT or 8 + length > size:
        raise CheckpointError(
            f"{file}: not a readable safetensors file (truncated or corrupt?): a header of {length} bytes "
            f"in a file of {size}"
        )
    text = bytearray(length)
    _pread_exactly(file, fd, memoryview(text), 8, None)
    try:
        header = json.loads(bytes(text))
    except ValueError as err:  # json's errors and UnicodeDecodeError
        raise CheckpointError(f"{file}: not a readable safetensors file (corrupt header?): {err}") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: not a readable safetensors file: the header is not a JSON object")
    start, data = 8 + length, size - 8 - length
    entries = {}
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
            if not isinstance(dtype, str) or not all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end)):
                raise TypeError("dtype must be a string, shape and data_offsets non-negative ints")
        except (TypeError, KeyError, ValueError) as err:
            raise CheckpointError(f"{file}: key {key!r}: not a safetensors header entry {spec!r}: {err}") from err
        if end < begin:
            raise CheckpointError(f"{file}: key {key!r}: data_offsets {[begin, end]} end before they begin")
        if end > data:
            raise CheckpointError(
                f"{file}: key {key!r}: its data (bytes {start + begin}..{start + end}) lies past the end of the "
                f"file at byte {size} (truncated?)"
            )
        if dtype in DTYPES:
            numel = 1
            for d in shape:
                numel *= d
            if numel * DTYPES[dtype].itemsize != end - begin:
                raise CheckpointError(
                    f"{file}: key {key!r}: data_offsets hold {end - begin} bytes, but {dtype} {list(shape)} is "
                    f"{numel * DTYPES[dtype].itemsize}"
                )
        entries[key] = TensorEntry(file, key, dtype, shape, start + begin, end - begin)
    return entries


def read_header(file: str | Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file holds, from its header (the file opened for this call only)."""
    file = Path(file)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise CheckpointError(f"{file}: cannot open: {err}") from err
    try:
        return _parse_header(file, fd)
    finally:
        os.close(fd)


@dataclass
class _Pending:
    entry: TensorEntry
    dtype: torch.dtype
    buffer: torch.Tensor  # (nbytes,) uint8, filled by the chunks' reads
    chunks: list[Future]


class TensorReader:
    """Reads the tensors of some safetensors files, for one load: `with TensorReader(files) as r: r.read(keys)`.

    Each file is opened once, here, and closed by `close()`; `threads` workers read `chunk_bytes` per call. See the
    module docstring for the read-ahead `window_bytes` (None: the largest tensor of a `read`, at least MIN_WINDOW).
    `bytes_read` counts the tensor bytes handed out; `peak_ahead` the most bytes read ahead of the tensor in hand.
    """

    def __init__(
        self,
        files: Iterable[str | Path],
        *,
        threads: int = DEFAULT_THREADS,
        chunk_bytes: int = CHUNK_BYTES,
        window_bytes: int | None = None,
    ):
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
        if window_bytes is not None and window_bytes < 0:
            raise ValueError(f"window_bytes must be non-negative, got {window_bytes}")
        self.chunk_bytes, self.window_bytes = chunk_bytes, window_bytes
        self.bytes_read = 0
        self.peak_ahead = 0
        self.entries: dict[str, TensorEntry] = {}
        self._fds: dict[Path, int] = {}
        try:
            for file in dict.fromkeys(Path(f) for f in files):
                try:
                    self._fds[file] = fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as err:
                    raise CheckpointError(f"{file}: cannot open: {err}") from err
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger kernel readahead
                for key, entry in _parse_header(file, fd).items():
                    if key in self.entries:
                        raise CheckpointError(f"{file}: key {key!r} is also in {self.entries[key].file}")
                    self.entries[key] = entry
        except BaseException:
            self._close_files()
            raise
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="h3serve-read")

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Waits for reads in flight (none once every `read` has ended), then closes the files."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._close_files()

    def _close_files(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])

    def entry(self, key: str) -> TensorEntry:
        if key not in self.entries:
            raise CheckpointError(f"{', '.join(map(str, self._fds))}: no key {key!r}")
        return self.entries[key]

    def read(self, keys: Sequence[str]) -> Iterator[torch.Tensor]:
        """The tensors of `keys`, in that order, each in a fresh buffer of its own at its stored dtype and shape.

        Reading runs ahead of the caller by up to the window; the caller should keep or drop each tensor before
        asking for the next (what it keeps is its own memory, not the window's). Leaving the iteration early (an
        error, `close()` of the generator) cancels the reads not started and waits for those running.
        """
        entries = [self.entry(k) for k in keys]
        window = self.window_bytes
        if window is None:
            window = max([MIN_WINDOW, *(e.nbytes for e in entries)])
        queue: deque[_Pending] = deque()
        ahead, following = 0, 0

        def fill() -> None:  # submit what the window holds; at least one tensor when none is in flight
            nonlocal ahead, following
            while following < len(entries) and (not queue or ahead + entries[following].nbytes <= window):
                queue.append(self._submit(entries[following]))
                ahead += entries[following].nbytes
                following += 1
            self.peak_ahead = max(self.peak_ahead, ahead)

        try:
            fill()
            while queue:
                pending = queue[0]
                for chunk in pending.chunks:
                    chunk.result()  # a failed read raises its CheckpointError here (its other chunks awaited below)
                queue.popleft()
                ahead -= pending.entry.nbytes
                fill()  # before the tensor is handed out, so that the window is read while the caller works
                self.bytes_read += pending.entry.nbytes
                tensor = pending.buffer.view(pending.dtype).view(pending.entry.shape)
                del pending
                yield tensor
                del tensor  # the caller's now (kept or dropped), not this frame's
        finally:
            for pending in queue:
                for chunk in pending.chunks:
                    chunk.cancel()
            for pending in queue:
                for chunk in pending.chunks:
                    if not chunk.cancelled():
                        chunk.exception()  # waits for a read in flight; its error, if any, is moot now
            queue.clear()

    def _submit(self, entry: TensorEntry) -> _Pending:
        dtype = entry.torch_dtype  # an unsupported dtype stops here, before anything is read
        buffer = torch.empty(entry.nbytes, dtype=torch.uint8)  # 64-byte aligned (c10's CPU allocator)
        chunks = []
        if entry.nbytes:
            view = memoryview(buffer.numpy())
            fd = self._fds[entry.file]
            for begin in range(0, entry.nbytes, self.chunk_bytes):
                part = view[begin : begin + self.chunk_bytes]
                chunks.append(self._pool.submit(_pread_exactly, entry.file, fd, part, entry.offset + begin, entry.key))
        return _Pending(entry, dtype, buffer, chunks)
