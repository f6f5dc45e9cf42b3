"""Where each part of the model lives for a device memory budget: resident on the device, or waiting in page-locked
host memory and streamed in when it runs (`accel.offload`).

    DiT blocks      resident, or streamed through a ring of `SLOTS` device slots; the streamed ones spread evenly
                    over the stack, so each copy has the compute of the resident blocks between to hide behind
    text encoder    its decoder layers resident, or streamed (one forward per request)
    video VAE       resident, or visiting the device for the keyframes' encode and the decode

`place` chooses from a memory plan (`pipeline.budget.Budget`) and the budget (the device's free memory, or
H3_DEVICE_MEMORY_GIB): with H3_OFFLOAD=auto, nothing streams where everything fits the largest request the rules
allow; otherwise, in order, the text encoder's layers stream, the video VAE visits, and DiT blocks stream one at a time
until the largest request fits. Where even every block streamed cannot hold the largest request, the largest that
fits is admitted (`max_rows`, refused above with a 400 naming it) and a start that cannot hold the default request is
refused. H3_OFFLOAD=all streams everything (the most device memory left over; what the tests run); none keeps
today's all-resident plan. One memory pool (an integrated GPU) streams nothing: there is nowhere else to put it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from h3serve.accel.profile import Offload
from h3serve.pipeline.budget import OVERHEAD_GIB, gib_text

if TYPE_CHECKING:
    from h3serve.pipeline.budget import Budget

SLOTS = 2  # device slots a streamed stack cycles through: one computing, one filling


class PlacementError(ValueError):
    """No placement holds the default request in the device memory budget."""


@dataclass(frozen=True)
class Placement:
    """Where each part lives (see the module docstring). The default is everything resident."""

    dit_streamed: tuple[int, ...] = ()  # DiT block indices streamed (each loaded DiT the same)
    dit_blocks: int = 0  # the DiT's blocks
    slots: int = SLOTS
    text_streamed: bool = False
    video_vae_visits: bool = False
    max_rows: int | None = None  # packed rows the budget admits (None: every request the rules allow)
    budget_gib: float | None = None  # the device memory planned within (None: not planned)
    device_gib: float = 0.0  # the planned peak on the device (at `max_rows`, or the largest request)
    pinned_gib: float = 0.0  # page-locked host memory the streamed parts take

    @property
    def streams(self) -> bool:
        return bool(self.dit_streamed) or self.text_streamed or self.video_vae_visits

    def dit_host_names(self):
        """A predicate for the DiT tensor names that wait in host memory (a load sends them there as read)."""
        from h3serve.checkpoint.adapters.read import is_block_adaln

        prefixes = tuple(f"blocks.{i}." for i in self.dit_streamed)
        return lambda name: name.startswith(prefixes) and not is_block_adaln(name)

    def text_host_names(self):
        from h3serve.pipeline.budget import TEXT_LAYERS

        prefix = f"{TEXT_LAYERS}."  # as the text encoder's load names them (the Qwen3-VL model's own names)
        return lambda name: self.text_streamed and name.startswith(prefix)

    def describe(self) -> str:
        if not self.streams:
            where = "everything resident on the device"
        else:
            parts = []
            if self.dit_streamed:
                parts.append(f"DiT {len(self.dit_streamed)} of {self.dit_blocks} blocks streamed ({self.slots} slots)")
            else:
                parts.append("DiT resident")
            parts.append("text encoder layers streamed" if self.text_streamed else "text encoder resident")
            parts.append("video VAE visits for encode/decode" if self.video_vae_visits else "video VAE resident")
            where = ", ".join(parts) + f"; {self.pinned_gib:.1f} GiB of page-locked host memory for them"
        if self.budget_gib is not None:
            rows = "every request the rules allow" if self.max_rows is None else f"up to {self.max_rows:,} packed rows"
            peak = f"peak {self.device_gib:.1f} GiB"
            where += f"; planned within {self.budget_gib:.1f} GiB of device memory, {peak}, {rows}"
        return where

    def as_dict(self) -> dict:
        """What /health and the render header show."""
        return {
            "dit_blocks_streamed": len(self.dit_streamed),
            "dit_blocks": self.dit_blocks,
            "slots": self.slots if self.dit_streamed or self.text_streamed else 0,
            "text_encoder_streamed": self.text_streamed,
            "video_vae_visits": self.video_vae_visits,
            "max_rows": self.max_rows,
            "device_budget_gib": None if self.budget_gib is None else round(self.budget_gib, 2),
            "pinned_host_gib": round(self.pinned_gib, 2),
        }


RESIDENT = Placement()


def spread(streamed: int, blocks: int) -> tuple[int, ...]:
    """`streamed` of `blocks` indices, evenly spaced (all of them when equal)."""
    return tuple(sorted({int((j + 0.5) * blocks / streamed) for j in range(streamed)})) if streamed else ()


def _dits(budget: Budget) -> int:
    return sum(1 for name in budget.device if name in ("dit", "ref_dit"))


@dataclass(frozen=True)
class _Option:
    streamed: int
    text: bool
    video: bool


def _weights(budget: Budget, option: _Option, slots: int) -> float:
    """Device GiB of weights (and tables) while the DiT runs under `option`."""
    st = budget.streamable
    assert st is not None
    weights = budget.device_weights
    if option.streamed:
        weights -= _dits(budget) * (option.streamed - min(slots, option.streamed)) * st.dit_block
    if option.text:
        weights -= (st.text_layers - min(slots, st.text_layers)) * st.text_layer
    if option.video:
        weights -= st.video_vae
    return weights


def _needs(budget: Budget, option: _Option, slots: int) -> tuple[float, float]:
    """(device GiB of weights while the DiT runs, device GiB the decode needs) under `option`."""
    st = budget.streamable
    assert st is not None
    weights = _weights(budget, option, slots)
    return weights, weights + (st.video_vae if option.video else 0.0) + OVERHEAD_GIB


def _pinned(budget: Budget, option: _Option) -> float:
    st = budget.streamable
    assert st is not None
    return (
        _dits(budget) * option.streamed * st.dit_block
        + (st.text_layers * st.text_layer if option.text else 0.0)
        + (st.video_vae if option.video else 0.0)
    )


def place(
    budget: Budget,
    device_gib: float,
    offload: Offload | str = Offload.AUTO,
    slots: int = SLOTS,
    one_pool: bool | None = None,
) -> Placement:
    """The placement for `budget` within `device_gib` (see the module docstring); PlacementError when none holds the
    default request. With `offload` none the resident placement comes back as it is (the caller's `check_fits` says
    whether it fits). `one_pool`: an integrated GPU (None: `budget.shared`); the CPU counts as one pool in the budget
    but streams when told to (copies within host memory: the path the CPU tests run)."""
    offload = Offload(offload)
    st = budget.streamable
    if offload == Offload.NONE or st is None:
        return RESIDENT
    if budget.shared if one_pool is None else one_pool:
        if offload == Offload.ALL:
            raise PlacementError(
                "H3_OFFLOAD=all: this GPU's memory is the host's (one pool), so there is nowhere to stream from; use "
                "auto or none"
            )
        # Nothing streams; where the pool holds the default request but not the largest (BF16 on a 128 GB Spark),
        # the largest that fits is admitted.
        fixed = budget.pool_need(0.0)
        rows = math.floor((device_gib - fixed) / st.activation_per_row)
        if rows >= budget.largest_rows or rows < budget.default_rows:
            return RESIDENT  # everything fits, or nothing does (`check_fits` says by how much)
        return Placement(max_rows=rows, budget_gib=device_gib, device_gib=fixed + rows * st.activation_per_row)
    blocks = st.dit_blocks
    options = [_Option(blocks, True, True)]
    if offload == Offload.AUTO:
        options = [_Option(0, False, False), _Option(0, True, False), _Option(0, True, True)]
        # Whole turns of the ring (a multiple of the slots): a count that wraps onto a busy slot copies one block a
        # forward without overlap.
        counts = sorted({min(blocks, -(-s // slots) * slots) for s in range(1, blocks + 1)})
        options += [_Option(s, True, True) for s in counts]
    for option in options:
        weights, decode = _needs(budget, option, slots)
        peak = max(weights + budget.activations_largest + OVERHEAD_GIB, decode)
        if peak <= device_gib:
            return _placement(budget, option, slots, None, device_gib, peak)
    option = options[-1]  # the most streamed: the largest request that fits it is admitted
    weights, decode = _needs(budget, option, slots)
    rows = math.floor((device_gib - weights - OVERHEAD_GIB) / st.activation_per_row)
    default_need = max(weights + budget.activations_default + OVERHEAD_GIB, decode)
    if rows < budget.default_rows or decode > device_gib:
        raise PlacementError(
            f"needs {default_need:.1f} GiB on the device for the default request even with every part streamed "
            f"({weights:.1f} GiB of resident weights and slots, {budget.activations_default:.1f} GiB of activations "
            f"for its {budget.default_rows:,} rows, {OVERHEAD_GIB:.1f} GiB overhead), "
            f"{gib_text(device_gib)} GiB to plan within: {default_need - device_gib:.1f} GiB missing"
        )
    rows = min(rows, budget.largest_rows)
    peak = max(weights + rows * st.activation_per_row + OVERHEAD_GIB, decode)
    return _placement(budget, option, slots, rows if rows < budget.largest_rows else None, device_gib, peak)


def _placement(
    budget: Budget, option: _Option, slots: int, max_rows: int | None, device_gib: float, peak: float
) -> Placement:
    st = budget.streamable
    assert st is not None
    return Placement(
        dit_streamed=spread(option.streamed, st.dit_blocks),
        dit_blocks=st.dit_blocks,
        slots=slots,
        text_streamed=option.text,
        video_vae_visits=option.video,
        max_rows=max_rows,
        budget_gib=device_gib,
        device_gib=peak,
        pinned_gib=_pinned(budget, option),
    )
