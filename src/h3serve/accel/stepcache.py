"""Step caching (opt-in, lossy): cache-dit's DBCache ("Dual Block Cache") built natively on the DiT's block stack.

One DiT forward is one step. The first `Fn_compute_blocks` blocks always run; the relative L1 change of their
residual against the last fully computed step decides whether the middle blocks run or their last residual is added
back; the last `Bn_compute_blocks` blocks always run. The rules are cache-dit 1.5.3's, field by field, and the
settings keep its key names, so an operator's `H3_CACHE_CONFIG` means what it means to cache-dit. cache-dit itself is
not imported (it needs diffusers, which is a test dependency only); tests run it as the oracle on the same weights
(tests/test_stepcache.py).

Where each rule comes from in cache-dit 1.5.3 (https://github.com/vipshop/cache-dit, PyPI `cache-dit`; paths under
the package's `cache_dit/caching/`):
  - block split Fn | middle | Bn, what is cached and added back: cache_blocks/pattern_3_4_5.py
    `CachedBlocks_Pattern_3_4_5.forward`, `call_Mn_blocks` (middle residual = output - input of the middle blocks);
    pattern_base.py `_Fn_blocks`, `_Mn_blocks`, `_Bn_blocks`, `_get_Fn_residual` (Fn residual = Fn output - input).
  - step counters, the continuous-run reset, warmup steps: cache_contexts/cache_context.py `mark_step_begin`,
    `warmup_steps`, `add_cached_step`, `add_residual_diff`.
  - the decision: cache_contexts/cache_manager.py `can_cache` (warmup, max_cached_steps, max_continuous_cached_steps,
    max_accumulated_residual_diff_threshold, threshold <= 0, no reference yet) and `similarity`
    (mean|prev - cur| / mean|prev| < threshold; a threshold >= 1 always caches; a shape change never does).
  - the reference residual is the Fn residual of the last *computed* step (`set_Fn_buffer` runs on computed steps
    only), not of the previous step.
  - request boundaries: cache-dit refreshes its context when the step count passes `num_inference_steps`
    (cache_manager.py `maybe_refresh`); here `begin_request` resets the state and the engine gives the count.
  - `force_refresh_step_hint` / `_policy`: cache_manager.py `maybe_refresh` / `set_context` (a fresh context at
    forward `hint`, and every `hint` forwards after with "repeat"; warmup and counters start again).

The cache is attached from outside the model, as the outer layer of the DiT's block stack (`accel.blocks`): it wraps
whatever each block runs beneath it (its own forward, the passes, or the shared compiled code). The decisions are
Python between block calls, outside any compiled graph, so caching adds no graph and causes no recompile.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from h3serve.errors import shown


@dataclass(frozen=True)
class StepCacheConfig:
    """The DBCache fields this build honours; names and defaults are cache-dit 1.5.3's `DBCacheConfig`
    (cache_contexts/cache_config.py `BasicCacheConfig`), so a key left out means what it means to cache-dit."""

    Fn_compute_blocks: int = 8
    Bn_compute_blocks: int = 0
    residual_diff_threshold: float = 0.08
    max_accumulated_residual_diff_threshold: float | None = None
    max_warmup_steps: int = 8
    warmup_interval: int = 1
    max_cached_steps: int = -1
    max_continuous_cached_steps: int = -1
    force_refresh_step_hint: int | None = None
    force_refresh_step_policy: str = "once"

    def __post_init__(self):
        for name, (kind, low, high) in _RANGES.items():
            _check_value(name, getattr(self, name), kind, low, high)
        if self.force_refresh_step_policy not in ("once", "repeat"):
            raise ValueError(
                f"force_refresh_step_policy: {shown(self.force_refresh_step_policy)}; allowed: 'once', 'repeat'"
            )

    def check_blocks(self, num_blocks: int) -> None:
        """At least one middle block must remain: with none there is nothing to cache."""
        if self.Fn_compute_blocks + self.Bn_compute_blocks >= num_blocks:
            raise ValueError(
                f"Fn_compute_blocks + Bn_compute_blocks = {self.Fn_compute_blocks} + {self.Bn_compute_blocks} "
                f"leaves no middle block of the DiT's {num_blocks} to cache; their sum must be below {num_blocks}"
            )


# (type, lowest, highest) of each honoured field; None: no bound. The bounds are where cache-dit's behaviour is
# defined: Fn >= 1 and Bn >= 0 are asserted by its context manager; a step limit of -1 means "no limit" (any negative
# does the same there, so only -1 is taken); warmup_interval is a `range` step; a threshold of 0 never caches and
# one of 1 or more always does (`similarity`), so values above 1 say nothing 1 does not.
_RANGES: dict[str, tuple[str, float | None, float | None]] = {
    "Fn_compute_blocks": ("int", 1, None),
    "Bn_compute_blocks": ("int", 0, None),
    "residual_diff_threshold": ("float", 0.0, 1.0),
    "max_accumulated_residual_diff_threshold": ("float?", 0.0, None),
    "max_warmup_steps": ("int", 0, None),
    "warmup_interval": ("int", 1, None),
    "max_cached_steps": ("int", -1, None),
    "max_continuous_cached_steps": ("int", -1, None),
    "force_refresh_step_hint": ("int?", 1, None),
}

# Keys cache-dit reads that this build takes only at the value that changes nothing for H3, with the reason.
# H3 runs one DiT forward per step (no separate CFG forward), so the CFG fields are inert as in cache-dit itself.
_FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "cache_type": (("DBCache",), "only DBCache is built (DBPrune is not)"),
    "enable_separate_cfg": ((None, False), "H3 runs no separate CFG forward"),
    "num_inference_steps": ((None,), "the step count is set per request, from the request"),
    "steps_computation_mask": ((None,), "not built: a fixed-length mask does not fit per-request step counts"),
    "enable_taylorseer": ((False,), "the TaylorSeer calibrator is not built"),
    "enable_dmd": ((False,), "the DMD calibrator is not built"),
    "enable_foca": ((False,), "the FoCa calibrator is not built"),
}
# Keys cache-dit reads whose every value behaves the same here as there (type-checked, then inert).
_INERT: dict[str, tuple[type, tuple[Any, ...] | None]] = {
    "cfg_compute_first": (bool, None),  # read only with enable_separate_cfg
    "cfg_diff_compute_separate": (bool, None),  # read only with enable_separate_cfg
    "steps_computation_policy": (str, ("dynamic", "static")),  # read only with steps_computation_mask
}
# Keys cache-dit reads only for a calibrator (load_configs.py `load_cache_options_from_dict`) or in its nested
# file format: known, so not "unknown", but refused.
_CALIBRATOR_KEYS = (
    "enable_encoder_taylorseer",
    "taylorseer_cache_type",
    "taylorseer_order",
    "enable_encoder_dmd",
    "dmd_history",
    "dmd_rank",
    "dmd_ridge",
    "dmd_svd_precision",
    "enable_encoder_foca",
    "calibrator_cache_type",
)
_NESTED_KEYS = ("cache_config", "calibrator_config", "parallelism_config", "attention_backend", "quantize_config")

KNOWN_KEYS = (
    *(f.name for f in dataclasses.fields(StepCacheConfig)),
    *_FIXED,
    *_INERT,
    *_CALIBRATOR_KEYS,
    *_NESTED_KEYS,
)


def _check_value(name: str, value: Any, kind: str, low: float | None, high: float | None) -> None:
    optional = kind.endswith("?")
    if value is None:
        if optional:
            return
        raise ValueError(f"{name}: must be {'an integer' if kind == 'int' else 'a number'}, got null")
    # bool is an int in Python; JSON true/false is never a count or a threshold.
    if kind.startswith("int") and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name}: must be an integer{' or null' if optional else ''}, got {shown(value)}")
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if kind.startswith("float") and not number:
        raise ValueError(f"{name}: must be a finite number{' or null' if optional else ''}, got {shown(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}: {shown(value)} is out of range; must be {bounds}")


# quality=high: the conservative profile the other H3 engines ship for that request option (a request-scoped
# Cache-DiT "high" plan: Fn 1, Bn 0, warmup 4, no step cap, threshold 0.04, at most 1 cached step in a row). It is
# the operators' "balanced" profile with the threshold lowered from 0.10 to 0.04.
HIGH_QUALITY = StepCacheConfig(
    Fn_compute_blocks=1,
    Bn_compute_blocks=0,
    max_warmup_steps=4,
    max_cached_steps=-1,
    residual_diff_threshold=0.04,
    max_continuous_cached_steps=1,
)


def config_from_dict(options: dict[str, Any]) -> StepCacheConfig:
    """cache-dit's flat DBCache options (its `load_cache_options_from_dict` format) -> StepCacheConfig.

    Raises ValueError naming the key: unknown (with the closest known key), wrong type, out of range, or a field
    this build does not honour (never ignored silently)."""
    if not isinstance(options, dict):
        raise ValueError(f"must be a JSON object of cache-dit DBCache options, got {type(options).__name__}")
    values: dict[str, Any] = {}
    for key, value in options.items():
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(str(key), KNOWN_KEYS, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{shown(key)}: unknown cache-dit DBCache option{hint} (known: {', '.join(KNOWN_KEYS)})")
        if key in _FIXED:
            allowed, why = _FIXED[key]
            if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
                allowed_text = " or ".join(json.dumps(a) for a in allowed)
                raise ValueError(f"{key}: {shown(value)} is not supported ({why}); allowed: {allowed_text}")
        elif key in _INERT:
            kind, choices = _INERT[key]
            if not isinstance(value, kind) or (choices is not None and value not in choices):
                want = " or ".join(repr(c) for c in choices) if choices else kind.__name__
                raise ValueError(f"{key}: must be {want}, got {shown(value)}")
        elif key in _CALIBRATOR_KEYS:
            raise ValueError(f"{key}: configures a calibrator (TaylorSeer, DMD, FoCa), which is not built")
        elif key in _NESTED_KEYS:
            raise ValueError(
                f"{key}: cache-dit's nested file format is not read; give the DBCache options as one flat object"
            )
        else:
            values[key] = value
    return StepCacheConfig(**values)


def parse_cache_config(text: str) -> StepCacheConfig:
    """H3_CACHE_CONFIG (a JSON object of cache-dit DBCache options) -> StepCacheConfig, or ValueError."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err}); expected a JSON object") from None
    except RecursionError:  # json's own limit on nesting: a flat object needs none of it
        raise ValueError("not valid JSON (nested too deeply to parse); expected one flat JSON object") from None
    if not isinstance(options, dict):
        raise ValueError(f"must be a JSON object, got {type(options).__name__}")
    return config_from_dict(options)


@dataclass(frozen=True)
class StepCacheReport:
    """One request: which forwards (0-based, in the request's order) reused the middle blocks' residual, and the
    relative L1 change measured at each forward where the rule got that far (cache-dit's `residual_diffs`)."""

    enabled: bool
    config: StepCacheConfig | None
    forwards: int
    cached: tuple[int, ...] = ()
    residual_diffs: dict[int, float] = field(default_factory=dict)

    @property
    def num_cached(self) -> int:
        return len(self.cached)


class _Segment:
    """cache-dit's `CachedContext` for one request, or for the part of it after a forced refresh."""

    def __init__(self):
        self.step = -1  # the context's current step (executed_steps - 1)
        self.cached_steps: list[int] = []
        self.continuous = 0
        self.accumulated_diff = 0.0
        self.recorded: set[int] = set()  # steps whose diff is recorded (only the first counts, as in cache-dit)
        self.fn_residual: torch.Tensor | None = None  # Fn residual of the last computed step
        self.mid_residual: torch.Tensor | None = None  # middle blocks' residual of the last computed step


class StepCache:
    """DBCache state for one DiT; `attach` makes one. Not thread-safe: one request at a time per DiT, as the
    engine runs them."""

    def __init__(self, dit: nn.Module, config: StepCacheConfig | None):
        self.dit = dit
        self.blocks = dit.blocks
        self.num_blocks = len(self.blocks)
        for profile in (config, HIGH_QUALITY):
            if profile is not None:
                profile.check_blocks(self.num_blocks)
        self.default = config
        self._inner: list[Callable[..., torch.Tensor]] = []  # what runs beneath the cache, per block
        self._wrappers: list[Callable[..., torch.Tensor]] = []
        self._active: StepCacheConfig | None = None
        self._in_request = False
        self._enabled = False
        self._num_forwards = 0
        # Split over several GPUs: the sum of a tensor over the ranks (`parallel.ranks.Ranks.install`), else None.
        self.sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None

    # -- attaching ------------------------------------------------------------------------------------------------

    def wrap(self, index: int, block: nn.Module, inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """The step cache as the outer layer of `blocks[index]` (`accel.blocks.BlockStack`): `inner` is what runs
        beneath it (the block's own forward, its passes or its compiled code)."""
        if not self._inner:
            self._inner = [None] * self.num_blocks  # type: ignore[list-item]
            self._wrappers = [None] * self.num_blocks  # type: ignore[list-item]
        self._inner[index] = inner
        self._wrappers[index] = functools.partial(StepCache._run_block, self, index)
        return self._wrappers[index]

    def detach(self) -> None:
        """Take the cache out of the DiT's block stack: each block runs what it ran beneath the cache."""
        from h3serve.accel.blocks import BlockStack

        stack = BlockStack.of(self.dit)
        if self in stack.wrappers:
            stack.wrappers.remove(self)
            stack.install(self.dit)
        self._inner, self._wrappers = [], []
        self._in_request = False

    # -- requests -------------------------------------------------------------------------------------------------

    def begin_request(self, num_forwards: int, enabled: bool = True, config: StepCacheConfig | None = None) -> None:
        """Start a request of `num_forwards` DiT forwards with fresh state. `enabled=False` (quality=lossless): the
        blocks run as without a cache. `config`: this request's profile (quality=high: `HIGH_QUALITY`) instead of
        the one given at attach; with neither, the request runs uncached."""
        if not self._wrappers:
            raise RuntimeError("the step cache is detached")
        if any(block.forward is not w for block, w in zip(self.blocks, self._wrappers, strict=True)):
            raise RuntimeError(
                "a block's forward was replaced outside its block stack after the step cache was attached "
                "(change how blocks run through accel.blocks.BlockStack)"
            )
        if isinstance(num_forwards, bool) or not isinstance(num_forwards, int) or num_forwards < 1:
            raise ValueError(f"num_forwards must be a positive integer, got {num_forwards!r}")
        if config is not None:
            config.check_blocks(self.num_blocks)
        self._active = config if config is not None else self.default
        self._enabled = enabled and self._active is not None
        self._num_forwards = num_forwards
        self._in_request = True
        self._forward = -1  # index of the current forward in the request
        self._segment = _Segment()
        self._segment_start = 0  # forward index where the current segment began
        self._refresh_hint = self._active.force_refresh_step_hint if self._enabled else None
        self._cached: list[int] = []
        self._diffs: dict[int, float] = {}
        self._x0: torch.Tensor | None = None
        self._x_fn: torch.Tensor | None = None
        self._use_cache = False

    def end_request(self) -> StepCacheReport:
        """Close the request (its buffers are dropped) and report which forwards were cached."""
        if not self._in_request:
            raise RuntimeError("end_request without begin_request")
        report = StepCacheReport(
            enabled=self._enabled,
            config=self._active if self._enabled else None,
            forwards=self._forward + 1,
            cached=tuple(self._cached),
            residual_diffs=dict(self._diffs),
        )
        self._in_request = False
        self._segment = _Segment()
        self._x0 = self._x_fn = None
        return report

    # -- the forward ----------------------------------------------------------------------------------------------

    def _run_block(self, i: int, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        inner = self._inner[i]
        if not (self._in_request and self._enabled):
            if self._in_request and i == 0:
                self._forward += 1  # counted for the report, nothing else
            return inner(x, *args, **kwargs)
        cfg = self._active
        fn, bn = cfg.Fn_compute_blocks, cfg.Bn_compute_blocks
        last_mid = self.num_blocks - bn - 1
        if i == 0:
            self._start_forward()
            self._x0 = x
        if i < fn:  # Fn blocks: always run
            out = inner(x, *args, **kwargs)
            if i == fn - 1:
                self._x_fn = out
                self._use_cache = self._decide(out - self._x0)
                self._x0 = None
            return out
        if i <= last_mid:  # middle blocks
            seg = self._segment
            if self._use_cache:
                if i < last_mid:
                    return x
                # cache-dit adds the cached residual once, in place of the middle blocks (`apply_cache`)
                out, self._x_fn = (seg.mid_residual + self._x_fn).contiguous(), None
                return out
            out = inner(x, *args, **kwargs)
            if i == last_mid:
                seg.mid_residual = out.contiguous() - self._x_fn
                self._x_fn = None
            return out
        return inner(x, *args, **kwargs)  # Bn blocks: always run

    def _start_forward(self) -> None:
        self._forward += 1
        if self._forward >= self._num_forwards:
            raise RuntimeError(f"forward {self._forward + 1} of a request declared with {self._num_forwards}")
        # cache-dit's `maybe_refresh` (force_refresh_step_hint): before the segment's forward `hint`, a new context.
        if self._refresh_hint is not None and self._forward - self._segment_start == self._refresh_hint:
            self._segment = _Segment()
            self._segment_start = self._forward
            if self._active.force_refresh_step_policy == "once":
                self._refresh_hint = None

    def _decide(self, fn_residual: torch.Tensor) -> bool:
        """`mark_step_begin` then `can_cache` (+ `similarity`), for this segment; records the step if cached."""
        seg = self._segment
        seg.step += 1
        step = seg.step
        if not seg.cached_steps or seg.cached_steps[-1] != step - 1:
            seg.continuous = 0  # a computed step breaks the run of cached steps
        use = self._can_cache(fn_residual, step)
        if use:
            seg.continuous += 1
            seg.cached_steps.append(step)
            self._cached.append(self._forward)
        else:
            seg.fn_residual = fn_residual
        return use

    def _can_cache(self, fn_residual: torch.Tensor, step: int) -> bool:
        cfg, seg = self._active, self._segment
        if step in range(0, cfg.max_warmup_steps, cfg.warmup_interval):
            return False
        if cfg.max_cached_steps >= 0 and len(seg.cached_steps) >= cfg.max_cached_steps:
            return False
        # (cache-dit's "a hit already recorded for this step" correction is for DBPrune; DBCache records after this)
        if cfg.max_continuous_cached_steps >= 0 and seg.continuous >= cfg.max_continuous_cached_steps:
            return False
        limit = cfg.max_accumulated_residual_diff_threshold
        if limit is not None and limit > 0.0 and seg.accumulated_diff >= limit:
            return False
        threshold = cfg.residual_diff_threshold
        if threshold <= 0.0 or seg.fn_residual is None:
            return False
        if threshold >= 1.0:
            self._record(step, -1.0)
            return True
        prev = seg.fn_residual
        if prev.shape != fn_residual.shape:
            self._record(step, -2.0)
            return False
        diff = self._relative_change(prev, fn_residual)
        self._record(step, diff)
        return diff < threshold

    def _relative_change(self, prev: torch.Tensor, now: torch.Tensor) -> float:
        """Relative L1 change of the Fn residual against the last computed step's, at the activations' dtype. Split
        over ranks (`sum_over_ranks` set), each holds its own rows: the two means come from sums over every rank,
        so that every rank takes the same decision."""
        if self.sum_over_ranks is None:
            return ((prev - now).abs().mean() / prev.abs().mean()).item()
        wide = torch.float64
        count = torch.tensor(float(prev.numel()), dtype=wide, device=prev.device)
        sums = self.sum_over_ranks(torch.stack([(prev - now).abs().sum(dtype=wide), prev.abs().sum(dtype=wide), count]))
        return ((sums[0] / sums[2]).to(prev.dtype) / (sums[1] / sums[2]).to(prev.dtype)).item()

    def _record(self, step: int, diff: float) -> None:
        seg = self._segment
        if step not in seg.recorded:
            seg.recorded.add(step)
            self._diffs[self._forward] = diff
            if diff > 0.0:
                seg.accumulated_diff += diff


def attach(dit: nn.Module, config: StepCacheConfig | None) -> StepCache:
    """Attach a step cache to `dit.blocks` as the outer layer of its block stack (`accel.blocks`: before or after
    compiling, the order is the stack's). `config`: the server's profile, or None (requests run uncached unless
    `begin_request` names a profile)."""
    from h3serve.accel.blocks import BlockStack

    stack = BlockStack.of(dit)
    if any(isinstance(w, StepCache) for w in stack.wrappers):
        raise ValueError("the DiT's blocks already have a step cache attached; detach it first")
    cache = StepCache(dit, config)
    stack.wrappers.append(cache)
    stack.install(dit)
    return cache
