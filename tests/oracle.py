"""The numerical oracle (diffusers) for tests that compare against it.

Without diffusers such a test is skipped, so a machine without the test extra can still run the rest; with
`H3_REQUIRE_ORACLE=1` (set by CI) a missing oracle is a failure, so parity tests cannot quietly turn into skips.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

REQUIRE_ENV = "H3_REQUIRE_ORACLE"


def oracle(module: str = "diffusers") -> ModuleType:
    """Import `module` (diffusers or one of its submodules), or skip/fail the calling test or test module."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        message = f"the oracle {module} is not importable ({err}); install the test extra: pip install -e '.[test]'"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1: {message}", pytrace=False)
        pytest.skip(message)
