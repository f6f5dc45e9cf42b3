"""Few-step adapters through the engine, the service and the CLI, on the tiny model: merged at load, their trained
sampler the default of requests that leave it out, a request's own values honoured and echoed, and the refusals
(an adapter for the other DiT, two DiTs at once, a task the adapter was not trained for, a missing file)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from adapter_fixtures import write_adapter
from h3serve.accel.profile import Profile
from h3serve.checkpoint.adapters import read_adapter
from h3serve.model.tiny import TINY_DIT
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields
from h3serve.pipeline.rules import RequestError
from h3serve.pipeline.schedule import shifted_sigmas
from service_fixtures import live_server, settings, wait_status

FOUR_STEP = "minimax_h3_fl2v_turbo_4step_v1.0_768p.safetensors"  # LightX2V's name: 4 forwards (5 points), shift 6
REF2V = "minimax_h3_ref2v_turbo_8step_v1.0_768p_comfyui_bf16.safetensors"
PROMPT = "a red fox in fresh snow"


@pytest.fixture(scope="module")
def turbo(tmp_path_factory):
    path = write_adapter(tmp_path_factory.mktemp("lora") / FOUR_STEP, "lightx2v-diffusers", TINY_DIT, rank=4)
    return read_adapter(path, config=TINY_DIT)


@pytest.fixture(scope="module")
def engine(turbo):
    return Engine.load(None, Profile(), adapters=[turbo])


def test_the_adapter_is_merged_and_its_sampler_is_the_default(engine, turbo):
    plain = Engine.load(None, Profile())
    ours = dict(engine.components.dit.named_parameters())
    theirs = dict(plain.components.dit.named_parameters())
    changed = [n for n in ours if not torch.equal(ours[n], theirs[n])]
    assert len(changed) == turbo.targets
    sampler = engine.admission.sampler
    assert (sampler.steps, sampler.video_shift, sampler.audio_shift) == (5, 6.0, 3.0)
    request = engine.validate(RequestFields(PROMPT, seed=3))
    assert (request.steps, request.forwards, request.video_shift, request.audio_shift) == (5, 4, 6.0, 3.0)
    # A request's own values win.
    own = engine.validate(RequestFields(PROMPT, seed=3, steps=3, video_shift=12.0))
    assert (own.steps, own.video_shift, own.audio_shift) == (3, 12.0, 3.0)
    # The merged model renders, deterministically, and not as the plain one does.
    one, two = engine.render(request), engine.render(request)
    assert np.array_equal(one.frames, two.frames) and np.array_equal(one.audio, two.audio)
    base = plain.render(plain.validate(RequestFields(PROMPT, seed=3, steps=5, video_shift=6.0)))
    assert not np.array_equal(one.frames, base.frames)


def test_adapters_for_the_other_dit_or_two_dits_are_refused(tmp_path):
    ref = read_adapter(write_adapter(tmp_path / REF2V, "comfyui-fused", TINY_DIT), config=TINY_DIT)
    with pytest.raises(ValueError, match="ref2va DiT"):
        Engine.load(None, Profile(), adapters=[ref])
    fl = read_adapter(write_adapter(tmp_path / FOUR_STEP, "lightx2v-diffusers", TINY_DIT), config=TINY_DIT)
    with pytest.raises(ValueError, match="task type both"):
        Engine.load(None, Profile(), task_type="both", adapters=[fl])


def test_fasth3_runs_its_own_sigma_positions_and_t2va_only(tmp_path):
    fast = read_adapter(write_adapter(tmp_path, "fasth3", TINY_DIT), config=TINY_DIT)
    assert fast.preset is not None and fast.preset.sigmas == (0.999, 0.749, 0.5, 0.25, 0.0)
    engine = Engine.load(None, Profile(), adapters=[fast])
    request = engine.validate(RequestFields(PROMPT, seed=1))
    assert request.positions == fast.preset.sigmas and request.forwards == 4
    expected = shifted_sigmas(5, 12.0, fast.preset.sigmas)
    assert torch.equal(request.schedule.video.sigmas, expected)
    assert torch.allclose(
        expected, torch.tensor([11.988 / 11.989, 8.988 / 9.239, 6 / 6.5, 0.8, 0.0]), atol=1e-6
    )  # 12b / (1 + 11b)
    # Grid points given: an even grid of that many points, the positions left out.
    assert engine.validate(RequestFields(PROMPT, seed=1, steps=3)).positions is None
    with pytest.raises(RequestError, match="trained for t2va") as err:
        engine.validate(RequestFields(PROMPT, task="i2va", keyframes=[np.zeros((64, 96, 3), np.uint8)]))
    assert err.value.field == "task"


def test_the_service_names_the_adapter_and_echoes_the_sampler_that_ran(engine, tmp_path):
    with live_server(settings(tmp_path), engine) as server, server.client() as c:
        health = c.get("/health").json()
        [entry] = health["adapters"]
        assert entry["file"] == FOUR_STEP and entry["format"] == "lightx2v-diffusers"
        assert entry["trained"]["num_inference_steps"] == 5 and entry["trained"]["flow_shift"] == 6.0
        assert "5 grid points" in health["sampler"]
        assert c.get("/v1/models").json()["data"][0]["adapters"] == health["adapters"]
        r = c.post("/v1/videos/sync", data={"prompt": PROMPT, "seed": "2"})
        assert r.status_code == 200, r.text
        assert (r.headers["x-num-inference-steps"], r.headers["x-flow-shift"]) == ("5", "6")
        job = c.post("/v1/videos", data={"prompt": PROMPT, "num_inference_steps": "3", "flow_shift": "9"}).json()
        done = wait_status(c, job["id"], {"completed"})
        assert (done["num_inference_steps"], done["flow_shift"], done["audio_flow_shift"]) == (3, 9.0, 3.0)


def test_a_request_may_name_the_merged_adapter_but_not_switch_to_another(engine, tmp_path):
    """vLLM-Omni's per-request `lora` object: the merged adapter (by file name or path, at its scale) is a no-op;
    any other adapter or scale is a 400 saying how to start a server with it, as is any adapter on a server without."""
    with live_server(settings(tmp_path / "turbo"), engine) as server, server.client() as c:
        same = c.post("/v1/videos", json={"prompt": PROMPT, "lora": {"name": FOUR_STEP, "scale": 1.0}})
        assert same.status_code == 200, same.text
        assert wait_status(c, same.json()["id"], {"completed", "failed"})["status"] == "completed"
        form = c.post("/v1/videos", data={"prompt": PROMPT, "lora": json.dumps({"path": FOUR_STEP})})
        assert form.status_code == 200, form.text
        cases = [  # (lora, param, words in the message)
            ({"path": "/loras/other_8step.safetensors"}, "lora", "cannot switch adapters; adapters are merged into "
             "the weights at load: start a server with H3_LORA=/loras/other_8step.safetensors[:SCALE]"),
            ({"name": FOUR_STEP, "scale": 0.5}, "lora.scale", f"merged {FOUR_STEP} at 1; adapters are merged"),
            ({"name": FOUR_STEP, "rank": 4}, "lora.rank", "allowed: name, lora_name, path, local_path, scale"),
            ({"scale": 1.0}, "lora", "by path or name"),
            ("strong", "lora", "JSON"),
        ]  # fmt: skip
        for value, param, words in cases:
            r = c.post("/v1/videos", json={"prompt": PROMPT, "lora": value})
            error = r.json()["error"]
            assert (r.status_code, error["param"]) == (400, param), r.text
            assert words in error["message"], error
    with live_server(settings(tmp_path / "plain"), Engine.load(None, Profile())) as server, server.client() as c:
        r = c.post("/v1/videos", json={"prompt": PROMPT, "lora": {"name": FOUR_STEP}})
        assert r.status_code == 400 and "runs no adapter" in r.json()["error"]["message"], r.text


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "h3serve.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_check_and_render_read_the_adapter(turbo, tmp_path):
    check = _cli("check", "--lora", f"{turbo.path}:0.5")
    assert check.returncode == 0, check.stderr
    assert "adapter:" in check.stderr and FOUR_STEP in check.stderr
    assert json.loads(check.stdout)["lora"] == f"{turbo.path}:0.5"
    missing = _cli("check", "--lora", str(tmp_path / "nope.safetensors"))
    assert missing.returncode == 1 and "H3_LORA (--lora)" in missing.stderr and "no such file" in missing.stderr
    # The setting is parsed as the engine parses it (settings.parse_lora_setting), so a value the engine could not
    # read is refused here, before anything loads.
    for value, why in ((f"{turbo.path}:strong", "not a number"), (f"{turbo.path}:0", "merges nothing")):
        refused = _cli("check", "--lora", value)
        assert refused.returncode == 1 and why in refused.stderr, refused.stderr
    out = tmp_path / "turbo.mp4"
    render = _cli("render", PROMPT, "-o", str(out), "--lora", str(turbo.path), "--no-progress")
    assert render.returncode == 0, render.stderr
    assert "5 grid points (4 DiT forwards), shifts 6/3" in render.stderr and out.is_file()
    assert "adapters merged in " in render.stderr
