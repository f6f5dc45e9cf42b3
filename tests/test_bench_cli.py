"""`h3serve bench` runs a checkout's bench/ scripts and refuses clearly outside one."""

from __future__ import annotations

from pathlib import Path

from h3serve.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_bench_runs_the_script_with_its_arguments(capfd):
    assert main(["bench", "--repo", str(REPO), "dit-step", "--help"]) == 0
    assert "every profile of ours and the peer" in " ".join(capfd.readouterr().out.split())  # argparse wraps lines


def test_bench_outside_a_checkout_is_refused(tmp_path, capsys):
    assert main(["bench", "--repo", str(tmp_path), "render", "--out", "x.json"]) == 1
    err = capsys.readouterr().err
    assert "bench/render.py: not found" in err and "--repo" in err


def test_every_bench_name_is_a_script_and_every_script_a_name():
    from h3serve.cli.tools import BENCHES

    scripts = {p.stem.replace("_", "-") for p in (REPO / "bench").glob("*.py") if not p.stem.endswith("lib")}
    assert set(BENCHES) == scripts
