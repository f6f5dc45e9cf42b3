"""Step caching (accel/stepcache.py): cache-dit's DBCache rules, built natively, against cache-dit 1.5.3 itself.

Three levels: a scripted block stack whose first-block residual is a known sequence (the cached pattern is worked out
by hand and cache-dit must agree, outputs bitwise); the tiny H3 DiT against diffusers' H3 transformer under cache-dit
on the same weights; and the properties the engine relies on (threshold 0 and lossless are exact, no state leaks
between requests, two DiTs, no recompile under regional compile, every refusal).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from dit_fixtures import TINY_DIFFUSERS_CONFIG, cast_reference, is_ref_fp32, packed_inputs, reference_state_dict
from h3serve.accel.compile import compile_repeated_blocks
from h3serve.accel.stepcache import (
    HIGH_QUALITY,
    KNOWN_KEYS,
    StepCacheConfig,
    attach,
    config_from_dict,
    parse_cache_config,
)
from h3serve.model.dit import H3DiT
from h3serve.model.tiny import TINY_AUDIO_LATENT_CHANNELS, TINY_DIT, TINY_VIDEO_LATENT_CHANNELS, randomize
from oracle import oracle

BALANCED = {
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "max_warmup_steps": 4,
    "max_cached_steps": -1,
    "residual_diff_threshold": 0.10,
    "max_continuous_cached_steps": 1,
    "enable_taylorseer": False,
}


# A scripted block stack: block 0 adds a scalar `c` (so the Fn residual is c everywhere and the relative L1 change
# between two steps is |c_prev - c| / |c_prev|), the others are affine and count their calls. ----------------------


class Shift(nn.Module):
    c = 1.0

    def forward(self, hidden_states):
        return hidden_states + self.c


class Affine(nn.Module):
    def __init__(self, k: float):
        super().__init__()
        self.k, self.calls = k, 0

    def forward(self, hidden_states):
        self.calls += 1
        return hidden_states * 0.5 + self.k


class Stack(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList([Shift(), *(Affine(k + 1.0) for k in range(n - 1))])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


# Residual diffs against the last computed step: 0.05 at step 2, 0.2 at 3; then 1.25, 1.3, 1.31 against 1.2 are
# 0.042, 0.083, 0.092 (all under 0.1 only because the reference stays the last computed step, 1.2), 2.0 is far.
SEQUENCE = (1.0, 1.0, 1.05, 1.2, 1.25, 1.3, 1.31, 2.0)
BASE = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=2, residual_diff_threshold=0.1)
PATTERNS = [
    ({}, [2, 4, 5, 6]),
    ({"max_continuous_cached_steps": 1}, [2, 4, 6]),  # 5 computed (a run of 1), so 6 is measured against 1.3
    ({"max_cached_steps": 2}, [2, 4]),
    ({"max_warmup_steps": 4, "warmup_interval": 2}, [1, 4, 5, 6]),  # warmup is steps 0 and 2 only
    ({"max_warmup_steps": 0}, [1, 2, 4, 5, 6]),  # step 0 has no reference
    ({"residual_diff_threshold": 0.0}, []),
    ({"residual_diff_threshold": 1.0}, [2, 3, 4, 5, 6, 7]),  # >= 1: every step after warmup
    ({"residual_diff_threshold": 0.045}, [4, 6]),  # 5 is computed, so 6 is measured against 1.3
    ({"max_accumulated_residual_diff_threshold": 0.1}, [2]),  # 0.05 + 0.2 accumulated stops caching at step 4
    ({"force_refresh_step_hint": 4}, [2, 6]),  # forwards 4, 5 warm up again
    ({"force_refresh_step_hint": 3, "force_refresh_step_policy": "repeat"}, [2, 5]),  # segments 0-2, 3-5, 6-7
    ({"Bn_compute_blocks": 1}, [2, 4, 5, 6]),
]


def run_stack(stack: Stack, sequence=SEQUENCE) -> list[torch.Tensor]:
    x = torch.arange(12.0).reshape(4, 3)
    outs = []
    for c in sequence:
        stack.blocks[0].c = c
        outs.append(stack(x))
    return outs


@pytest.mark.parametrize(("overrides", "expected"), PATTERNS, ids=[json.dumps(o) for o, _ in PATTERNS])
def test_a_known_residual_sequence_gives_the_expected_cached_steps(overrides, expected):
    stack = Stack(4)
    cache = attach(stack, StepCacheConfig(**{**BASE, **overrides}))
    cache.begin_request(len(SEQUENCE))
    run_stack(stack)
    report = cache.end_request()
    assert list(report.cached) == expected
    assert report.forwards == len(SEQUENCE) and report.enabled
    middle = stack.blocks[1 : 4 - overrides.get("Bn_compute_blocks", 0)]
    assert all(b.calls == len(SEQUENCE) - len(expected) for b in middle)  # cached steps skip the middle blocks


@pytest.mark.parametrize(("overrides", "expected"), PATTERNS, ids=[json.dumps(o) for o, _ in PATTERNS])
def test_cache_dit_agrees_on_the_scripted_stack(overrides, expected):
    cache_dit = oracle("cache_dit")
    config = {**BASE, **overrides}
    ours, theirs = Stack(4), Stack(4)
    cache = attach(ours, StepCacheConfig(**config))
    cache.begin_request(len(SEQUENCE))
    outs = run_stack(ours)
    report = cache.end_request()
    adapter = cache_dit.BlockAdapter(
        transformer=theirs, blocks=theirs.blocks, forward_pattern=cache_dit.ForwardPattern.Pattern_3
    )
    cache_dit.enable_cache(adapter, cache_config=cache_dit.DBCacheConfig(**config, num_inference_steps=len(SEQUENCE)))
    ref = run_stack(theirs)
    stats = cache_dit.summary(theirs, logging=False)[0]
    if "force_refresh_step_hint" not in overrides:  # after a refresh cache-dit restarts its step numbering
        assert stats.cached_steps == expected
        assert {int(k): v for k, v in stats.residual_diffs.items()} == report.residual_diffs
    assert list(report.cached) == expected
    for a, b in zip(outs, ref, strict=True):
        assert torch.equal(a, b)


# The tiny H3 DiT -----------------------------------------------------------------------------------------------

TINY_INPUTS = dict(in_channels=TINY_VIDEO_LATENT_CHANNELS, audio_in_channels=TINY_AUDIO_LATENT_CHANNELS, text_dim=32)


def tiny_dit(num_layers: int = 4, seed: int = 0) -> H3DiT:
    return randomize(H3DiT(dataclasses.replace(TINY_DIT, num_layers=num_layers)), seed, keep=("rope.inv_freq",))


def schedule(inputs, steps: int = 8):
    """A denoise-like sequence of forwards: rows moving from noise to data, timesteps from 0 (noise) towards 1."""
    g = torch.Generator().manual_seed(7)
    noise_v, noise_a = torch.randn(inputs.video.shape, generator=g), torch.randn(inputs.audio.shape, generator=g)
    for i in range(steps):
        t = i / steps
        yield dataclasses.replace(
            inputs,
            video=inputs.video * t + noise_v * (1 - t),
            audio=inputs.audio * t + noise_a * (1 - t),
            timesteps=inputs.timesteps * 0.1 + t,
        )


@torch.no_grad()
def run_request(dit: H3DiT, cache=None, steps: int = 8, seed: int = 1, **begin) -> tuple[list, object]:
    inputs = packed_inputs(seed=seed, cfg=TINY_INPUTS)
    if cache is not None:
        cache.begin_request(steps, **begin)
    outs = [step.run_ours(dit) for step in schedule(inputs, steps)]
    return outs, (cache.end_request() if cache is not None else None)


def assert_equal(a: list, b: list) -> None:
    for (av, aa), (bv, ba) in zip(a, b, strict=True):
        assert torch.equal(av, bv) and torch.equal(aa, ba)


LOSSY = StepCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=2, residual_diff_threshold=0.3)


def test_the_lossy_profile_caches_on_the_tiny_dit():
    dit = tiny_dit()
    plain, _ = run_request(dit)
    outs, report = run_request(dit, attach(dit, LOSSY))
    assert report.num_cached >= 2 and report.cached[0] >= 2, report
    cached = set(report.cached)
    for i, (a, b) in enumerate(zip(outs, plain, strict=True)):
        assert torch.equal(a[0], b[0]) == (i not in cached)  # uncached forwards are exact, cached ones are not


@pytest.mark.parametrize(
    "begin",
    [
        dict(config=dataclasses.replace(LOSSY, residual_diff_threshold=0.0)),
        dict(enabled=False),  # quality=lossless
    ],
    ids=["threshold-0", "lossless"],
)
def test_threshold_0_and_lossless_equal_no_cache(begin):
    dit = tiny_dit()
    plain, _ = run_request(dit)
    cache = attach(dit, LOSSY)
    outs, report = run_request(dit, cache, **begin)
    assert report.cached == ()
    assert_equal(outs, plain)
    cache.detach()
    assert all("forward" not in b.__dict__ for b in dit.blocks)


def test_no_profile_runs_uncached_and_quality_high_applies_the_conservative_one():
    dit = tiny_dit()
    plain, _ = run_request(dit)
    cache = attach(dit, None)  # a server started without a cache
    outs, report = run_request(dit, cache)
    assert (report.enabled, report.cached) == (False, ())
    assert_equal(outs, plain)
    _, report = run_request(dit, cache, config=HIGH_QUALITY)
    assert report.enabled and report.config == HIGH_QUALITY


def test_state_does_not_leak_between_requests():
    dit = tiny_dit()
    cache = attach(dit, LOSSY)
    _, first_report = run_request(dit, cache, seed=1)
    second, second_report = run_request(dit, cache, seed=2, steps=6)
    fresh = tiny_dit()
    alone, alone_report = run_request(fresh, attach(fresh, LOSSY), seed=2, steps=6)
    assert first_report.num_cached > 0
    assert second_report == alone_report
    assert_equal(second, alone)


def test_two_dits_keep_their_own_state():
    a, b = tiny_dit(seed=0), tiny_dit(seed=3)
    ca, cb = attach(a, LOSSY), attach(b, LOSSY)
    inputs = packed_inputs(cfg=TINY_INPUTS)
    ca.begin_request(8)
    cb.begin_request(8)
    with torch.no_grad():
        interleaved = [(step.run_ours(a), step.run_ours(b)) for step in schedule(inputs)]
    ra, rb = ca.end_request(), cb.end_request()
    fa = tiny_dit(seed=0)
    alone_a, report_a = run_request(fa, attach(fa, LOSSY))
    fb = tiny_dit(seed=3)
    alone_b, report_b = run_request(fb, attach(fb, LOSSY))
    assert (ra, rb) == (report_a, report_b)
    assert_equal([x for x, _ in interleaved], alone_a)
    assert_equal([y for _, y in interleaved], alone_b)


def test_compiled_blocks_with_the_cache_never_recompile():
    """aot_eager: Dynamo's tracing and guards (where recompiles come from) without Inductor's code generation."""
    dit, eager_dit = tiny_dit(), tiny_dit()
    eager, eager_report = run_request(eager_dit, attach(eager_dit, LOSSY))
    counter = compile_repeated_blocks(dit, backend="aot_eager")
    cache = attach(dit, LOSSY)
    outs, report = run_request(dit, cache)
    assert 0 < report.num_cached < report.forwards  # cached and computed forwards both ran compiled
    assert report == eager_report
    assert counter.graphs == 2, counter.compiles  # Block and RefinerBlock
    assert counter.recompiles == 0, counter.compiles
    assert_equal(outs, eager)
    run_request(dit, cache, enabled=False)
    assert counter.recompiles == 0, counter.compiles
    cache.detach()  # the compiled forwards are back
    assert all(b.forward.func.__name__ == "_call_marked" for b in dit.blocks)


def test_the_block_stack_keeps_the_cache_outermost_whichever_layer_comes_first():
    """Compiling after attaching is the same stack as attaching after compiling (`accel.blocks`): the cache wraps
    the compiled code, so the request caches the same forwards and gives the same rows. A forward replaced from
    outside the stack is still caught."""
    eager_dit = tiny_dit()
    eager, eager_report = run_request(eager_dit, attach(eager_dit, LOSSY))
    dit = tiny_dit()
    cache = attach(dit, LOSSY)
    compile_repeated_blocks(dit, backend="aot_eager")
    assert dit.block_stack.describe() == "compiled -> StepCache"
    outs, report = run_request(dit, cache)
    assert report == eager_report and report.num_cached > 0
    assert_equal(outs, eager)
    dit.blocks[0].forward = dit.blocks[0].forward.func.__get__(dit.blocks[0])  # around the stack, not through it
    with pytest.raises(RuntimeError, match="outside its block stack"):
        cache.begin_request(8)


def test_misuse_is_refused():
    dit = tiny_dit(num_layers=2)
    with pytest.raises(ValueError, match="leaves no middle block"):
        attach(dit, StepCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=1))
    cache = attach(dit, dataclasses.replace(HIGH_QUALITY))
    with pytest.raises(ValueError, match="already have a step cache"):
        attach(dit, HIGH_QUALITY)
    with pytest.raises(ValueError, match="leaves no middle block"):
        cache.begin_request(4, config=StepCacheConfig(Fn_compute_blocks=2, Bn_compute_blocks=0))
    with pytest.raises(ValueError, match="num_forwards"):
        cache.begin_request(0)
    with pytest.raises(RuntimeError, match="without begin_request"):
        cache.end_request()
    cache.begin_request(2)
    with pytest.raises(RuntimeError, match="forward 3 of a request declared with 2"), torch.no_grad():
        for step in schedule(packed_inputs(cfg=TINY_INPUTS), 3):
            step.run_ours(dit)


# Against diffusers' H3 transformer under cache-dit, on the same weights ------------------------------------------


def reference_pair(num_layers: int = 5, seed: int = 0):
    diffusers = oracle("diffusers")
    from h3serve.checkpoint.dit import load_dit

    cfg = {**TINY_DIFFUSERS_CONFIG, "num_layers": num_layers}
    torch.manual_seed(seed)
    ref = diffusers.MiniMaxH3Transformer3DModel(**cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.ndim > 1 else 0.5) + (1.0 if "norm" in name else 0.0))
            if not is_ref_fp32(name):
                p.copy_(p.to(torch.bfloat16).float())
    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import save_file

        save_file(reference_state_dict(ref), Path(tmp) / "diffusion_pytorch_model.safetensors")
        (Path(tmp) / "config.json").write_text(json.dumps(dict(ref.config)))
        ours = load_dit(tmp, dtype=torch.float32)
    return cast_reference(ref, torch.float32), ours, cfg


def test_matches_cache_dit_on_the_h3_transformer():
    cache_dit = oracle("cache_dit")
    ref, ours, cfg = reference_pair()
    config = dict(Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=2, max_continuous_cached_steps=2)
    inputs, steps = packed_inputs(cfg=cfg), 10
    with torch.no_grad():
        plain = [s.run_ours(ours) for s in schedule(inputs, steps)]
        # The threshold: one under which this sequence caches some forwards and no measured diff lies within 1% of
        # it, so that float noise between the two implementations cannot flip a decision.
        cache = attach(ours, None)
        for threshold in (0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.11, 0.12, 0.13, 0.14, 0.15, 0.17, 0.2, 0.25):
            config["residual_diff_threshold"] = threshold
            cache.begin_request(steps, config=StepCacheConfig(**config))
            outs = [s.run_ours(ours) for s in schedule(inputs, steps)]
            report = cache.end_request()
            margin = min(abs(d / threshold - 1) for d in report.residual_diffs.values())
            if 2 <= report.num_cached < steps - 2 and margin > 0.01:
                break
        else:
            pytest.fail("no threshold caches some forwards of this sequence with a margin")
        adapter = cache_dit.BlockAdapter(
            transformer=ref, blocks=ref.transformer_blocks, forward_pattern=cache_dit.ForwardPattern.Pattern_3
        )
        cache_dit.enable_cache(adapter, cache_config=cache_dit.DBCacheConfig(**config, num_inference_steps=steps))
        theirs = [ref(**s.reference_kwargs(), return_dict=False) for s in schedule(inputs, steps)]
    stats = cache_dit.summary(ref, logging=False)[0]
    assert 2 <= report.num_cached < steps - 2
    assert list(report.cached) == stats.cached_steps
    assert report.residual_diffs.keys() == {int(k) for k in stats.residual_diffs}
    for k, v in stats.residual_diffs.items():
        assert report.residual_diffs[int(k)] == pytest.approx(v, rel=1e-4)
    for i, ((v, a), (rv, ra), (pv, _)) in enumerate(zip(outs, theirs, plain, strict=True)):
        scale = (rv[0] - pv).abs().max().item() if i in report.cached else 0.0  # what caching changed
        torch.testing.assert_close(v, rv[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a, ra[0], rtol=1e-4, atol=1e-4)
        assert i not in report.cached or scale > 1e-3  # a cached forward really differs from the exact one


# H3_CACHE_CONFIG --------------------------------------------------------------------------------------------------


def test_the_balanced_profile_and_the_defaults_are_cache_dits():
    cache_dit = oracle("cache_dit")
    assert parse_cache_config(json.dumps(BALANCED)) == StepCacheConfig(
        Fn_compute_blocks=1,
        Bn_compute_blocks=0,
        max_warmup_steps=4,
        max_cached_steps=-1,
        residual_diff_threshold=0.10,
        max_continuous_cached_steps=1,
    )
    theirs = cache_dit.DBCacheConfig()
    for f in dataclasses.fields(StepCacheConfig):  # a key left out means what it means to cache-dit
        assert getattr(StepCacheConfig(), f.name) == getattr(theirs, f.name), f.name
    for f in dataclasses.fields(theirs):  # every field of the library is known here (taken, fixed or refused)
        assert f.name in KNOWN_KEYS, f.name
    assert config_from_dict({"cache_type": "DBCache", "enable_separate_cfg": False, "cfg_compute_first": True}) == (
        StepCacheConfig()
    )


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ('{"Fn_compute_block": 1}', ('"Fn_compute_block"', "unknown", "did you mean 'Fn_compute_blocks'")),
        ('{"residual_diff_treshold": 0.1}', ("unknown", "did you mean 'residual_diff_threshold'")),
        ('{"speed": 2}', ('"speed"', "unknown", "known: Fn_compute_blocks")),
        ('{"Fn_compute_blocks": "1"}', ("Fn_compute_blocks", "must be an integer", '"1"')),
        ('{"Fn_compute_blocks": 1.0}', ("Fn_compute_blocks", "must be an integer")),
        ('{"max_warmup_steps": true}', ("max_warmup_steps", "must be an integer")),
        ('{"residual_diff_threshold": "0.1"}', ("residual_diff_threshold", "finite number")),
        ('{"residual_diff_threshold": NaN}', ("residual_diff_threshold", "finite number")),
        ('{"residual_diff_threshold": null}', ("residual_diff_threshold", "got null")),
        ('{"enable_taylorseer": 0}', ("enable_taylorseer", "allowed: false")),
        ('{"cfg_compute_first": "no"}', ("cfg_compute_first", "must be bool")),
        ('{"Fn_compute_blocks": 0}', ("Fn_compute_blocks", "out of range", ">= 1")),
        ('{"Bn_compute_blocks": -1}', ("Bn_compute_blocks", "out of range")),
        ('{"residual_diff_threshold": -0.1}', ("residual_diff_threshold", "out of range", "[0.0, 1.0]")),
        ('{"residual_diff_threshold": 1.5}', ("residual_diff_threshold", "out of range")),
        ('{"max_cached_steps": -2}', ("max_cached_steps", "out of range", ">= -1")),
        ('{"max_continuous_cached_steps": -5}', ("max_continuous_cached_steps", "out of range")),
        ('{"warmup_interval": 0}', ("warmup_interval", "out of range")),
        ('{"max_accumulated_residual_diff_threshold": -1}', ("max_accumulated_residual_diff_threshold", "range")),
        ('{"force_refresh_step_hint": 0}', ("force_refresh_step_hint", "out of range")),
        ('{"force_refresh_step_policy": "twice"}', ("force_refresh_step_policy", "'once', 'repeat'")),
        ('{"steps_computation_policy": "fast"}', ("steps_computation_policy", "'dynamic' or 'static'")),
        ('{"enable_taylorseer": true}', ("enable_taylorseer", "TaylorSeer", "not built")),
        ('{"enable_dmd": true}', ("enable_dmd", "not built")),
        ('{"taylorseer_order": 2}', ("taylorseer_order", "calibrator", "not built")),
        ('{"cache_type": "DBPrune"}', ("cache_type", "DBPrune is not")),
        ('{"enable_separate_cfg": true}', ("enable_separate_cfg", "no separate CFG")),
        ('{"num_inference_steps": 50}', ("num_inference_steps", "per request")),
        ('{"steps_computation_mask": [1, 1, 0]}', ("steps_computation_mask", "not built")),
        ('{"cache_config": {"Fn_compute_blocks": 1}}', ("cache_config", "nested", "flat")),
        ("[1]", ("JSON object", "list")),
        ("{", ("not valid JSON",)),
    ],
)
def test_every_refusal_names_the_key(text, needles):
    with pytest.raises(ValueError) as info:
        parse_cache_config(text)
    assert all(n in str(info.value) for n in needles), str(info.value)
