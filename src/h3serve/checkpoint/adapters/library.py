"""The adapters a server may apply per request (`H3_ADAPTERS`), by name: each read and checked against the DiT at
start (`read_adapter`, every format), then held in host memory (page-locked where a GPU copies from it) by a cache
bounded in bytes, the least recently used given up first. One given up is read again on its next use, and must be the
file that was checked: the same size and modification time, and the same targets and ranks, or the use is refused.

What a request may name is `Catalog` (names, default scales, presets: no tensors), which the admission holds; the
factors are the library's, which the engine's `accel.lora.RuntimeAdapters` copies from when a request names them.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from h3serve.checkpoint.adapters.formats import AdapterError
from h3serve.checkpoint.adapters.read import Adapter, read_adapter
from h3serve.config import DiTConfig

_BLOCK_INDEX = re.compile(r"^(blocks|token_refiner\.blocks)\.\d+\.")
RANK_MULTIPLE = 16  # run-time buffers' ranks are padded to this (GEMM dimensions of 16: tensor-core friendly)
MAX_SCALE = 4.0  # |scale| a request may give an adapter: past it a low-rank delta swamps the weights it sits on


@dataclass(frozen=True)
class Entry:
    """What a request may know of a declared adapter: its name, file, default scale and what the start read of it
    (`adapter`, its deltas dropped), and what its delta takes: per target, the rank it adds (q, k and v of the fused
    QKV each their own), and its factors' bytes."""

    name: str
    adapter: Adapter  # metadata only (deltas ())
    ranks: Mapping[str, int]
    nbytes: int

    @property
    def path(self) -> Path:
        return self.adapter.path

    @property
    def scale(self) -> float:
        return self.adapter.scale

    @property
    def preset(self):
        return self.adapter.preset

    @property
    def dit_kind(self) -> str | None:
        return None if self.adapter.preset is None else self.adapter.preset.dit_kind

    def describe(self) -> str:
        return f"{self.name} = {self.adapter.describe()}, {self.nbytes / 2**30:.2f} GiB"


@dataclass(frozen=True)
class Catalog:
    """The adapters a request may name (by name, in declaration order) and how many at once (`max_active`: what the
    engine's buffers are sized for)."""

    entries: Mapping[str, Entry] = dataclasses.field(default_factory=dict)
    max_active: int = 0

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)


def _stamp(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _layout(adapter: Adapter) -> dict[str, int]:
    ranks: dict[str, int] = {}
    for d in adapter.deltas:
        if d.rank is not None:
            ranks[d.target] = ranks.get(d.target, 0) + d.rank
    return ranks


def _nbytes(adapter: Adapter) -> int:
    return sum(t.numel() * t.element_size() for d in adapter.deltas for t in (d.up, d.down) if t is not None)


def _pinned(adapter: Adapter) -> Adapter:
    """The adapter with every factor in page-locked memory (copies from it to a GPU run without a staging copy)."""
    pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
    deltas = tuple(dataclasses.replace(d, up=pin(d.up), down=pin(d.down)) for d in adapter.deltas)
    return dataclasses.replace(adapter, deltas=deltas)


@dataclass(frozen=True)
class Declaration:
    """What H3_ADAPTERS and its two companions declare, picklable (each GPU worker opens its own library from it)."""

    adapters: tuple[tuple[str, Path, float], ...]  # (name, file, default scale), in order
    cache_bytes: int
    max_active: int

    def open(self, config: DiTConfig, pin: bool = False) -> AdapterLibrary:
        return AdapterLibrary(self.adapters, config, self.cache_bytes, self.max_active, pin=pin)


class AdapterLibrary:
    """The declared adapters (`declared`: (name, path, default scale) in order), read and checked against the DiT of
    `config` now; up to `cache_bytes` of their factors held in host memory (`pin`: page-locked). An adapter larger
    than the cache, a name twice, or a file that does not read is an AdapterError (or ValueError) here, at start."""

    def __init__(
        self,
        declared: Sequence[tuple[str, Path, float]],
        config: DiTConfig,
        cache_bytes: int,
        max_active: int,
        pin: bool = False,
    ):
        self.config = config
        self.declaration = Declaration(
            tuple((n, Path(p), float(s)) for n, p, s in declared), int(cache_bytes), max_active
        )
        self.cache_bytes = int(cache_bytes)
        self.pin = pin
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[str, Adapter] = collections.OrderedDict()
        self._stamps: dict[str, tuple[int, int]] = {}
        self.reads = 0  # files read again after start (a use after the cache gave them up)
        self.evictions = 0
        entries: dict[str, Entry] = {}
        for name, path, scale in declared:
            if name in entries:
                raise ValueError(f"adapter name {name!r} is declared twice")
            adapter, stamp = self._read(Path(path), scale)
            full = next((d for d in adapter.deltas if d.down is None), None)
            if full is not None:
                why = f"has a full-rank delta on {full.target}, which only a merge applies: merge it at load (H3_LORA)"
                raise AdapterError(adapter.path, why + " instead of applying it per request", key=full.key)
            entry = Entry(name, dataclasses.replace(adapter, deltas=()), _layout(adapter), _nbytes(adapter))
            if entry.nbytes > self.cache_bytes:
                raise ValueError(
                    f"adapter {name} ({entry.path.name}) holds {entry.nbytes / 2**30:.2f} GiB of factors; the adapter "
                    f"cache holds {self.cache_bytes / 2**30:.2f} GiB: raise it to at least that"
                )
            entries[name] = entry
            self._stamps[name] = stamp
            self._keep(name, adapter)
        self.catalog = Catalog(entries, max_active)

    def _read(self, path: Path, scale: float) -> tuple[Adapter, tuple[int, int]]:
        stamp = _stamp(path)
        adapter = read_adapter(path, scale, config=self.config)
        return (_pinned(adapter) if self.pin else adapter), stamp

    def _keep(self, name: str, adapter: Adapter) -> None:
        """Hold `adapter`, giving up the least recently used ones until the cache's bound holds."""
        self._held[name] = adapter
        self._held.move_to_end(name)
        while self.held_bytes > self.cache_bytes:
            del self._held[next(iter(self._held))]
            self.evictions += 1

    @property
    def held(self) -> tuple[str, ...]:
        """The adapters in host memory now, least recently used first."""
        return tuple(self._held)

    @property
    def held_bytes(self) -> int:
        return sum(_nbytes(a) for a in self._held.values())

    def get(self, name: str) -> tuple[Adapter, float]:
        """The declared adapter `name` with its factors, and the seconds a read from disk took (0.0: it was held).
        AdapterError if its file is not the one checked at start."""
        entry = self.catalog.entries.get(name)
        if entry is None:
            raise KeyError(f"adapter {name!r} is not declared; declared: {', '.join(self.catalog.names) or 'none'}")
        with self._lock:
            held = self._held.get(name)
            if held is not None:
                self._held.move_to_end(name)
                return held, 0.0
            start = time.perf_counter()
            try:
                stamp = _stamp(entry.path)
            except OSError as err:
                raise AdapterError(entry.path, f"cannot be read again: {err.strerror}") from err
            if stamp != self._stamps[name]:
                raise AdapterError(entry.path, "changed since the server checked it at start (size or modification "
                                   "time): restart the server to declare the new file")  # fmt: skip
            adapter, _ = self._read(entry.path, entry.scale)
            if _layout(adapter) != dict(entry.ranks):
                raise AdapterError(entry.path, "no longer has the targets and ranks it had at start")
            self.reads += 1
            self._keep(name, adapter)
            return adapter, time.perf_counter() - start


def catalog_of(library: AdapterLibrary | None) -> Catalog:
    return Catalog() if library is None else library.catalog


def role(target: str) -> str:
    """A target's name with its block's index replaced by `*`: every block's tensor of one kind shares a role."""
    return _BLOCK_INDEX.sub(r"\1.*.", target, count=1)


def buffer_ranks(catalog: Catalog, shapes: Mapping[str, tuple[int, ...]], applied: int | None = None) -> dict[str, int]:
    """Per weight of the DiT (`shapes`: every tensor's, `Names.of(config).shapes`), the rank its run-time buffers
    need for `applied` adapters at once (default: the catalog's `max_active`): the sum of that many largest ranks any
    declared adapter adds there (any choice of that many adapters fits), then the largest of its role's, so every
    block's linears of one kind are alike (one compiled graph for all blocks, one layout for streamed ones), rounded
    up to a multiple of 16. Weights no adapter touches in any block get none."""
    per: dict[str, list[int]] = {}
    for entry in catalog.entries.values():
        for target, rank in entry.ranks.items():
            per.setdefault(target, []).append(rank)
    roles: dict[str, int] = {}
    for target, ranks in per.items():
        need = sum(sorted(ranks, reverse=True)[: applied or catalog.max_active])
        roles[role(target)] = max(roles.get(role(target), 0), need)
    return {t: -(-roles[role(t)] // RANK_MULTIPLE) * RANK_MULTIPLE for t in shapes if role(t) in roles}


def buffer_bytes(
    catalog: Catalog, shapes: Mapping[str, tuple[int, ...]], element_size: int = 2, fp8_copies: bool = False
) -> int:
    """Device bytes of one DiT's run-time buffers: down (rank, in) and up (out, rank) per wrapped linear, and with
    `fp8_copies` (CUTLASS linears) the down factor's FP8 copy and its scales. For CUTLASS an upper bound: counted at
    every target (the AdaLN projections are no FP8 GEMMs), and a resident FP8 base holds its factors in FP8 only
    (`accel.lora.LoraLinear`'s wide buffer), fewer bytes than the compute-dtype factors counted."""
    ranks = buffer_ranks(catalog, shapes)
    factors = sum(r * (shapes[t][0] + shapes[t][1]) * element_size for t, r in ranks.items())
    return factors + (sum(r * (shapes[t][1] + 4) for t, r in ranks.items()) if fp8_copies else 0)
