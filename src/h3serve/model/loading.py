"""Checkpoint loading: safetensors read into a model built on the meta device, strictly.

Tensors are read by `model.reader.TensorReader` (large positional reads in a few threads, a bounded read-ahead) into
buffers of their own; the previous path, one mmap view per tensor copied out, stays for comparison
(`assign_from_checkpoint(threads=0)`, `bench/load.py`) and for the tensors left mapped (`mapped`).

Loaders for the DiT and the text encoder live here (the VAEs' in `vae_loading.py`).

The generic part (`open_checkpoint`, `Source`, `assign_from_checkpoint`) serves every component; the DiT part
reads the published DiT layouts and fixes their quirks once, here. Key names tell two of them apart:

* ``original`` names (our parameter names): `FL2VA/transformer` (13 shards, `model.safetensors.index.json`) with
  the fused QKV rows interleaved per head `[h0: q k v, h1: q k v, ...]`, and the community single files, whose QKV
  rows are stacked `[q_all; k_all; v_all]`. Keys and shapes are identical, so a single file's QKV order cannot be
  read from the file: it is taken as stacked (what every published single file holds, and diffusers' default)
  unless the caller says `qkv_layout="interleaved"` (a file merged from the original shards by hand).
* ``diffusers`` names: `transformer/` (14 shards): renamed keys, split `to_q/to_k/to_v`, and `fc1` halves swapped
  to `[value; gate]`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn
from transformers import Qwen3VLConfig, Qwen3VLModel

from h3serve.config import DiTConfig
from h3serve.model.dit import H3DiT, inv_freq, is_fp32_name

# CheckpointError lives beside the reader, which raises it too; callers import it from here, as before.
from h3serve.model.reader import DEFAULT_THREADS, DTYPES, CheckpointError, TensorReader
from h3serve.model.text_encoder import (
    TEXT_ENCODER_LAYER,
    TextEncoder,
    load_image_processor,
    load_tokenizer,
    materialize_buffers,
    truncated_qwen3vl,
)

log = logging.getLogger(__name__)


class Checkpoint:
    """Tensor names of one or more safetensors files, read lazily (mmap) on request: what the mapped tensors and the
    header checks read (`assign_from_checkpoint` reads the data through a `TensorReader` over `files_of`)."""

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
        """The stored tensor: a zero-copy view into a mapping of its file, to be copied out (`_owned`), not kept.

        Each call maps the file afresh (a header parse: well under a millisecond), so that the mapping lives only as
        long as the view and its pages leave this process once the tensor is copied out. Read through one cached
        handle, every page read would stay mapped until the load ends, and the process would hold the file's pages
        (60 GB for the released DiT) beside the model it copied them into.
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

    `str()` is the operator's line, "X.X GB in Y.Y s (Z.ZZ GB/s)" (GB = 1e9 bytes). `threads`: the reader's (0: the
    mmap copy). `peak_ahead`: the most bytes the reader held ahead of the tensor in hand (0 for the mmap copy)."""

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


def _mmap_tensors(ckpt: Checkpoint, keys: list[str]) -> Iterator[torch.Tensor]:
    """The previous read path: each key's zero-copy view into a fresh mapping of its file (`Checkpoint.get`)."""
    for key in keys:
        yield ckpt.get(key)


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

    How it reads: `threads` > 0 (the default): a `model.reader.TensorReader` with that many threads reads the keys in
    plan order into fresh CPU buffers, a bounded window ahead (the load's extra host memory: that window plus the
    tensor in hand, about two of the largest tensor; see `model.reader`). A buffer read at its target dtype for the
    CPU is kept as is; for another device it is copied there at its stored dtype and built there (the builds move
    data only: reorders, concatenations). `threads=0`: the previous path, each tensor an mmap view
    (`Checkpoint.get`) built on the CPU and copied once to its target (kept for `bench/load.py`'s comparison).

    `hook` transforms tensors as they are read (`hook.transform(name, tensor)` returns the entries to keep in its
    place, e.g. an FP8 weight and its scales), so a transformed layer never exists whole in its stored precision;
    `hook.prepare(module)` then gives the meta module the matching structure before the tensors are assigned.

    `mapped(name)`: tensors that are not read at all. Each becomes the file's mapping itself (a zero-copy view at the
    stored dtype, no page of it touched), passed by no hook: what `accel.adaln` streams from when it makes a
    schedule's tables, for AdaLN weights kept as page cache (`AdalnWeights.MAPPED`). Only for a tensor stored as is
    (one key, no reordering).
    """
    if threads < 0:
        raise ValueError(f"threads must be 0 (the mmap copy) or more, got {threads}")
    start = time.perf_counter()
    expected = dict(module.state_dict(keep_vars=True))
    device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", to compare with a tensor's device
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

    kept_mapped = {name for name in plan if mapped is not None and mapped(name)}
    keys = [key for name, src in plan.items() if name not in kept_mapped for key in src.keys]
    reader = TensorReader(ckpt.files_of(keys), threads=threads) if threads and keys else None
    stream = reader.read(keys) if reader is not None else _mmap_tensors(ckpt, keys)
    to_device = reader is not None and device.type != "cpu"  # fresh CPU buffers: built on the target device
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
            target = expected[name]
            where = ", ".join(
                f"{ckpt.file_of(k)}: key {k!r} {list(t.shape)}" for k, t in zip(src.keys, tensors, strict=True)
            )
            if to_device:
                tensors = [t.to(device) for t in tensors]
            try:
                tensor = src.build(tensors)
            except RuntimeError as err:  # a view/reshape that the stored shape cannot satisfy
                raise CheckpointError(f"{where}: wrong shape for {name} {list(target.shape)}: {err}") from err
            if tensor.shape != target.shape:
                raise CheckpointError(f"{where}: wrong shape, expected {list(target.shape)} for {name}")
            views = [] if reader is not None else tensors  # the reader's buffers are fresh allocations, not views
            tensor = _owned(tensor, views, device=device, dtype=dtype_of(name))
            del tensors
            if hook is None:
                state[name] = tensor
            else:
                state.update(hook.transform(name, tensor))
                del tensor  # a transformed tensor's stored form is dropped here, one tensor at a time
    finally:
        stream.close()  # a reader's reads in flight end here (a load that stops early), then its files close
        if reader is not None:
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
        threads=threads if reader is not None else 0,
        peak_ahead=reader.peak_ahead if reader is not None else 0,
    )


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


def _owned(
    tensor: torch.Tensor, views: list[torch.Tensor], *, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """`tensor` at `device` and `dtype` in a contiguous, 64-byte aligned allocation of its own.

    safetensors hands out zero-copy views into its mmap at the offsets the file's header gives (8-byte aligned at
    best), and `.to()` of a view already at its target dtype and device returns the view. A model made of such views
    computes differently with the layout of the file it came from: CPU GEMM kernels take other paths, and round
    otherwise, for a weight that is not 64-byte aligned, so the same weights rendered other frames from the diffusers
    folder than from a single file (issue 22, on AMD EPYC). So every tensor is copied, once, straight from the
    mapping into a fresh allocation of its final dtype on its final device; a build that already made a fresh tensor
    there (a QKV reorder, a concatenation), or a reader's buffer already at its final dtype and device, is kept, not
    copied again. `views`: the tensors read as views into a file's mapping (none from a `TensorReader`), which
    `tensor` must not be. One tensor at a time: the model never exists twice.
    """
    mappings = {t.untyped_storage().data_ptr() for t in views}
    fresh = (
        tensor.device == device
        and tensor.dtype == dtype
        and tensor.is_contiguous()
        and tensor.data_ptr() % ALIGNMENT == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes  # holds this tensor and nothing else
        and tensor.untyped_storage().data_ptr() not in mappings
    )
    if fresh:
        return tensor
    out = torch.empty(tensor.shape, dtype=dtype, device=device)
    out.copy_(tensor)  # converts and transfers in the one copy
    return out


# ----------------------------------------------------------------------------------------------- the DiT


DIT_NAMINGS = ("original", "diffusers")
QKV_LAYOUTS = ("stacked", "interleaved")


@dataclass(frozen=True)
class DiTLayout:
    """How a DiT checkpoint stores our tensors: its key naming and, for original names, the fused QKV row order
    (None for diffusers names, which store q, k and v apart)."""

    naming: str
    qkv: str | None

    def __str__(self) -> str:
        return self.naming if self.qkv is None else f"{self.naming} names, {self.qkv} QKV"


def naming_by_marker(ckpt: Checkpoint, what: str, markers: Mapping[str, str]) -> str:
    """Which published naming a checkpoint uses, from one key only that naming has (naming -> marker key)."""
    for naming, key in markers.items():
        if key in ckpt:
            return naming
    seen = " nor ".join(f"{key!r} ({naming})" for naming, key in markers.items())
    raise CheckpointError(f"{ckpt.root}: not an H3 {what} checkpoint: neither {seen} is present")


def detect_dit_naming(ckpt: Checkpoint) -> str:
    markers = {"original": "blocks.0.attn.qkv_proj.weight", "diffusers": "transformer_blocks.0.attn.to_q.weight"}
    return naming_by_marker(ckpt, "DiT", markers)


def resolve_dit_layout(ckpt: Checkpoint, qkv_layout: str | None = None) -> DiTLayout:
    """The layout of a DiT checkpoint: naming from the keys, QKV order from the release or from `qkv_layout`.

    The original shards are interleaved and diffusers shards split, so `qkv_layout` may only confirm them; for a
    single file with original names it decides (None: stacked, with a warning that says how to change it).
    """
    if qkv_layout is not None and qkv_layout not in QKV_LAYOUTS:
        raise ValueError(f"qkv_layout must be one of {', '.join(QKV_LAYOUTS)}, got {qkv_layout!r}")
    naming = detect_dit_naming(ckpt)
    if naming == "diffusers":
        if qkv_layout is not None:
            raise ValueError(
                f"{ckpt.root}: qkv_layout applies only to a single-file DiT with original key names; this checkpoint "
                f"has diffusers names, which store to_q / to_k / to_v apart"
            )
        return DiTLayout("diffusers", None)
    if ckpt.sharded:
        if qkv_layout not in (None, "interleaved"):
            raise ValueError(
                f"{ckpt.root}: the sharded original DiT (FL2VA/transformer) interleaves QKV per head; "
                f"qkv_layout={qkv_layout!r} applies only to a single-file DiT"
            )
        return DiTLayout("original", "interleaved")
    if qkv_layout is None:
        log.warning(
            "%s: a single-file DiT does not record its QKV row order; assuming stacked [q; k; v], as in every "
            "published single file. For a file merged from the original shards, pass --qkv-layout interleaved",
            ckpt.root,
        )
        qkv_layout = "stacked"
    return DiTLayout("original", qkv_layout)


def _deinterleave_qkv(heads: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def build(ts: list[torch.Tensor]) -> torch.Tensor:
        w = ts[0]  # (H * 3 * D, hidden) as [h0: q k v, h1: q k v, ...] -> (3 * H * D, hidden) as [q; k; v]
        return w.view(heads, 3, -1, w.shape[-1]).transpose(0, 1).reshape(w.shape)

    return build


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0)


def _swap_halves(ts: list[torch.Tensor]) -> torch.Tensor:
    value, gate = ts[0].chunk(2, dim=0)  # diffusers [value; gate] -> ours [gate; value]
    return torch.cat((gate, value), dim=0)


# Our (original) name prefix -> diffusers name prefix, for the parts that are a pure rename.
_DIFFUSERS_RENAMES = (
    ("video_patch_proj.", "proj_in."),
    ("audio_patch_proj.", "audio_proj_in."),
    ("condition_proj.", "context_embedder."),
    ("time_embedder.proj_in.", "time_embedder.linear_1."),
    ("time_embedder.proj_out.", "time_embedder.linear_2."),
    ("token_refiner.blocks.", "token_refiner.refiner_blocks."),
    ("blocks.", "transformer_blocks."),
    ("final_layer.norm.", "norm_out.norm."),
    ("final_layer.adaln_proj.linear.", "norm_out.linear."),
    ("final_layer.video_out.", "proj_out."),
    ("final_layer.audio_out.", "audio_proj_out."),
)
_DIFFUSERS_SUFFIXES = (
    ("attn.q_norm.", "attn.norm_q."),
    ("attn.k_norm.", "attn.norm_k."),
    ("attn.out_proj.", "attn.to_out.0."),
    ("mlp.fc1.", "ff.net.0.proj."),
    ("mlp.fc2.", "ff.net.2."),
)


def diffusers_name(name: str) -> str:
    for ours, theirs in _DIFFUSERS_RENAMES:
        if name.startswith(ours):
            name = theirs + name[len(ours) :]
            break
    for ours, theirs in _DIFFUSERS_SUFFIXES:
        name = name.replace(ours, theirs)
    return name


def dit_plan(model: H3DiT, layout: DiTLayout, ckpt_keys: frozenset[str]) -> dict[str, Source]:
    """Module name -> Source for one DiT layout."""
    cfg = model.config
    plan: dict[str, Source] = {}
    for name in model.state_dict():
        if name == "rope.inv_freq":
            # Recomputable (bit-identical); the original shards store it, diffusers and some single files do not.
            stored = layout.naming == "original" and name in ckpt_keys
            plan[name] = (
                Source((name,)) if stored else Source((), lambda _: inv_freq(cfg.rope_inv_freq_len, cfg.rope_theta))
            )
        elif layout.naming == "diffusers":
            theirs = diffusers_name(name)
            if name.endswith("attn.qkv_proj.weight"):
                stem = theirs[: -len("qkv_proj.weight")]
                plan[name] = Source(tuple(f"{stem}to_{p}.weight" for p in "qkv"), _cat)
            elif name.endswith("mlp.fc1.weight"):
                plan[name] = Source((theirs,), _swap_halves)
            else:
                plan[name] = Source((theirs,))
        elif layout.qkv == "interleaved" and name.endswith("attn.qkv_proj.weight"):
            plan[name] = Source((name,), _deinterleave_qkv(cfg.num_attention_heads))
        else:
            plan[name] = Source((name,))
    return plan


def _find_dit_config(path: Path) -> Path | None:
    folder = path if path.is_dir() else path.parent
    candidate = folder / "config.json"
    return candidate if candidate.is_file() else None


def load_dit(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    config: DiTConfig | None = None,
    qkv_layout: str | None = None,
    hook: LoadHook | None = None,
    mapped: Callable[[str], bool] | None = None,
    threads: int = DEFAULT_THREADS,
    on_stats: Callable[[LoadStats], None] | None = None,
) -> H3DiT:
    """Load the H3 DiT from any published layout (see the module docstring; `qkv_layout` as in
    `resolve_dit_layout`).

    `dtype` is the compute dtype of the block stack; the fp32 islands stay float32. The checkpoint must store the
    released dtypes: float32 for the islands, bfloat16 for everything else. The config comes from `config`, else the
    `config.json` in the folder (required for a folder), else, for a single community file (they ship none), the
    released H3 configuration, with a warning. `hook`: a per-tensor transform applied as the weights are read (the
    FP8 linear backend quantizes the block linears this way). `mapped`: tensors left as the file's mapping, unread,
    and `threads`: how the rest is read (0: the previous mmap copy), as in `assign_from_checkpoint`. The load's
    bytes and seconds are logged at INFO ("DiT: X.X GB in Y.Y s (Z.ZZ GB/s)") and given to `on_stats` (for a caller
    that records them: `bench/load.py`).
    """
    path = Path(path)
    if config is None:
        found = _find_dit_config(path)
        if found is not None:
            config = DiTConfig.from_json(found)
        elif path.is_dir():
            # Both released folder layouts ship a config.json; a folder without one is incomplete.
            raise CheckpointError(f"{path}: config.json is missing (the released transformer folders ship one)")
        else:
            log.warning("%s: no config.json beside the weights; using the released H3 DiT configuration", path)
            config = DiTConfig()
    ckpt = open_checkpoint(path)
    layout = resolve_dit_layout(ckpt, qkv_layout)
    with torch.device("meta"):
        model = H3DiT(config)
    plan = dit_plan(model, layout, ckpt.keys())
    island_keys = {key for name, src in plan.items() if is_fp32_name(name) for key in src.keys}
    stats = assign_from_checkpoint(
        model,
        ckpt,
        plan,
        device=device,
        dtype_of=lambda name: torch.float32 if is_fp32_name(name) else dtype,
        ckpt_dtype_of=lambda key: torch.float32 if key in island_keys else torch.bfloat16,
        hook=hook,
        mapped=mapped,
        threads=threads,
    )
    log.info("loaded H3 DiT from %s (%s, %s, %s)", path, layout, dtype, device)
    log.info("DiT: %s", stats)
    if on_stats is not None:
        on_stats(stats)
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------- the text encoder


def checkpoint_key_map(key: str, layer: int, vision: bool) -> str | None:
    """Map a `Qwen3VLForConditionalGeneration` key to our `Qwen3VLModel` key, or None to skip it."""
    if not key.startswith("model."):
        return None  # lm_head
    key = key.removeprefix("model.")
    if key.startswith("visual."):
        return key if vision else None
    if key.startswith("language_model.layers."):
        return key if int(key.split(".")[2]) < layer else None
    if key == "language_model.norm.weight":
        return None
    return key


def load_qwen3vl_prefix(
    folder: str | Path,
    *,
    layer: int = TEXT_ENCODER_LAYER,
    vision: bool = True,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    hook: LoadHook | None = None,
) -> Qwen3VLModel:
    """Load decoder layers 0..layer-1 (and the vision tower if `vision`) of a released Qwen3-VL folder.

    Strict like the other loaders: every tensor the prefix needs must be there, in the dtype the folder's config
    declares (bfloat16 in the release), with the right shape; keys past the prefix (later layers, the final norm,
    the LM head, the vision tower when not wanted) must be the ones `checkpoint_key_map` skips, and are never read.
    Each tensor is read (`assign_from_checkpoint`) and placed at `device` and `dtype` once; `hook` may transform it
    on the way (the FP8 text encoder quantizes the decoder layers' linears as they are read). The load's bytes and
    seconds are logged at INFO ("text encoder: X.X GB in Y.Y s (Z.ZZ GB/s)").
    """
    folder = Path(folder)
    config = Qwen3VLConfig.from_pretrained(str(folder), local_files_only=True)
    stored = config.dtype or config.text_config.dtype or torch.bfloat16
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    model = truncated_qwen3vl(config, layer, vision)
    ckpt = open_checkpoint(folder)
    plan = {name: Source((f"model.{name}",)) for name in model.state_dict()}
    skipped = frozenset(k for k in ckpt if checkpoint_key_map(k, layer, vision) is None)
    stats = assign_from_checkpoint(
        model,
        ckpt,
        plan,
        device=device,
        dtype_of=lambda _: dtype,
        ckpt_dtype_of=lambda _: stored,
        unused=skipped,
        hook=hook,
    )
    log.info("text encoder: %s", stats)
    materialize_buffers(model)
    return model.to(device)


def load_text_encoder(
    text_encoder_dir: str | Path,
    tokenizer_dir: str | Path,
    processor_dir: str | Path | None = None,
    *,
    layer: int = TEXT_ENCODER_LAYER,
    vision: bool = True,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    hook: LoadHook | None = None,
) -> TextEncoder:
    """The released `text_encoder/`, `tokenizer/` and `processor/` folders (processor needed only with vision)."""
    if vision and processor_dir is None:
        raise ValueError("vision=True needs processor_dir (the released processor/ folder)")
    model = load_qwen3vl_prefix(text_encoder_dir, layer=layer, vision=vision, device=device, dtype=dtype, hook=hook)
    processor = load_image_processor(processor_dir) if vision else None
    return TextEncoder(model, load_tokenizer(tokenizer_dir), processor)
