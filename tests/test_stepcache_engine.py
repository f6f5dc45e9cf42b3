"""Step caching through the engine (the tiny model, CPU): the server's profile per request, quality lossless and
high, the report on the result, no state carried between requests, and the refusals. The cache's own rules against
cache-dit are tests/test_stepcache.py."""

from __future__ import annotations

import numpy as np
import pytest

from h3serve.accel.profile import Profile
from h3serve.accel.stepcache import HIGH_QUALITY, parse_cache_config
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields
from h3serve.pipeline.rules import RequestError

# Caches on the tiny model: forwards 2, 4, 6 and 8 of 9 (measured relative changes 0.03-0.22 against 0.5).
CACHING = parse_cache_config(
    '{"Fn_compute_blocks":1,"Bn_compute_blocks":0,"max_warmup_steps":2,"residual_diff_threshold":0.5,'
    '"max_continuous_cached_steps":1}'
)
PROMPT = "A red fox trots through fresh snow at dawn."


@pytest.fixture(scope="module")
def cached() -> Engine:
    return Engine.load(None, Profile.for_device("cpu"), step_cache=CACHING)


@pytest.fixture(scope="module")
def plain() -> Engine:
    return Engine.load(None, Profile.for_device("cpu"))


def render(engine: Engine, quality: str | None = None, seed: int = 1):
    return engine.render(engine.validate(RequestFields(PROMPT, steps=10, seed=seed, quality=quality)))


def test_the_servers_profile_caches_and_reports_which_forwards(cached, plain):
    result = render(cached)
    report = result.step_cache
    assert report.enabled and report.config == CACHING and report.forwards == 9
    assert report.cached == (2, 4, 6, 8)
    assert set(report.cached) <= set(report.residual_diffs)  # each cached forward measured below the threshold
    assert all(report.residual_diffs[i] < CACHING.residual_diff_threshold for i in report.cached)
    full = render(plain)
    assert plain.step_caches == {} and full.step_cache is None
    assert np.abs(result.frames.astype(np.int16) - full.frames.astype(np.int16)).max() > 0  # lossy


def test_lossless_is_bitwise_the_uncached_render(cached, plain):
    lossless = render(cached, "lossless")
    assert not lossless.step_cache.enabled and lossless.step_cache.cached == () and lossless.step_cache.forwards == 9
    full = render(plain)
    np.testing.assert_array_equal(lossless.frames, full.frames)
    np.testing.assert_array_equal(lossless.audio, full.audio)


def test_high_runs_the_conservative_profile(cached):
    report = render(cached, "high").step_cache
    assert report.enabled and report.config == HIGH_QUALITY
    # The same rule at 0.04: every measured change on the tiny model is above it, so nothing is cached.
    assert report.cached == () and min(report.residual_diffs.values()) > HIGH_QUALITY.residual_diff_threshold


def test_no_state_carries_over_between_requests(cached):
    first = render(cached, seed=1)
    render(cached, seed=2)  # another request in between, with other inputs
    render(cached, "lossless", seed=3)
    again = render(cached, seed=1)
    assert again.step_cache == first.step_cache
    np.testing.assert_array_equal(again.frames, first.frames)
    np.testing.assert_array_equal(again.audio, first.audio)


def test_high_is_refused_on_an_engine_without_a_cache(plain):
    with pytest.raises(RequestError, match=r"quality high .* runs without step caching .* H3_CACHE_BACKEND") as err:
        plain.validate(RequestFields(PROMPT, steps=10, quality="high"))
    assert err.value.field == "quality"
    assert render(plain, "lossless").step_cache is None  # lossless is what it runs anyway


def test_an_unknown_quality_is_refused(cached):
    with pytest.raises(RequestError, match="quality must be one of lossless, high, got 'best'"):
        cached.validate(RequestFields(PROMPT, steps=10, quality="best"))


def test_both_dits_get_their_own_cache():
    engine = Engine.load(None, Profile.for_device("cpu"), task_type="both", step_cache=CACHING)
    assert set(engine.step_caches) == {"fl2va", "ref2va"}
    assert engine.step_caches["fl2va"] is not engine.step_caches["ref2va"]
    assert render(engine).step_cache.cached == (2, 4, 6, 8)


def test_cli_render_with_a_cache_config_reports_the_cached_forwards(tmp_path, capsys):
    from h3serve.cli import main

    out = tmp_path / "cached.mp4"
    config = '{"Fn_compute_blocks":1,"Bn_compute_blocks":0,"max_warmup_steps":2,"residual_diff_threshold":0.5,' \
        '"max_continuous_cached_steps":1}'  # fmt: skip
    code = main(["render", PROMPT, "-o", str(out), "--steps", "10", "--seed", "1", "--no-progress",
                 "--cache-backend", "cache_dit", "--cache-config", config])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0 and out.exists(), err
    assert "step cache (lossy): 4 of 9 forwards cached [2, 4, 6, 8]" in err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"Fn_compute_block":1}', "unknown cache-dit DBCache option; did you mean 'Fn_compute_blocks'"),
        ("[1]", "must be a JSON object"),
        ('{"enable_taylorseer":true}', "enable_taylorseer"),
    ],
)
def test_cli_render_refuses_a_bad_cache_config_before_loading(tmp_path, capsys, config, message):
    from h3serve.cli import main

    out = tmp_path / "x.mp4"
    code = main(["render", PROMPT, "-o", str(out), "--steps", "3", "--no-progress", "--cache-backend", "cache_dit",
                 "--cache-config", config])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1 and not out.exists()
    assert err.startswith("h3serve: error: 1 setting(s) refused:") and message in err, err
    assert "  - H3_CACHE_CONFIG (--cache-config): " in err and err.count("\n") == 2, err
