"""bench/'s CPU dry runs at their smallest setting (issue 53): each script that runs on the CPU
(`--tiny`, `--device cpu`, or on the CPU by design) runs as a subprocess, as a session runs it, and its JSON must
parse and hold the rows asked for; and `h3serve bench --help` names every script. Measured alone on 2 cores (wall):
dit_step 5 s, dit_step --num-gpus 1 12 s, split 26 s (the slowest: a spawned worker's two tiny renders and two
in-process; kept, as the only run of the script outside a multi-GPU session), serve_accept 11 s, stepcache 18 s,
load 8 s, event_streams 6 s, vae_decode_memory 2 s each, plot_scaling under 1 s: about 90 s for the file.
tests/test_gpu_bench_smoke.py runs every script on the GPU.

Not here, each for its reason:
  start.py           --device cpu is tests/test_bench_start.py's (about 35 s)
  host_memory.py     over a minute on 2 cores even at 3 latents (the decode at 1344x768): the GPU file runs it
  every other script GPU only (no CPU dry run)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3serve.cli import main as cli_main
from oracle import oracle

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
# The scripts this file runs, and those with a CPU setting it leaves to others (the docstring says why).
RUN_HERE = ("dit_step", "event_streams", "load", "lora_runtime", "plot_scaling", "serve_accept", "split", "stepcache",
            "vae_decode_memory")  # fmt: skip
ELSEWHERE = ("start", "host_memory")


def script(name: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python bench/NAME.py ARGS` from the repository root with src/ importable; exit 0 asserted."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH"))
                                                      if p)}  # fmt: skip
    done = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, f"bench/{name}.py {' '.join(args)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def no_errors(record) -> None:
    """No `error` key with a value anywhere in `record` (the scripts record a failing row's error and go on)."""
    text = json.dumps(record)
    assert not re.search(r'"error": (?!null)', text), text[:3000]


def test_every_script_with_a_cpu_setting_is_run_here_or_says_where():
    flagged = {p.stem for p in BENCH.glob("*.py") if re.search(r'"--tiny"|"--device"', p.read_text())}
    flagged |= {"event_streams", "plot_scaling", "vae_decode_memory", "host_memory"}  # on the CPU by design
    assert flagged == set(RUN_HERE) | set(ELSEWHERE)


def test_every_script_has_a_row_in_the_gpu_smoke_file():
    # Here, so that CI (no GPU: the GPU file's tests all skip) fails for a new script without a GPU smoke row.
    from test_gpu_bench_smoke import SMOKES, scripts

    assert set(SMOKES) == set(scripts())


def test_bench_help_names_every_script(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["bench", "--help"])
    assert done.value.code == 0
    listing = " ".join(capsys.readouterr().out.split())
    choices = re.search(r"\{([^}]*)\}", listing).group(1).split(",")
    assert sorted(choices) == sorted(p.stem.replace("_", "-") for p in BENCH.glob("*.py"))


def test_dit_step_tiny_measures_one_profile_and_the_peer_resident_and_offloaded(tmp_path):
    """Ours against the peer; `diffusers+offload` (diffusers' own group offloading, a block at a time: the peer's row
    where it does not fit the card resident) bit for bit the peer's eager forward."""
    oracle("diffusers")
    out = tmp_path / "dit_step.json"
    only = "TORCH_SDPA+eager+BF16,diffusers+eager,diffusers+offload"
    script("dit_step", "--tiny", "--only", only, "--warmup", "0", "--iters", "1", "--out", str(out))
    record = json.loads(out.read_text())
    no_errors(record)
    assert set(record["profiles"]) == set(only.split(",")) and record["shape"]["name"] == "reference (tiny)"
    ours = record["profiles"]["TORCH_SDPA+eager+BF16"]
    assert ours["rerun_bitwise_identical"] and ours["rel_err_video_vs_peer_eager"] < 1e-2
    offloaded = record["profiles"]["diffusers+offload"]
    assert offloaded["offload"].startswith("block_level") and offloaded["rerun_bitwise_identical"]
    assert offloaded["rel_err_video_vs_peer_eager"] == 0 and offloaded["rel_err_audio_vs_peer_eager"] == 0


@pytest.fixture(scope="module")
def split_record(tmp_path_factory) -> Path:
    """`dit_step.py --tiny --num-gpus 1`: the plain forward in one spawned rank, and its scaling table."""
    out = tmp_path_factory.mktemp("dit_step_split") / "split.json"
    script("dit_step", "--tiny", "--num-gpus", "1", "--only", "TORCH_SDPA+eager+BF16", "--warmup", "0", "--iters", "1",
           "--out", str(out))  # fmt: skip
    return out


def test_dit_step_tiny_num_gpus_writes_the_scaling_table(split_record):
    record = json.loads(split_record.read_text())
    no_errors(record)
    assert set(record["groups"]) == {"1"} and set(record["scaling"]) == {"TORCH_SDPA+eager+BF16"}
    assert record["scaling"]["TORCH_SDPA+eager+BF16"]["1"]["speedup_vs_1"] == 1.0


def test_plot_scaling_draws_a_dit_step_result(split_record, tmp_path):
    from PIL import Image

    png = tmp_path / "scaling.png"
    script("plot_scaling", "--out", str(png), str(split_record))
    assert Image.open(png).size[0] > 100


def test_split_tiny_renders_split_and_on_one_device_alike(tmp_path):
    out = tmp_path / "split.json"
    script("split", "--tiny", "--num-gpus", "1", "--steps", "2", "--out", str(out))
    entry = json.loads(out.read_text())["renders"]["tiny cpu"]
    assert entry["frames_equal"] and entry["audio_equal"] and entry["split"]["forwards"] == 1


def test_serve_accept_tiny_passes_the_acceptance(tmp_path):
    out = tmp_path / "serve_accept.json"
    script("serve_accept", "--tiny", "--out", str(out))
    record = json.loads(out.read_text())
    assert record["warmup"]["passed"] and record["accept"]["passed"], record
    assert record["async_job"]["frames_equal_to_sync"] and record["cancel"]["status"] == "cancelled"


def test_stepcache_tiny_renders_each_quality(tmp_path):
    out = tmp_path / "stepcache.json"
    script("stepcache", "--tiny", "--steps", "2", "--out", str(out))
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"full compute", "balanced", "conservative"}
    assert all(run["forwards"] == 1 for run in runs.values())


def test_load_on_the_cpu_reads_a_one_block_checkpoint_both_ways(tmp_path):
    out = tmp_path / "load.json"
    script("load", "--device", "cpu", "--blocks", "1", "--hidden", "256", "--dir", str(tmp_path / "ckpt"),
           "--out", str(out))  # fmt: skip
    record = json.loads(out.read_text())
    assert len(record["runs"]) == 8 and record["bitwise_equal_reader_vs_mmap"] == {"bf16": True, "fp8": True}
    assert not (tmp_path / "ckpt" / "config.json").exists()  # the checkpoint removed after


@pytest.mark.parametrize("mode", ["tiled", "untiled"])
def test_vae_decode_memory_decodes_both_ways(mode):
    # No JSON: the script prints one line. 24 x 24 latents: more than one 16-latent tile.
    done = script("vae_decode_memory", mode, "3", "24", "24")
    assert re.search(rf"^{mode} +latents \(1, 24, 3, 24, 24\) -> \(1, 3, 9, 96, 96\): peak RSS", done.stdout), (
        done.stdout
    )


def test_event_streams_times_a_render_without_and_with_streams(tmp_path):
    out = tmp_path / "event_streams.json"
    script("event_streams", "--steps", "5", "--streams", "2", "--stuck", "1", "--repeats", "1", "--out", str(out))
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"no_streams", "with_streams"} and all(len(r) == 1 for r in runs.values())
    assert all(r[0]["status"] == "completed" for r in runs.values()), runs
    assert runs["with_streams"][0]["streams_asked"] == 2


def encode_checks(record: dict, presets: set[str]) -> None:
    """What bench/encode.py must show whatever the machine: every setting twice the same bytes, the bytes not
    following the workers, a row for each preset and layout, the tail measured, before and after."""
    for content, rows in record["contents"].items():
        settings = {k for k in rows if "/" in k}
        assert {k.split("/")[0] for k in settings} == presets, settings
        assert all(rows[k]["same_bytes"] and rows[k]["bytes"] > 0 and rows[k]["psnr_yuv_db"] > 20 for k in settings)
        assert rows["default_workers_1"]["same_bytes_as_default"], content
        assert rows["before"]["s"] > 0 and all(rows["tail"][w]["tail_s"] >= 0 for w in ("before", "default"))


def test_encode_measures_every_setting_against_the_writer_before(tmp_path):
    out = tmp_path / "encode.json"
    script("encode", "--frames", "22", "--width", "96", "--height", "64", "--presets", "veryfast", "--contents",
           "natural", "--pace", "0.02", "--out", str(out))  # fmt: skip
    record = json.loads(out.read_text())
    encode_checks(record, {"veryfast"})
    assert record["conversion"]["swscale_one_thread_ms"] > 0


def lora_runtime_checks(record: dict) -> None:
    """What `bench/lora_runtime.py` must show on any device: no adapter applied is the plain forward bit for bit,
    an adapter applied changes it (its error against the merged exact reference is small but not zero), the same
    adapter again gives the same bits, and a switch from the host cache reads nothing from disk."""
    no_errors(record)
    assert record["none_bitwise_plain"] == {"reference": True, "default": True}
    assert all(0 < e < 0.05 for pair in record["runtime_error_vs_exact"].values() for e in pair)
    variants = record["runtime_variants"]
    assert "engine" in variants and len(variants) >= 2  # width one adapter's and the full one at least
    assert all(0 < e < 0.05 for v in variants.values() for pair in v["error_vs_exact"].values() for e in pair)
    assert record["a_again_bitwise"] and record["first_use_from_disk_s"] > 0
    assert all(s["from_disk_s"] == 0 for s in record["switches"]) and record["library"]["reads"] == 0


def test_lora_runtime_tiny_applies_adapters_at_run_time_against_merged(tmp_path):
    out = tmp_path / "lora_runtime.json"
    script("lora_runtime", "--tiny", "--rank", "4", "--warmup", "0", "--iters", "1", "--out", str(out))
    lora_runtime_checks(json.loads(out.read_text()))


def test_a_full_size_build_that_cannot_fit_is_refused_at_once_naming_the_memory():
    """`lib.models.check_room`: the weights the full-size random build puts on the GPU, counted on meta models (the
    DiT 61.7 GiB as the released checkpoint's 33 B parameters in bf16 with fp32 islands), refused against an 80 GB
    card's free memory before any is drawn, with how many main blocks would fit; a setting that fits passes."""
    sys.path.insert(0, str(BENCH))
    from lib.models import GIB, check_room, weights_bytes

    parts = weights_bytes()
    assert round(parts["dit"] / GIB, 1) == 61.7 and round(parts["text_encoder"] / GIB, 1) == 48.0
    assert parts["dit"] == parts["dit_rest"] + 50 * parts["per_block"]
    with pytest.raises(SystemExit, match=r"needs 120\.0 GiB .* and 79\.1 GiB is free: at most --blocks 16"):
        check_room(torch.device("cuda"), parts, free=int(79.1 * GIB))
    check_room(torch.device("cuda"), weights_bytes(16), free=int(79.1 * GIB))  # what it named fits
    check_room(torch.device("cuda"), weights_bytes(dit_only=True), free=int(139 * GIB))  # an H200 holds the DiT
