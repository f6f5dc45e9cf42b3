"""Run-time adapters through the API (issue 57's service side), on the tiny model and a real server on loopback:
vLLM-Omni's `lora` (an object or a list) and LightX2V's `lora_name` / `lora_strength` become the engine's adapters; the
job record and the sync headers name them; a request without adapters renders exactly what a server without
H3_ADAPTERS renders; every refusal names the field the client sent and what is allowed; /v1/models, /health and
/metrics show the declared adapters and what the renders did with them.

The host cache holds one of the two adapters (H3_ADAPTER_CACHE_GIB), so a render applying both reads one from disk
again: the read counter has something to count."""

from __future__ import annotations

import json

import pytest

from adapter_fixtures import write_adapter
from h3serve import startup
from h3serve.accel.profile import Profile
from h3serve.checkpoint.adapters.library import AdapterLibrary
from h3serve.model.tiny import TINY_DIT
from h3serve.pipeline.engine import Engine
from service_fixtures import live_server, settings, wait_status

# A small render: the tiny model's canvas, its fewest frames, 3 grid points (2 forwards).
REQUEST = {
    "prompt": "a red fox in fresh snow",
    "size": "224x128",
    "num_frames": 22,
    "num_inference_steps": 3,
    "seed": 7,
}
FORM = {name: str(value) for name, value in REQUEST.items()}
DECLARED = "turbo, style"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    turbo = write_adapter(folder / "turbo.safetensors", "lightx2v-diffusers", TINY_DIT, rank=4, seed=1)
    style = write_adapter(folder / "style.safetensors", "lightx2v-diffusers", TINY_DIT, rank=4, seed=2)
    return turbo, style


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    """A server as `H3_ADAPTERS=turbo=...,style=...:0.5` starts it, its host cache one and a half adapters large."""
    turbo, style = files
    nbytes = AdapterLibrary([("probe", turbo, 1.0)], TINY_DIT, 2**30, 1).catalog.entries["probe"].nbytes
    s = settings(
        tmp_path_factory.mktemp("served"),
        adapters=f"turbo={turbo},style={style}:0.5",
        adapter_cache_gib=1.5 * nbytes / 2**30,
    )
    library = startup.read_library(s, None, "fl2va")
    assert library.held == ("style",)  # turbo was given up when style was read
    with live_server(s, Engine.load(None, Profile(), library=library)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def both(client):
    """An async job applying both adapters (a form, `lora` as JSON text): its record and its MP4."""
    lora = json.dumps([{"name": "turbo"}, {"name": "style", "scale": 0.75}])
    r = client.post("/v1/videos", data={**FORM, "lora": lora})
    assert r.status_code == 200, r.text
    assert r.json()["adapters"] == [{"name": "turbo", "scale": 1.0}, {"name": "style", "scale": 0.75}]
    job = wait_status(client, r.json()["id"], {"completed", "failed"})
    assert job["status"] == "completed", job
    return job, client.get(f"/v1/videos/{job['id']}/content").content


@pytest.fixture(scope="module")
def plain(both, client):
    """The same request without adapters on the same server, after a render that applied two (`both`)."""
    r = client.post("/v1/videos/sync", json=REQUEST)
    assert r.status_code == 200, r.text
    return r


def test_a_job_applying_two_adapters_names_them_and_renders_otherwise(both, plain, client):
    job, mp4 = both
    assert job["adapters"] == [{"name": "turbo", "scale": 1.0}, {"name": "style", "scale": 0.75}]
    assert client.get(f"/v1/videos/{job['id']}").json()["adapters"] == job["adapters"]  # as stored
    assert "adapters" in job["stage_durations"]
    assert mp4[:12] == plain.content[:12] and mp4 != plain.content
    assert "x-h3-adapters" not in plain.headers


def test_without_adapters_the_mp4_is_the_one_a_server_without_them_renders(plain, tmp_path):
    with live_server(settings(tmp_path)) as bare, bare.client() as c:
        r = c.post("/v1/videos/sync", json=REQUEST)
        assert r.status_code == 200, r.text
        assert c.get("/health").json()["runtime_adapters"] == {"max_active": 0, "adapters": []}
    assert r.content == plain.content


def test_lightx2v_lora_name_and_strength(client, plain):
    r = client.post("/v1/videos/sync", data={**FORM, "lora_name": "style", "lora_strength": "2"})
    assert r.status_code == 200, r.text
    assert r.headers["x-h3-adapters"] == "style:2"
    assert r.content != plain.content
    default = client.post("/v1/videos", json={**REQUEST, "lora_name": "style"})  # its declared scale, 0.5
    assert default.status_code == 200, default.text
    assert default.json()["adapters"] == [{"name": "style", "scale": 0.5}]
    assert wait_status(client, default.json()["id"], {"completed", "failed"})["status"] == "completed"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"lora": [{"name": "turbo"}, {"name": "nope"}]}, "lora[1]", f"not declared here; declared: {DECLARED}"),
        ({"lora": {"lora_name": "nope"}}, "lora", f"declared: {DECLARED}"),
        ({"lora_name": "nope"}, "lora_name", f"declared: {DECLARED}"),
        ({"lora": {"name": "turbo", "scale": 9}}, "lora.scale", "must be within -4..4 and not 0"),
        ({"lora": [{"name": "turbo"}, {"name": "style", "scale": 0}]}, "lora[1].scale", "within -4..4 and not 0"),
        ({"lora_name": "turbo", "lora_strength": -9}, "lora_strength", "within -4..4"),
        ({"lora": {"path": "/etc/passwd"}}, "lora", f"never a file; declared here: {DECLARED}"),
        ({"lora": {"name": "turbo", "local_path": "turbo.safetensors"}}, "lora", f"declared here: {DECLARED}"),
        ({"lora": [{"name": "turbo"}, {"name": "style"}, {"name": "turbo"}]}, "lora", "at most 2 at once"),
        ({"lora": [{"name": "turbo"}, {"name": "turbo", "scale": 2}]}, "lora[1]", "turbo is named twice"),
        ({"lora_strength": 0.5}, "lora_strength", "give lora_name too"),
        ({"lora": {"name": "turbo"}, "lora_name": "style"}, "lora_name", "give one"),
        ({"lora": []}, "lora", "leave it out"),
        ({"lora": [{"name": "turbo", "rank": 4}]}, "lora[0].rank", "allowed: name, lora_name, path, local_path, scale"),
        ({"lora": {"name": "turbo", "lora_name": "style"}}, "lora", "differ; give one"),
    ],
)  # fmt: skip
def test_each_refusal_names_the_field_sent_and_what_is_allowed(client, fields, param, words):
    r = client.post("/v1/videos", json={**REQUEST, **fields})
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (400, param), r.text
    assert words in error["message"], error


def test_a_form_refusal_names_the_list_item(client):
    r = client.post("/v1/videos", data={"prompt": "p", "lora": json.dumps([{"name": "style"}, {"name": "x"}])})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "lora[1]"), r.text


def test_models_and_health_list_the_declared_adapters(both, client, files):
    model = client.get("/v1/models").json()["data"][0]
    assert model["adapters"] == [] and "limits" in model  # the merged ones, as before
    runtime = model["runtime_adapters"]
    assert runtime["max_active"] == 2
    turbo, style = runtime["adapters"]
    assert (turbo["name"], turbo["file"], turbo["scale"], style["name"], style["scale"]) == (
        "turbo", files[0].name, 1.0, "style", 0.5,
    )  # fmt: skip
    assert turbo["format"] == "lightx2v-diffusers" and turbo["ranks"] == [4] and 0 < turbo["gib"] < 1e-3
    assert set(turbo) == {"name", "file", "format", "scale", "ranks", "dit_kind", "trained", "gib", "held"}
    # The cache holds one of the two: style, the last that `both` used (a render applying style alone keeps it).
    assert (turbo["held"], style["held"]) == (False, True)
    assert client.get("/health").json()["runtime_adapters"] == runtime


def metric(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_metrics_count_renders_per_adapter_switches_and_reads(both, plain, client):
    text = client.get("/metrics").text
    assert metric(text, 'h3serve_adapter_renders_total{adapter="turbo"}') >= 1
    assert metric(text, 'h3serve_adapter_renders_total{adapter="style"}') >= 1
    assert metric(text, "h3serve_adapter_switch_seconds_count") >= 2  # both's render and plain's
    assert metric(text, "h3serve_adapter_reads_total") >= 1  # both's: the cache holds one, so one is read again
