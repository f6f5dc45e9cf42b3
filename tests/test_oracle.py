"""The oracle guard itself: a missing oracle is a skip, or with H3TEST_REQUIRE_ORACLE=1 a failure."""

from __future__ import annotations

import pytest

from oracle import REQUIRE_ENV, oracle


def test_present_oracle_is_returned():
    assert oracle("diffusers").__version__ == "0.42.1"


def test_missing_oracle_skips_by_default(monkeypatch):
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="not importable"):
        oracle("diffusers_missing_for_this_test")


def test_missing_oracle_fails_when_required(monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="H3TEST_REQUIRE_ORACLE=1"):
        oracle("diffusers_missing_for_this_test")
