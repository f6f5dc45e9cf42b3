"""Every bench/ script at its smallest setting on the GPU (issue 53), so that a change that
breaks a benchmark fails here instead of in the next GPU session: each script runs as a subprocess, as a GPU session
runs it (`python bench/NAME.py ...`, src/ and tests/ importable), writing its JSON under tmp_path; the test asserts
exit 0, that the file parses, that it holds the rows the arguments ask for, and that no row recorded an error (the
scripts record a failing profile's error and go on, which is how `dit_step.py` failed for every profile unnoticed).

Smallest settings: the full-size scripts build the DiT at the released widths with one block (`--blocks 1`; the text
encoder and the VAEs stay full size), the fewest grid points, iterations and profiles; scripts that are tiny by design
(`cuda_profile_check.py`, `gpu_check.py`'s tiny render) run as they are. A script that needs what one GPU of this
session cannot give (several GPUs, a package not installed, more than one 80 GB card's memory) is a skipped row whose
reason says what. bench/'s CPU dry runs are tests/test_bench_smoke.py's.

Marked `gpu`: skipped without CUDA (the CPU machines and CI), run on the GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def errors(record, path: str = "") -> Iterator[str]:
    """Where `record` holds an error: every key `error` or `*_error` with a value (the service's health says
    `"error": null`), as a path."""
    if isinstance(record, dict):
        for key, value in record.items():
            where = f"{path}.{key}" if path else str(key)
            if (key == "error" or str(key).endswith("_error")) and value:
                yield f"{where}: {str(value)[:300]}"
            else:
                yield from errors(value, where)
    elif isinstance(record, list):
        for i, value in enumerate(record):
            yield from errors(value, f"{path}[{i}]")


def no_errors(record) -> None:
    found = list(errors(record))
    assert not found, "\n".join(found)


# ---- what each script's record must hold ----------------------------------------------------------------------------


def adaln_tables(r: dict) -> None:
    no_errors(r)
    assert set(r["schedules"]) == {"t2va 3 grid points", "fl2va 3 grid points"}
    for entry in r["schedules"].values():
        assert entry["forwards"] == 2 and entry["blocks_per_step"] == 1 and entry["same_object_when_cached"]


def cuda_profile_check(r: dict) -> None:
    assert [run["task"] for run in r["runs"]] == ["t2va", "i2va", "fl2va"]
    assert all(run["identical"] for run in r["runs"]), r["runs"]
    assert r["graphs"] is not None and r["recompiles"] == 0  # what the script checks: no recompile after the first


def decode(r: dict) -> None:
    no_errors(r)
    entry = r["shapes"]["reference"]
    assert set(r["shapes"]) == {"reference"} and set(entry["variants"]) == {"before", "batched"}
    assert entry["streamed_batched"]["ms"] > 0
    assert {k: len(v) for k, v in r["preview_windows_ms"].items()} == {"before": 5, "batched": 5}


def decode_batch(r: dict) -> None:
    no_errors(r)
    assert {"x_embedder", "to_qkv", "attention"} <= set(r["invariance"])
    assert set(r["batched"]) == {"1", "2"} and set(r["graphed"]) == {"1"}
    assert r["profile"]["batch"] in (1, 2) and set(r["launch"]) == {"rows", "norm", "qk"}


PROFILES_DIT_STEP = ("CUDNN_ATTN+eager+BF16", "CUDNN_ATTN+compile+CUTLASS", "diffusers+eager", "diffusers+offload")


def dit_step(r: dict) -> None:
    no_errors(r)
    assert r["blocks"] == 1 and set(r["profiles"]) == set(PROFILES_DIT_STEP)
    for name, entry in r["profiles"].items():
        assert entry["ms_median"] > 0 and entry["rerun_bitwise_identical"], (name, entry)
        assert "rel_err_video_vs_peer_eager" in entry, name
    assert r["profiles"]["CUDNN_ATTN+compile+CUTLASS"]["recompiles"] == 0
    offloaded = r["profiles"]["diffusers+offload"]  # diffusers' group offloading with streams: the same numbers
    assert offloaded["rel_err_video_vs_peer_eager"] == 0 and "streams True" in offloaded["offload"], offloaded


def encode(r: dict) -> None:
    from tests.test_bench_smoke import encode_checks

    encode_checks(r, {"veryfast"})
    assert r["conversion"]["device_equals_host_conversion"] and r["conversion"]["device_ms"] > 0


def fa4_check(r: dict) -> None:
    no_errors(r)
    assert "missing" not in r
    wanted = {"resolve_auto", "resolve_fa4", "dit_reference", "dit_default", "split_heads_bitwise",
              "decoder_b1_s1285", "decoder_b4_s1285", "decoder_b1_s2565"}  # fmt: skip
    assert wanted <= set(r)


def full_size_smoke(r: dict) -> None:
    assert set(r["runs"]) == {"t2va", "t2va_again", "i2va"}
    assert r["runs"]["t2va_again"]["identical_to_first"]
    assert all(run["audio_finite"] and run["frames_finite_and_varied"] for run in r["runs"].values())


def fused_passes(r: dict) -> None:
    # A launch that does not fit (registers) is recorded as that variant's error by design: not checked here.
    assert set(r["passes"]) == {"norm_modulate"}
    entry = r["passes"]["norm_modulate"]
    assert entry["best"] in entry["variants"] and entry["best_ms"] > 0 and entry["inductor_ms"] > 0


def gpu_check(r: dict) -> None:
    no_errors(r)
    assert r["tiny_render"]["frames_identical"] and r["tiny_render"]["audio_identical"]
    assert r["dit"]["layers"] == 1 and r["dit"]["rerun_bitwise_identical"] and r["dit"]["ours_ms_median"] > 0


def host_memory(r: dict) -> None:
    assert set(r["ways"]) == {"whole", "streamed"} and "saved_mb" in r
    assert r["ways"]["whole"]["frames"] == r["ways"]["streamed"]["frames"] > 0
    assert all(way["mp4_bytes"] > 0 for way in r["ways"].values())


def humming_check(r: dict) -> None:
    assert set(r["shapes"]) == {"qkv"} and r["available"] is None  # exit 0: no required check failed


def load(r: dict) -> None:
    no_errors(r)
    assert len(r["runs"]) == 8  # bf16 and fp8, reader and mmap, first read and cached
    assert r["bitwise_equal_reader_vs_mmap"] == {"bf16": True, "fp8": True}
    assert all(run["gb_per_s"] > 0 for run in r["runs"])


LORA_RUN = "reference 768x448x56, adapter default (5 points)"


def lora(r: dict) -> None:
    no_errors(r)
    entry = r["runs"][f"eager BF16: {LORA_RUN}"]
    assert len(r["runs"]) == 1 and entry["forwards"] == 4 and entry["identical_to_first"], entry


def lora_runtime(r: dict) -> None:
    from test_bench_smoke import lora_runtime_checks

    lora_runtime_checks(r)
    assert r["alternating"]["recompiles_after"] == r["alternating"]["recompiles_before"], r["alternating"]


def one_box(r: dict) -> None:
    no_errors(r)
    assert set(r["runs"]) == {"BF16"} and {"reference", "default"} <= set(r["runs"]["BF16"])


def ref2va_smoke(r: dict) -> None:
    assert set(r["runs"]) == {"first (compiles)", "second"} and r["second_identical_to_first"]
    assert r["rows"]["reference_video"] > 0 and r["rows"]["reference_audio"] > 0


def render(r: dict) -> None:
    no_errors(r)
    entry = r["runs"]["eager"]
    assert set(r["runs"]) == {"eager"} and entry["attention"] == "CUDNN_ATTN" and entry["identical_to_first"], entry
    assert entry["steps"] == 2 and entry["per_forward_s"] > 0
    assert set(entry["mp4"]) == {"default", "medium/4/0"} and all(m["bytes"] > 0 for m in entry["mp4"].values())


def serve_accept(r: dict) -> None:
    assert r["warmup"]["passed"], r["warmup"]
    assert r["accept"]["passed"], r["accept"]
    assert r["async_job"]["frames_equal_to_sync"] and r["cancel"]["status"] == "cancelled"


def start(r: dict) -> None:
    no_errors(r)
    runs = r["profiles"]["cutlass"]
    for phase in ("cold", "warm"):
        entry = runs[phase]
        assert entry["ready"] and entry["returncode"] == 0 and not entry["killed"], entry
        assert entry["warmup"]["passed"] and entry["settings"]["H3_DEVICE"] == "cuda"


def stepcache(r: dict) -> None:
    assert set(r["runs"]) == {"full compute", "balanced", "conservative"}
    assert r["runs"]["full compute"]["forwards"] == 2 and r["recompiles"] == 0


def text_encoder_fp8(r: dict) -> None:
    assert r["quantized_linears"] and r["text_rows"] > 0 and 0 < r["text_states_rel_err"] < 1
    assert r["render_peak_gib"] > 0 and r["render_timings_s"]["total"] > 0


def warm_restart(r: dict) -> None:
    no_errors(r)
    assert set(r["runs"]) == {"cold", "warm"}
    assert all(run["graphs"] >= 1 for run in r["runs"].values())


# ---- the scripts ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Smoke:
    """One script's smallest run: its arguments (`{out}`: the JSON it writes, `{tmp}`: a folder of its own), what
    its record must hold, and a bound on its wall time (seconds). `skip`: why it does not run here; `unless`: a
    check made at collection (a reason to skip, or None)."""

    args: tuple[str, ...] = ()
    check: Callable[[dict], None] | None = None
    timeout: int = 300
    skip: str | None = None
    unless: Callable[[], str | None] = field(default=lambda: None)


def fa4_missing() -> str | None:
    from h3serve.accel import fa4

    return fa4.missing()


def humming_missing() -> str | None:
    from h3serve.accel.humming import available

    return available()


def cli(words: str, *more: str) -> tuple[str, ...]:
    """A script's arguments: `words` split at spaces, then `more` as they are (arguments with spaces in them)."""
    return (*words.split(), *more)


OUT = "--out {out}"
CPU_ONLY = "runs on the CPU by design: tests/test_bench_smoke.py runs it at its smallest setting"
TOO_BIG = (
    "builds every component at full size on the GPU (the DiT ~60 GB and the text encoder ~48 GB: more than one 80 GB "
    "card) and has no smaller setting"
)
SMOKES: dict[str, Smoke] = {
    "adaln_tables": Smoke(cli(f"--blocks 1 --steps 3 {OUT}"), adaln_tables, 180),
    "cuda_profile_check": Smoke(cli(OUT), cuda_profile_check, 300),
    "decode": Smoke(cli(f"--shapes reference --iters 1 --no-profile --variants batched {OUT}"), decode, 240),
    "decode_batch": Smoke(cli(f"--batches 1,2 --graph-batches 1 --iters 1 --sweep-s 0 {OUT}"), decode_batch, 240),
    # The peer (diffusers) over the same one block, eager; ours exact and as the CUDA default compiles it.
    "dit_step": Smoke(
        cli(f"--blocks 1 --only {','.join(PROFILES_DIT_STEP)} --warmup 0 --iters 1 {OUT}"), dit_step, 300
    ),
    "encode": Smoke(cli(f"--frames 22 --width 192 --height 128 --presets veryfast --pace 0.05 {OUT}"), encode, 240),
    "event_streams": Smoke(skip=CPU_ONLY),
    "fa4_check": Smoke(cli(f"--iters 1 {OUT}"), fa4_check, 300, unless=fa4_missing),
    "full_size_smoke": Smoke(cli(f"--blocks 1 --steps 2 {OUT}"), full_size_smoke, 300),
    "fused_passes": Smoke(cli(f"--rows 256 --only norm_modulate {OUT}"), fused_passes, 240),
    "gpu_check": Smoke(cli(f"--layers 1 --warmup 0 --iters 1 {OUT}"), gpu_check, 240),
    # CPU by design, but a minute and more on 2 cores even at 3 latents: run here, on the GPU machine's CPUs.
    "host_memory": Smoke(cli(f"--latents 3 {OUT}"), host_memory, 240),
    "humming_check": Smoke(
        cli(f"--rows 256 --layers qkv --prefixes 1 100 --warmup 0 --iters 1 --skip-tiny {OUT}"),
        humming_check,
        240,
        unless=humming_missing,
    ),
    "load": Smoke(cli(f"--device cuda --blocks 1 --hidden 256 {OUT}"), load, 180),
    "lora": Smoke(cli(f"--blocks 1 --rank 4 {OUT} --profiles", "eager BF16", "--runs", LORA_RUN), lora, 300),
    "lora_runtime": Smoke(cli(f"--blocks 1 --rank 4 --warmup 0 --iters 1 {OUT}"), lora_runtime, 300),
    "offload": Smoke(
        skip="each cap's child builds every component at full size on the GPU before placing it (more than one 80 GB "
        "card), and its placements are planned for the released DiT: no smaller setting"
    ),
    "one_box": Smoke(
        cli(f"--blocks 1 --steps 2 --default-steps 2 --profiles BF16 --dir {{tmp}}/adaln {OUT}"), one_box, 360
    ),
    "plot_scaling": Smoke(skip=CPU_ONLY),
    "ref2va_smoke": Smoke(cli(f"--blocks 1 --steps 2 {OUT}"), ref2va_smoke, 300),
    "render": Smoke(
        cli(f"--blocks 1 --steps 2 --profiles eager --mp4 {{tmp}}/mp4 --mp4-encodings default,medium/4/0 {OUT}"),
        render,
        300,
    ),
    "serve_accept": Smoke(cli(f"--blocks 1 {OUT}"), serve_accept, 480),
    "split": Smoke(
        skip=f"the split path (a worker and a one-GPU engine, one after the other) {TOO_BIG}; its plumbing runs on "
        "the CPU (--tiny) in tests/test_bench_smoke.py"
    ),
    # The folder's DiT at tiny widths (hidden 64, 2 x 128 heads): two `serve` starts, cold and warm, compiled CUTLASS.
    "start": Smoke(
        cli(
            "--device cuda --profiles cutlass --blocks 1 --hidden 64 --heads 2 --head-dim 128 --ffn 96 "
            f"--work {{tmp}}/work --timeout 240 --budget 500 {OUT}"
        ),
        start,
        560,
    ),
    # 2 blocks: the balanced cache computes the first and caches the rest (1 block leaves nothing to cache).
    "stepcache": Smoke(cli(f"--blocks 2 --steps 3 {OUT}"), stepcache, 300),
    "text_encoder_fp8": Smoke(cli(f"--blocks 1 --steps 2 {OUT}"), text_encoder_fp8, 300),
    "vae_decode_memory": Smoke(skip=CPU_ONLY),
    "warm_restart": Smoke(cli(f"--blocks 1 {OUT}"), warm_restart, 360),
    "multi_gpu.sh": Smoke(
        skip="several GPUs: its parts are full-size runs of up to ten minutes each (the released DiT split over 1 to N "
        "GPUs); with N = 1 it has no smaller form, and the scripts it calls run here at their smallest"
    ),
}


def scripts() -> list[str]:
    """bench/'s runnable benchmarks: every .py at its top level, and multi_gpu.sh."""
    return sorted([p.stem for p in BENCH.glob("*.py")] + ["multi_gpu.sh"])


def test_every_bench_script_has_a_smoke_row():
    assert set(SMOKES) == set(scripts())


def params() -> list:
    out = []
    for name in scripts():
        smoke = SMOKES.get(name)
        if smoke is None:
            out.append(name)  # no row: the test above fails; this one says which
            continue
        reason = smoke.skip if smoke.skip is not None else (smoke.unless() if torch.cuda.is_available() else None)
        out.append(pytest.param(name, marks=pytest.mark.skip(reason=reason)) if reason else name)
    return out


@pytest.mark.parametrize("name", params())
def test_bench_script_runs_at_its_smallest_setting(name, tmp_path):
    smoke = SMOKES.get(name)
    assert smoke is not None and smoke.check is not None, f"bench/{name}: no smoke row in this file"
    out = tmp_path / f"{name}.json"
    args = [a.format(out=out, tmp=tmp_path) for a in smoke.args]
    path = os.pathsep.join(p for p in (str(REPO / "src"), str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    # From the repository root, as a GPU session runs them; in a process group of its own, so that a script past its
    # bound is stopped with its children (warm_restart's and host_memory's processes, start's servers).
    proc = subprocess.Popen([sys.executable, str(BENCH / f"{name}.py"), *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=smoke.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"bench/{name}.py ran past {smoke.timeout} s\n--- stdout\n{stdout[-3000:]}\n--- stderr\n"
                    f"{stderr[-3000:]}")  # fmt: skip
    log = f"bench/{name}.py {' '.join(args)}\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-4000:]}"
    assert proc.returncode == 0, log
    assert out.is_file(), f"no {out.name} written\n{log}"
    record = json.loads(out.read_text())
    try:
        smoke.check(record)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{log}") from err
