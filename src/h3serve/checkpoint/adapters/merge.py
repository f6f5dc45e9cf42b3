"""Merging read adapters into the DiT's weights: `W' = W + sum_i(scale_i * file_scale_i * B_i @ A_i)` (plus full-rank
deltas), computed in float32 and rounded once to W's dtype. `AdapterMerge` does it per tensor as a checkpoint streams
in (a `LoadHook`, placed before any quantizing hook), `merge_into` to a model that already exists (the tiny model).
The AdaLN tables are made from the DiT's weights, so a merged AdaLN LoRA is simply in them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from h3serve.checkpoint.adapters.formats import AdapterError, Delta
from h3serve.checkpoint.adapters.read import Adapter

_Term = tuple[Delta, float]  # a delta and the user's scale of its adapter


def _terms(adapters: Sequence[Adapter]) -> dict[str, list[_Term]]:
    terms: dict[str, list[_Term]] = {}
    for adapter in adapters:
        for d in adapter.deltas:
            terms.setdefault(d.target, []).append((d, adapter.scale))
    return terms


def merged(tensor: torch.Tensor, terms: Sequence[_Term]) -> torch.Tensor:
    """`tensor` plus every term's delta: summed in float32 on the tensor's device, rounded once to its dtype."""
    total = tensor.to(torch.float32, copy=True)
    for d, user_scale in terms:
        up = d.up.to(tensor.device, torch.float32)
        rows = total[d.row : d.row + up.shape[0]]
        if d.down is None:
            rows.add_(up, alpha=user_scale * d.scale)
        else:
            rows.addmm_(up, d.down.to(tensor.device, torch.float32), alpha=user_scale * d.scale)
    return total.to(tensor.dtype)


class AdapterMerge:
    """Load hook: each native tensor an adapter changes comes out merged (`merged`); the others pass untouched.
    Put it first in a chain, before a hook that quantizes or moves weights."""

    def __init__(self, adapters: Sequence[Adapter]):
        self.adapters = tuple(adapters)
        self._terms = _terms(self.adapters)
        self.seconds = 0.0  # time spent merging, summed over the load (a line of the load report)
        # target -> (its shape when read, the first adapter and key that change it), for messages
        self._read: dict[str, tuple[tuple[int, ...], Path, str]] = {}
        for a in self.adapters:
            for d in a.deltas:
                shape, path, _ = self._read.setdefault(d.target, (a.shapes[d.target], a.path, d.key))
                if shape != a.shapes[d.target]:
                    raise AdapterError(
                        a.path,
                        f"was read for {d.target} {list(a.shapes[d.target])}; {path} for {list(shape)}",
                        key=d.key,
                    )

    def transform(self, name: str, tensor: torch.Tensor) -> Mapping[str, torch.Tensor]:
        terms = self._terms.get(name)
        if terms is None:
            return {name: tensor}
        shape, path, key = self._read[name]
        if tuple(tensor.shape) != shape:
            raise AdapterError(
                path, f"was read for {name} {list(shape)}; the checkpoint's is {list(tensor.shape)}", key=key
            )
        start = time.perf_counter()
        out = merged(tensor, terms)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.seconds += time.perf_counter() - start
        return {name: out}

    def prepare(self, module: nn.Module) -> None:
        """Nothing: the merge keeps every tensor's name, shape and dtype."""


@torch.no_grad()
def merge_into(dit: nn.Module, adapters: Sequence[Adapter]) -> None:
    """Merge `adapters` into an already-built DiT in place, tensor by tensor. Every target is checked against the
    model (present, same shape, floating point) before any weight changes."""
    state = dit.state_dict(keep_vars=True)
    for adapter in adapters:
        for target, shape in sorted(adapter.shapes.items()):
            tensor = state.get(target)
            if tensor is None or tuple(tensor.shape) != shape or not tensor.is_floating_point():
                found = "missing" if tensor is None else f"{list(tensor.shape)} {tensor.dtype}"
                key = next(d.key for d in adapter.deltas if d.target == target)
                raise AdapterError(
                    adapter.path, f"was read for {target} {list(shape)}; this model's is {found}", key=key
                )
    for target, terms in sorted(_terms(adapters).items()):
        tensor = state[target]
        tensor.data.copy_(merged(tensor.data, terms))
