"""Safetensors checkpoints read into a model built on the meta device, strictly: one read path for every component.

Tensors are read by `checkpoint.reader.TensorReader` (large positional reads in a few threads, a bounded read-ahead)
into buffers of their own; only the tensors left mapped (`mapped`) are views of a file's mapping (`Checkpoint.get`).
What a component's layout stores where is its own module's business (`checkpoint.dit`, `checkpoint.vae`,
`checkpoint.text_encoder`): each gives `assign_from_checkpoint` a plan of `Source`s, module name -> the keys and the
build (a row reorder of `checkpoint.rows`, a concatenation) that make the tensor.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn

from h3serve.checkpoint.reader import DEFAULT_THREADS, DTYPES, CheckpointError, TensorReader


class Checkpoint:
    """Tensor names of one or more safetensors files: what the header checks and the mapped tensors read
    (`assign_from_checkpoint` reads the data through a `TensorReader` over `files_of`)."""

    def __init__(self, root: Path, files: Mapping[str, Path]):
        self.root = root  # the index file, or the single safetensors file
        self._files = dict(files)
        self._handles: dict[Path, object] = {}

    def keys(self) -> frozenset[str]:
        return frozenset(self._files)

    @property
    def sharded(self) -> bool:
        """Whether the tensors come from shards listed in an index (else one safetensors file)."""
        return self.root.name.endswith(".index.json")

    def __iter__(self):
        return iter(self._files)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def file_of(self, key: str) -> Path:
        return self._files[key]

    def files_of(self, keys: Iterable[str]) -> list[Path]:
        """The files that hold `keys`, each once, in the order first met."""
        return list(dict.fromkeys(self._files[k] for k in keys))

    def get(self, key: str) -> torch.Tensor:
        """The stored tensor: a zero-copy view into a mapping of its file, no page of it touched (a mapped tensor).

        Each call maps the file afresh (a header parse: well under a millisecond), so that the mapping lives only as
        long as the view. Read through one cached handle, every page read would stay mapped until the load ends, and
        the process would hold the file's pages (60 GB for the released DiT) beside the model.
        """
        file = self._files[key]
        try:
            return safe_open(str(file), framework="pt", device="cpu").get_tensor(key)
        except Exception as err:  # safetensors raises its own error types for corrupt data
            raise CheckpointError(f"{file}: cannot read key {key!r}: {err}") from err

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype, read from the header without touching the data."""
        name = self._handle(self._files[key]).get_slice(key).get_dtype()
        return DTYPES.get(name, name)

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = _open(file)
        return self._handles[file]


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as err:
        raise CheckpointError(f"{file}: not a readable safetensors file (truncated or corrupt?): {err}") from err


def _file_keys(file: Path) -> list[str]:
    if not file.is_file():
        raise CheckpointError(f"{file}: file is missing")
    return list(_open(file).keys())


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a `.safetensors` file, or a folder holding one `*.safetensors.index.json` or exactly one `*.safetensors`.

    With an index, every listed shard must exist and hold exactly the keys the index assigns to it.
    """
    path = Path(path)
    if path.is_file():
        return Checkpoint(path, {k: path for k in _file_keys(path)})
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or folder")
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(f"{path}: more than one safetensors index: {[i.name for i in indexes]}")
    if not indexes:
        singles = sorted(path.glob("*.safetensors"))
        if len(singles) != 1:
            raise CheckpointError(
                f"{path}: expected one *.safetensors.index.json or exactly one *.safetensors file, "
                f"found {[s.name for s in singles]}"
            )
        return open_checkpoint(singles[0])
    index = indexes[0]
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{index}: not a safetensors index with a weight_map: {err}") from err
    files = {key: path / name for key, name in weight_map.items()}
    by_file: dict[Path, set[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, set()).add(key)
    for file, listed in sorted(by_file.items()):
        if not file.is_file():
            raise CheckpointError(f"{file}: shard listed in {index.name} (e.g. for key {min(listed)!r}) is missing")
        present = set(_file_keys(file))
        if listed - present:
            raise CheckpointError(f"{file}: missing key {min(listed - present)!r} that {index.name} assigns to it")
        if present - listed:
            raise CheckpointError(f"{file}: unexpected key {min(present - listed)!r} not listed in {index.name}")
    return Checkpoint(index, files)


class LoadHook(Protocol):
    """Transforms tensors while a checkpoint loads (see `assign_from_checkpoint`)."""

    def transform(self, name: str, tensor: torch.Tensor) -> Mapping[str, torch.Tensor]: ...

    def prepare(self, module: nn.Module) -> None: ...


class ChainedHooks:
    """Several load hooks in order: each transforms what the previous one kept."""

    def __init__(self, *hooks: LoadHook):
        self.hooks = hooks

    def transform(self, name: str, tensor: torch.Tensor) -> Mapping[str, torch.Tensor]:
        entries: Mapping[str, torch.Tensor] = {name: tensor}
        for hook in self.hooks:
            entries = {k: v for n, t in entries.items() for k, v in hook.transform(n, t).items()}
        return entries

    def prepare(self, module: nn.Module) -> None:
        for hook in self.hooks:
            hook.prepare(module)


def chain(*hooks: LoadHook | None) -> LoadHook | None:
    """One hook for the given ones (None entries skipped); None when there is none."""
    present = [h for h in hooks if h is not None]
    return None if not present else present[0] if len(present) == 1 else ChainedHooks(*present)


def _identity(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


@dataclass(frozen=True)
class Source:
    """How one module tensor is made from checkpoint keys (none for a tensor the checkpoint does not store)."""

    keys: tuple[str, ...]
    build: Callable[[list[torch.Tensor]], torch.Tensor] = _identity


@dataclass(frozen=True)
class LoadStats:
    """What one `assign_from_checkpoint` read: tensor bytes (as stored) and wall seconds, the device synchronized.

    `str()` is the operator's line, "X.X GB in Y.Y s (Z.ZZ GB/s)" (GB = 1e9 bytes). `threads`: the reader's.
    `peak_ahead`: the most bytes the reader held ahead of the tensor in hand."""

    bytes_read: int
    seconds: float
    tensors: int
    threads: int
    peak_ahead: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / 1e9 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        return f"{self.bytes_read / 1e9:.1f} GB in {self.seconds:.1f} s ({self.gb_per_s:.2f} GB/s)"


def assign_from_checkpoint(
    module: nn.Module,
    ckpt: Checkpoint,
    plan: Mapping[str, Source],
    *,
    device: torch.device | str,
    dtype_of: Callable[[str], torch.dtype],
    ckpt_dtype_of: Callable[[str], torch.dtype],
    unused: frozenset[str] = frozenset(),
    hook: LoadHook | None = None,
    mapped: Callable[[str], bool] | None = None,
    threads: int = DEFAULT_THREADS,
) -> LoadStats:
    """Materialise a meta-device `module` from `ckpt` following `plan` (module name -> Source); returns what it read.

    The checkpoint's key set must equal the plan's (plus `unused`: keys known to be there and deliberately not read,
    such as the text encoder's layers past the one H3 reads), each stored tensor must have the expected dtype, and
    each built tensor the module's shape. Every tensor ends in an allocation of its own at its target device and
    dtype (`_owned`): no loaded tensor is a view into the file's buffers.

    How it reads: a `checkpoint.reader.TensorReader` with `threads` threads reads the keys in plan order into fresh
    CPU buffers, a bounded window ahead (the load's extra host memory: that window plus the tensor in hand, about two
    of the largest tensor; see `checkpoint.reader`). A buffer read at its target dtype for the CPU is kept as is; for
    another device it is copied there at its stored dtype and built there (the builds move data only: reorders,
    concatenations). (bench/load.py compares this path with safetensors' own mmap reads, built from the same plan.)

    `hook` transforms tensors as they are read (`hook.transform(name, tensor)` returns the entries to keep in its
    place, e.g. an FP8 weight and its scales), so a transformed layer never exists whole in its stored precision;
    `hook.prepare(module)` then gives the meta module the matching structure before the tensors are assigned.

    `mapped(name)`: tensors that are not read at all. Each becomes the file's mapping itself (a zero-copy view at the
    stored dtype, no page of it touched), passed by no hook: what `accel.adaln` streams from when it makes a
    schedule's tables, for AdaLN weights kept as page cache (`AdalnWeights.MAPPED`). Only for a tensor stored as is
    (one key, no reordering).
    """
    start = time.perf_counter()
    expected = dict(module.state_dict(keep_vars=True))
    device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", to compare with a tensor's device
    _check_keys(ckpt, plan, expected, unused)
    kept_mapped = {name for name in plan if mapped is not None and mapped(name)}
    keys = [key for name, src in plan.items() if name not in kept_mapped for key in src.keys]
    reader = TensorReader(ckpt.files_of(keys), threads=threads)
    stream = reader.read(keys)
    to_device = device.type != "cpu"  # fresh CPU buffers: built on the target device
    state: dict[str, torch.Tensor] = {}
    read_bytes = 0
    try:
        for name, src in plan.items():
            if name in kept_mapped:
                state[name] = _mapped(ckpt, name, src, expected[name], ckpt_dtype_of)
                continue
            tensors = []
            for key in src.keys:
                _check_dtype(ckpt, key, ckpt_dtype_of)
                tensors.append(next(stream))
                read_bytes += tensors[-1].nbytes
            tensor = _build(ckpt, name, src, tensors, expected[name], device if to_device else None)
            tensor = _owned(tensor, device=device, dtype=dtype_of(name))
            del tensors
            if hook is None:
                state[name] = tensor
            else:
                state.update(hook.transform(name, tensor))
                del tensor  # a transformed tensor's stored form is dropped here, one tensor at a time
    finally:
        stream.close()  # the reads in flight end here (a load that stops early), then the files close
        reader.close()
    if hook is not None:
        hook.prepare(module)
    module.load_state_dict(state, strict=True, assign=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the copies and the hook's kernels are done: the seconds are the load's
    return LoadStats(
        bytes_read=read_bytes,
        seconds=time.perf_counter() - start,
        tensors=len(keys),
        threads=threads,
        peak_ahead=reader.peak_ahead,
    )


def _check_keys(ckpt: Checkpoint, plan: Mapping[str, Source], expected: Mapping[str, Any], unused: frozenset[str]):
    """The plan covers the module exactly, and the checkpoint holds every key it reads and no other (but `unused`)."""
    if set(plan) != set(expected):
        missing, extra = sorted(set(expected) - set(plan)), sorted(set(plan) - set(expected))
        raise RuntimeError(f"load plan does not cover the module: unplanned {missing[:5]}, unknown {extra[:5]}")
    wanted = {key for src in plan.values() for key in src.keys}
    present = ckpt.keys()
    if wanted - present:
        key = min(wanted - present)
        raise CheckpointError(f"{ckpt.root}: missing key {key!r}")
    if present - wanted - unused:
        key = min(present - wanted - unused)
        raise CheckpointError(f"{ckpt.file_of(key)}: unexpected key {key!r}")


def _build(ckpt: Checkpoint, name: str, src: Source, tensors: list[torch.Tensor], target: torch.Tensor, device):
    """The module's tensor `name` built from its stored `tensors` (on `device` first, unless None), its shape checked
    against `target`'s; a CheckpointError naming the files and keys otherwise."""
    where = ", ".join(f"{ckpt.file_of(k)}: key {k!r} {list(t.shape)}" for k, t in zip(src.keys, tensors, strict=True))
    if device is not None:
        tensors = [t.to(device) for t in tensors]
    try:
        tensor = src.build(tensors)
    except RuntimeError as err:  # a view/reshape that the stored shape cannot satisfy
        raise CheckpointError(f"{where}: wrong shape for {name} {list(target.shape)}: {err}") from err
    if tensor.shape != target.shape:
        raise CheckpointError(f"{where}: wrong shape, expected {list(target.shape)} for {name}")
    return tensor


def _check_dtype(ckpt: Checkpoint, key: str, ckpt_dtype_of: Callable[[str], torch.dtype]) -> None:
    """The stored dtype of `key` (from the header) must be the one expected."""
    got, want = ckpt.dtype(key), ckpt_dtype_of(key)
    if got != want:
        raise CheckpointError(f"{ckpt.file_of(key)}: key {key!r} has dtype {got}, expected {want}")


def _mapped(
    ckpt: Checkpoint, name: str, src: Source, target: torch.Tensor, ckpt_dtype_of: Callable[[str], torch.dtype]
) -> torch.Tensor:
    """The stored tensor for `name` as its file's mapping, checked as a read tensor is (dtype, shape), not read."""
    if len(src.keys) != 1 or src.build is not _identity:
        raise RuntimeError(f"{name}: only a tensor stored as is can stay mapped, this one is built from {src.keys}")
    (key,) = src.keys
    _check_dtype(ckpt, key, ckpt_dtype_of)
    view = ckpt.get(key)
    if view.shape != target.shape:
        shapes = f"{list(view.shape)}: wrong shape, expected {list(target.shape)} for {name}"
        raise CheckpointError(f"{ckpt.file_of(key)}: key {key!r} {shapes}")
    return view


# Bytes to which torch's CPU allocator aligns every allocation (c10's gAlignment; CUDA's caching allocator: 512).
ALIGNMENT = 64


def _owned(tensor: torch.Tensor, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` at `device` and `dtype` in a contiguous, 64-byte aligned allocation of its own.

    A model made of tensors at the offsets of its file (safetensors' mmap views sit at the header's offsets, 8-byte
    aligned at best) computes differently with the layout of the file it came from: CPU GEMM kernels take other
    paths, and round otherwise, for a weight that is not 64-byte aligned, so the same weights rendered other frames
    from the diffusers folder than from a single file (issue 22, on AMD EPYC). So every tensor ends in a fresh
    allocation of its final dtype on its final device: a reader's buffer already at its final dtype and device, or a
    build that already made a fresh tensor there (a QKV reorder, a concatenation), is kept, not copied again; anything
    else is copied once. One tensor at a time: the model never exists twice.
    """
    fresh = (
        tensor.device == device
        and tensor.dtype == dtype
        and tensor.is_contiguous()
        and tensor.data_ptr() % ALIGNMENT == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes  # holds this tensor and nothing else
    )
    if fresh:
        return tensor
    out = torch.empty(tensor.shape, dtype=dtype, device=device)
    out.copy_(tensor)  # converts and transfers in the one copy
    return out


def naming_by_marker(ckpt: Checkpoint, what: str, markers: Mapping[str, str]) -> str:
    """Which published naming a checkpoint uses, from one key only that naming has (naming -> marker key)."""
    for naming, key in markers.items():
        if key in ckpt:
            return naming
    seen = " nor ".join(f"{key!r} ({naming})" for naming, key in markers.items())
    raise CheckpointError(f"{ckpt.root}: not an H3 {what} checkpoint: neither {seen} is present")
