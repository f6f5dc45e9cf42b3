"""The Triton kernels' CPU tier: tests/interpreted_kernels.py, each kernel against its reference op on small shapes,
run under Triton's interpreter in a process of its own.

TRITON_INTERPRET is read when Triton is imported, and it turns every Triton kernel of the process into numpy: set in
this process it would come too late for a module that had imported Triton already, and too early for any GPU test
after it. A child process has it from its start and takes it with it (about 15 s of CPU on two cores). Its cases are
pytest tests, named in the failure message here; `python -m pytest tests/test_triton_interpreter.py -s` prints what
each measured.

triton is in the test extra without a version: a CUDA build of torch brings the triton it was built with, which the
extra must not replace; on a CPU machine pip takes the index's (3.9.0, with which these cases were measured).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from oracle import REQUIRE_ENV, require

ROOT = Path(__file__).resolve().parents[1]
CASES = Path(__file__).with_name("interpreted_kernels.py")


def test_the_triton_kernels_under_the_interpreter(tmp_path):
    require("triton")  # the test extra's; a skip without it, a failure under H3TEST_REQUIRE_ORACLE=1
    report = tmp_path / "cases.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", f"--junitxml={report}", str(CASES)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, (
        f"{' '.join(command)} exited {run.returncode}:\n{run.stdout[-12000:]}\n{run.stderr[-4000:]}"
    )
    suite = ET.parse(report).getroot().find("testsuite")
    counts = {key: int(suite.get(key)) for key in ("tests", "failures", "errors", "skipped")}
    # Every case ran: none may skip (that would be the kernels untested with a green run).
    assert counts["tests"] >= 40 and counts["failures"] == counts["errors"] == counts["skipped"] == 0, counts


def test_a_missing_package_is_a_skip_or_under_the_ci_setting_a_failure(monkeypatch):
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="install the test extra"):
        require("triton_missing_for_this_test")
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="H3TEST_REQUIRE_ORACLE=1"):
        require("triton_missing_for_this_test")
