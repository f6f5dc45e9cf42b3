"""The numerical oracle (diffusers) for tests that compare against it, and the test extra's other packages.

Without diffusers such a test is skipped, so a machine without the test extra can still run the rest; with
`H3TEST_REQUIRE_ORACLE=1` (set by CI) a missing oracle is a failure, so parity tests cannot quietly turn into skips. The
same holds for `require`d packages (triton, whose interpreter runs the kernels' CPU tier).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRE_ENV = "H3TEST_REQUIRE_ORACLE"


def oracle(module: str = "diffusers") -> ModuleType:
    """Import `module` (diffusers or one of its submodules), or skip/fail the calling test or test module."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        _missing(f"the oracle {module} is not importable ({err})")


def require(module: str) -> None:
    """That `module` is installed, found without importing it (for a package a subprocess imports), or skip/fail the
    calling test as `oracle` does."""
    if importlib.util.find_spec(module) is None:
        _missing(f"{module} is not installed")


def _missing(what: str) -> NoReturn:
    message = f"{what}; install the test extra: pip install -e '.[test]'"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1: {message}", pytrace=False)
    pytest.skip(message)
