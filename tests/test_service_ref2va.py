"""Ref2VA over HTTP: the real server (tiny CPU model, loopback, nothing mocked) with the Ref2VA DiT loaded.

Reference files come as repeated `input_references` uploads in request order (or a JSON list of base64 / data:
URLs) with `extra_params.task=ref2va`; `extra_params.mute_references` drops video references' soundtracks. Renders
are probed with the output contract's `verify_mp4`; refusals must name the API field (`input_references[i]` for one
file), and a server started without the DiT a task needs must say how to start one that has it.

Three servers: "both" DiTs (the renders and most refusals), FL2VA only and Ref2VA only (one refusal each; no warmup).
"""

from __future__ import annotations

import base64
import io
import json
import math
import wave

import numpy as np
import pytest

from h3serve.accel.profile import Profile
from h3serve.media.mp4 import encode_mp4, verify_mp4
from h3serve.pipeline.engine import Engine
from service_fixtures import live_server, png_bytes, settings, tiny_engine, wait_status
from test_service_inputs import assert_error

BASE = {"prompt": "a red ball rolls past a ticking clock", "num_inference_steps": "2", "seed": "7"}
SMALL = {**BASE, "width": "64", "height": "64"}
REF2VA = json.dumps({"task": "ref2va"})
FRAMES = 22  # the tiny model's default length


def extra(**values) -> str:
    return json.dumps({"task": "ref2va", **values})


def wav_bytes(seconds: float = 0.5, rate: int = 16000) -> bytes:
    t = np.arange(round(seconds * rate)) / rate
    pcm = (0.4 * np.sin(2 * np.pi * 440 * t) * 32767).round().astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buffer.getvalue()


def mp4_bytes(num_frames: int = 24, width: int = 64, height: int = 36) -> bytes:
    """A short clip with a stereo soundtrack (H.264 + AAC, as tests/test_references.py builds them)."""
    t = np.arange(num_frames)[:, None, None, None]
    y, x = np.mgrid[0:height, 0:width]
    frames = ((x[None, :, :, None] * 4 + t * 10 + y[None, :, :, None] * 2 + np.arange(3) * 60) % 256).astype(np.uint8)
    n = math.ceil(num_frames / 24 * 32000)
    audio = np.stack([np.sin(np.arange(n) / 32000 * 2 * np.pi * f) * 0.3 for f in (300, 500)]).astype(np.float32)
    buffer = io.BytesIO()
    encode_mp4(buffer, frames, audio, fps=24, sample_rate=32000)
    return buffer.getvalue()


def part(data: bytes, name: str, mime: str, field: str = "input_references"):
    return (field, (name, data, mime))


def image(seed: int = 0, field: str = "input_references"):
    return part(png_bytes(96, 64, seed), f"ref{seed}.png", "image/png", field)


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def check_mp4(content: bytes, width: int = 64, height: int = 64) -> None:
    assert content[4:8] == b"ftyp"
    info = verify_mp4(io.BytesIO(content), width=width, height=height, num_frames=FRAMES)
    assert info.channels == 2


# ---- servers --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def both(tmp_path_factory):
    engine = Engine.load(None, Profile(), task_type="both")
    with live_server(settings(tmp_path_factory.mktemp("both")), engine) as srv:
        yield srv


@pytest.fixture
def client(both):
    with both.client() as c:
        yield c


# ---- renders --------------------------------------------------------------------------------------------------------
def test_the_tasks_served_are_shown(client):
    assert client.get("/health").json()["tasks"] == ["t2va", "i2va", "l2va", "fl2va", "ref2va"]
    (model,) = client.get("/v1/models").json()["data"]
    assert model["tasks"] == ["t2va", "i2va", "l2va", "fl2va", "ref2va"]


def test_two_image_references_render(client):
    r = client.post("/v1/videos/sync", data={**SMALL, "extra_params": REF2VA}, files=[image(0), image(1)])
    assert r.status_code == 200, r.text
    assert r.headers["x-num-frames"] == str(FRAMES)
    check_mp4(r.content)


def test_an_image_and_an_audio_reference_render_from_json(client):
    body = {
        **SMALL,
        "input_references": [data_url(png_bytes(96, 64), "image/png"), base64.b64encode(wav_bytes()).decode()],
        "extra_params": {"task": "ref2va"},
    }
    r = client.post("/v1/videos/sync", json=body)
    assert r.status_code == 200, r.text
    check_mp4(r.content)


def test_a_video_reference_with_sound_and_muted(client):
    clip = part(mp4_bytes(), "clip.mp4", "video/mp4")
    r = client.post("/v1/videos/sync", data={**SMALL, "extra_params": REF2VA}, files=[image(0), clip])
    assert r.status_code == 200, r.text
    check_mp4(r.content)
    muted = client.post(
        "/v1/videos/sync", data={**SMALL, "extra_params": extra(mute_references=[1])}, files=[image(0), clip]
    )
    assert muted.status_code == 200, muted.text
    check_mp4(muted.content)
    assert muted.content != r.content  # the soundtrack's rows are gone from the sequence: a different render


def test_an_async_job_with_references_completes_on_the_16_9_canvas(client):
    files = [image(2, "input_reference"), part(wav_bytes(), "tone.wav", "audio/wav", "input_reference")]
    r = client.post("/v1/videos", data={**BASE, "extra_params": REF2VA}, files=files)
    assert r.status_code == 200, r.text
    job = r.json()
    assert (job["task"], job["size"], job["num_frames"], job["status"]) == ("ref2va", "224x128", FRAMES, "queued")
    done = wait_status(client, job["id"], {"completed", "failed", "cancelled"}, timeout=120)
    assert done["status"] == "completed", done
    content = client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200
    check_mp4(content.content, 224, 128)


# ---- refusals -------------------------------------------------------------------------------------------------------
def test_audio_alone(client):
    files = [part(wav_bytes(), "tone.wav", "audio/wav")]
    r = client.post("/v1/videos", data={**SMALL, "extra_params": REF2VA}, files=files)
    assert_error(r, 400, "input_references[0]", "audio cannot be the only reference")


def test_ten_images(client):
    r = client.post("/v1/videos", data={**SMALL, "extra_params": REF2VA}, files=[image(i) for i in range(10)])
    assert_error(r, 400, "input_references[9]", "at most 9 image references", "got 10")


def test_a_file_that_is_not_media_is_named_by_position(client):
    files = [image(0), image(1), part(b"just some notes", "notes.txt", "text/plain")]
    r = client.post("/v1/videos", data={**SMALL, "extra_params": REF2VA}, files=files)
    error = assert_error(r, 400, "input_references[2]", "notes.txt", "could not be decoded")
    assert error["message"].startswith("input_references[2] (notes.txt)"), error


def test_the_same_refusal_from_json(client):
    body = {**SMALL, "input_references": [data_url(png_bytes(), "image/png"), "bm90IG1lZGlh"]}
    r = client.post("/v1/videos", json={**body, "extra_params": {"task": "ref2va"}})
    assert_error(r, 400, "input_references[1]", "could not be decoded")


def test_mute_references_pointing_at_an_image(client):
    clip = part(mp4_bytes(), "clip.mp4", "video/mp4")
    r = client.post("/v1/videos", data={**SMALL, "extra_params": extra(mute_references=[0])}, files=[image(0), clip])
    assert_error(r, 400, "extra_params.mute_references", "input_references[0]", "not a video reference")


@pytest.mark.parametrize(
    ("mute", "mentions"),
    [([2], ["position 2", "0..1"]), ([1, 1], ["twice"]), ("1", ["list of integer"]), ([True], ["list of integer"])],
    ids=["out-of-range", "repeated", "not-a-list", "bool"],
)
def test_bad_mute_references(client, mute, mentions):
    clip = part(mp4_bytes(), "clip.mp4", "video/mp4")
    r = client.post("/v1/videos", data={**SMALL, "extra_params": extra(mute_references=mute)}, files=[image(0), clip])
    assert_error(r, 400, "extra_params.mute_references", *mentions)


def test_mute_references_without_ref2va(client):
    r = client.post("/v1/videos", data={**SMALL, "extra_params": json.dumps({"mute_references": [0]})})
    assert_error(r, 400, "extra_params.mute_references", "ref2va")


def test_frame_indices_with_ref2va(client):
    r = client.post(
        "/v1/videos", data={**SMALL, "extra_params": extra(frame_indices=[0, -1])}, files=[image(0), image(1)]
    )
    assert_error(r, 400, "extra_params.frame_indices", "ref2va")


def test_ref2va_without_references(client):
    r = client.post("/v1/videos", data={**SMALL, "extra_params": REF2VA})
    assert_error(r, 400, "input_references", "at least one reference")


def test_mixing_the_two_file_fields(client):
    files = [image(0, "input_reference"), image(1, "input_references")]
    r = client.post("/v1/videos", data={**SMALL, "extra_params": REF2VA}, files=files)
    assert_error(r, 400, "input_references", "input_reference", "one field name")


def test_files_without_the_task_are_still_keyframes(client):
    r = client.post("/v1/videos", data=SMALL, files=[image(i) for i in range(3)])
    assert_error(r, 400, "input_references", "at most 2 keyframes", "extra_params.task to ref2va")


# ---- servers without one of the DiTs --------------------------------------------------------------------------------
def test_ref2va_on_an_fl2va_only_server(tmp_path):
    s = settings(tmp_path, startup_warmup=False)
    with live_server(s, tiny_engine()) as srv, srv.client() as c:
        assert c.get("/health").json()["tasks"] == ["t2va", "i2va", "l2va", "fl2va"]
        r = c.post("/v1/videos", data={**SMALL, "extra_params": REF2VA}, files=[image(0)])
        assert_error(r, 400, "extra_params.task", "Ref2VA DiT", "H3_TASK_TYPE", "ref2va or both")


def test_base_tasks_on_a_ref2va_only_server(tmp_path):
    s = settings(tmp_path, startup_warmup=False)
    with live_server(s, Engine.load(None, Profile(), task_type="ref2va")) as srv, srv.client() as c:
        assert c.get("/v1/models").json()["data"][0]["tasks"] == ["ref2va"]
        r = c.post("/v1/videos", data={**SMALL, "extra_params": json.dumps({"task": "t2va"})})
        assert_error(r, 400, "extra_params.task", "FL2VA DiT", "H3_TASK_TYPE", "fl2va or both")
        # Files without extra_params.task are keyframes (i2va here): the refusal says how to send references.
        r = c.post("/v1/videos", data=SMALL, files=[image(0)])
        assert_error(r, 400, "extra_params.task", "FL2VA DiT", "set extra_params.task to ref2va")
        # And ref2va itself renders.
        r = c.post("/v1/videos/sync", data={**SMALL, "extra_params": REF2VA}, files=[image(0)])
        assert r.status_code == 200, r.text
        check_mp4(r.content)
