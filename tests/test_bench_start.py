"""bench/start.py on the CPU: the folder it writes is one `h3serve check` and `Engine.load` take, and its two `serve`
starts (cold and warm kernel cache, startup warmup on) both reach ready and are recorded with their numbers.

The widths are tiny (hidden 64, 2 x 128 heads, 2 blocks) and the profile the CPU's eager one; the GPU run writes the
released width and compiles. About 35 s on a 2-core CPU, most of it the two servers' startup warmups at 768x448.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from h3serve.accel.profile import Profile
from h3serve.cli import main as cli_main
from h3serve.config import DiTConfig
from h3serve.pipeline.engine import Engine
from oracle import oracle

oracle("diffusers")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "start.py"
TINY_WIDTHS = ["--hidden", "64", "--heads", "2", "--head-dim", "128", "--ffn", "96", "--blocks", "2"]


def bench_start() -> ModuleType:
    """The script as a module (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location("bench_start", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path]:
    """One run of the script end to end: (its JSON record, its work folder)."""
    work = tmp_path_factory.mktemp("start")
    out = work / "start.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", *TINY_WIDTHS, "--work", str(work / "run"), "--out", str(out),
         "--evict-page-cache", "--logs", str(work / "logs"), "--timeout", "120", "--budget", "300"],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "default   warm    yes" in done.stdout  # the summary table
    return json.loads(out.read_text()), work / "run"


def test_cold_and_warm_starts_reach_ready_and_are_recorded(run):
    record, work = run
    assert record["device"] == "cpu" and record["blocks"] == 2 and record["folder_bytes"] > record["dit_bytes"] > 0
    assert record["command"].startswith(str(SCRIPT)) and record["torch"]
    runs = record["profiles"]["default"]
    for phase in ("cold", "warm"):
        entry = runs[phase]
        assert entry["ready"] and entry["returncode"] == 0 and not entry["killed"], entry
        assert entry["warmup"]["passed"] and "768x448 56 frames" in entry["warmup"]["request"]
        assert entry["load_s"] > 0 and 0 < entry["warmup_s"] < entry["start_to_ready_s"]
        assert entry["start_to_port_s"] <= entry["start_to_ready_s"] <= 120
        assert entry["settings"]["H3_CACHE_DIR"] == str(work / "cache-default")
        assert entry["settings"]["H3_DEVICE"] == "cpu" and entry["profile"]["execution"] == "eager"
        assert any("loaded in" in line for line in entry["log_lines"]) and entry["log_tail"]
        assert "warmup passed" in Path(entry["log"]).read_text() and entry["warmup_stages_s"]["total"] > 0
    assert runs["cold"]["cache_bytes_before"] == 0  # cold: an empty folder
    assert "warm_saves_s" in runs and "warm_warmup_within_target" in runs


def test_the_written_folder_is_a_model_check_and_the_engine_accept(run, capsys):
    record, work = run
    folder = work / "model"
    assert cli_main(["check", "--model", str(folder)]) == 0
    assert "settings ok" in capsys.readouterr().err
    engine = Engine.load(folder, Profile())
    assert engine.components.dit.config == DiTConfig.from_dict(record["dit_config"])
    assert engine.components.dit.config.num_layers == 2 and engine.components.dit.config.hidden_size == 64


def test_the_gpu_run_writes_the_released_width_with_the_tiny_text_and_latent_widths():
    start = bench_start()
    # The tiny checkpoint's transformer/config.json, as diffusers writes it.
    tiny = {"attention_head_dim": 16, "audio_in_channels": 8, "ffn_dim": 80, "final_norm_eps": 1e-05,
            "freq_dim": 32, "hidden_size": 48, "in_channels": 8, "norm_eps": 1e-05, "num_attention_heads": 4,
            "num_layers": 2, "num_refiner_layers": 2, "patch_size": [1, 2, 2], "qk_norm_eps": 1e-05,
            "rope_freq_dim": 2, "rope_theta": 10000.0, "text_dim": 32, "time_embed_dim": 24,
            "time_embed_hidden_dim": 56}  # fmt: skip
    config = start.dit_config(tiny, start.parse_args([]))
    released = DiTConfig()
    assert DiTConfig.from_dict(config) == DiTConfig(
        **{**released.__dict__, "num_layers": 4, "text_dim": 32, "latents_dim": 8, "audio_latents_dim": 8}
    )
