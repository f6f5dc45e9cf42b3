"""The real HTTP server (tiny CPU model, loopback, nothing mocked) fed bad and edge-case requests.

Every refusal must be `{"error": {"code", "message", "param"}}` with the right status, `param` naming the API field
at fault and the message naming it too (and the allowed values where the server knows them). The edge cases that
are accepted are rendered and their MP4s probed, and a bad request must never disturb the jobs already queued.

Two servers: one with the default settings for most tests, and one with tight limits (50-character prompts, 1 MiB
uploads, a 2 s sync timeout) for the tests of those limits.
"""

from __future__ import annotations

import base64
import io
import json
import select
import socket
import time

import pytest

from h3serve.media.mp4 import probe_mp4
from h3serve.service.bodies import BodyLimits
from service_fixtures import live_server, png_bytes, settings, wait_status

BASE = {"prompt": "a red ball bounces on a wooden floor", "num_inference_steps": "2"}
SMALL = {**BASE, "width": "64", "height": "64"}  # the quickest successful render
DONE = {"completed", "failed", "cancelled"}
TIGHT_PROMPT_CHARS = 50
TIGHT_UPLOAD_MB = 1
# The sync timeout of the tight server. The timeout test holds its render until the server cancels it, so no render's
# speed decides the outcome; 2 s keeps it quick.
TIGHT_SYNC_TIMEOUT = 2


# ---- servers and helpers --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(settings(tmp_path_factory.mktemp("default_server"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    s = settings(
        tmp_path_factory.mktemp("tight_server"), max_prompt_chars=TIGHT_PROMPT_CHARS, max_upload_mb=TIGHT_UPLOAD_MB
    )
    # The settings bound H3_VIDEO_SYNC_TIMEOUT to 600..14400 s; a test may go below that.
    s = s.model_copy(update={"video_sync_timeout": TIGHT_SYNC_TIMEOUT})
    with live_server(s) as srv:
        yield srv


@pytest.fixture
def client(server):
    # A client per test: a 500 makes uvicorn drop the keep-alive connection, which must not spill into the next test.
    with server.client() as c:
        yield c


def assert_error(
    response, status: int, param: str | None, *mentions: str, code: str = "invalid_request", names: str | None = None
) -> dict:
    """The response is the API's error shape with this status, code and param; the message names the param (by
    `names`, else its last dotted part, e.g. `task` of `extra_params.task`) and contains every one of `mentions`."""
    if response.status_code >= 500:
        # After a 500 the server thread logs the traceback; on Python 3.11 formatting a traceback parses source with
        # `ast`, whose recursion counter is not thread-safe, and pytest formatting this failure at the same moment can
        # die with "SystemError: AST constructor recursion depth mismatch". Let the server finish logging first.
        time.sleep(0.5)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"code", "message", "param"}, body
    assert error["code"] == code, body
    assert error["param"] == param, body
    assert isinstance(error["message"], str) and error["message"], body
    if param is not None:
        name = names or param.rsplit(".", 1)[-1]
        assert name in error["message"], f"the message does not name {param} ({name!r}): {body}"
    for text in mentions:
        assert text in error["message"], f"{text!r} not in the message: {body}"
    return error


def extra(**values) -> str:
    return json.dumps(values)


def png_file(name: str = "input_reference", seed: int = 0, width: int = 96, height: int = 64):
    return (name, (f"key{seed}.png", png_bytes(width, height, seed), "image/png"))


def completed(client, job: dict) -> dict:
    """Wait for an async job to finish; it must have completed."""
    final = wait_status(client, job["id"], DONE)
    assert final["status"] == "completed", final
    return final


def content_info(client, job_id: str):
    response = client.get(f"/v1/videos/{job_id}/content")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "video/mp4"
    assert response.content[4:8] == b"ftyp"
    return probe_mp4(io.BytesIO(response.content))


# ---- bad bodies -----------------------------------------------------------------------------------------------------
def test_malformed_json_body(client):
    r = client.post("/v1/videos", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, None, "not valid JSON")


@pytest.mark.parametrize("body", [b"[1, 2]", b'"a prompt"', b"null"])
def test_json_body_that_is_not_an_object(client, body):
    r = client.post("/v1/videos", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, None, "must be an object")


def test_json_number_too_long_to_parse(client):
    """Python refuses to convert integers over 4300 digits; that is a bad field (400, named), not a server error, and
    the digits are counted, not echoed (nor Python's int_max_str_digits hint)."""
    body = b'{"prompt": "a red ball", "seed": ' + b"1" * 5000 + b"}"
    r = client.post("/v1/videos", content=body, headers={"content-type": "application/json"})
    message = assert_error(r, 400, "seed", "5000 digits")["message"]
    assert "111111" not in message and "int_max_str_digits" not in message


def test_json_nested_too_deep_to_parse(client):
    """A deeply nested body makes the JSON parser recurse past Python's limit; that is a bad body (400) too."""
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post("/v1/videos", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, None)


def test_unsupported_content_type(client):
    r = client.post("/v1/videos", content=b"prompt=a red ball", headers={"content-type": "text/plain"})
    assert_error(r, 415, None, "text/plain", "multipart/form-data", "application/json", code="unsupported_media_type")


def test_multipart_without_boundary(client):
    r = client.post("/v1/videos", content=b"--x\r\nbad", headers={"content-type": "multipart/form-data"})
    assert_error(r, 400, None, "form")


def test_field_given_twice(client):
    r = client.post("/v1/videos", data={**BASE, "seed": ["1", "2"]})
    assert_error(r, 400, "seed", "more than once")


def test_text_field_sent_as_a_file(client):
    r = client.post("/v1/videos", data=BASE, files={"seed": ("seed.txt", b"1", "text/plain")})
    assert_error(r, 400, "seed", "text field")


def test_keyframe_sent_as_a_text_field(client):
    r = client.post("/v1/videos", data={**BASE, "input_reference": "not a file"})
    assert_error(r, 400, "input_reference", "uploaded file")


# ---- one bad field at a time (multipart form, async endpoint: nothing is rendered when refused) -----------------
BAD_FIELDS = [
    # extra_params
    pytest.param({"extra_params": "{not json"}, "extra_params", ["JSON"], id="extra_params-not-json"),
    pytest.param({"extra_params": "[1, 2]"}, "extra_params", ["JSON object", "an array of 2"], id="extra_params-list"),
    pytest.param(
        {"extra_params": extra(task="t2va", foo=1)},
        "extra_params.foo",
        ["extra_params.foo", "task, duration, audio_flow_shift, frame_indices"],
        id="extra_params-unknown-key",
    ),
    pytest.param(
        {"extra_params": extra(task="x2va")},
        "extra_params.task",
        ["x2va", "t2va, i2va, l2va, fl2va, ref2va"],
        id="task-unknown",
    ),
    pytest.param(
        {"extra_params": extra(task="ref2va")}, "extra_params.task", ["Ref2VA DiT", "H3_TASK_TYPE"], id="task-ref2va"
    ),
    pytest.param({"extra_params": extra(task=["t2va"])}, "extra_params.task", ["t2va, i2va"], id="task-list"),
    pytest.param(
        {"extra_params": extra(audio_flow_shift=-1)},
        "extra_params.audio_flow_shift",
        ["> 0"],
        id="audio_flow_shift-negative",
    ),
    pytest.param(
        {"extra_params": extra(frame_indices=[0])},
        "extra_params.frame_indices",
        ["keyframes"],
        id="frame_indices-without-keyframes",
    ),
    # canvas
    pytest.param({"width": "100", "height": "128"}, "width", ["multiple of 32", "100"], id="width-off-grid"),
    pytest.param({"width": "224", "height": "100"}, "height", ["multiple of 32", "100"], id="height-off-grid"),
    pytest.param({"size": "100x128"}, "size", ["multiple of 32", "100"], id="size-off-grid"),
    pytest.param({"size": "abc"}, "size", ["WIDTHxHEIGHT", '"abc"'], id="size-not-WxH"),
    pytest.param({"size": "0x0"}, "size", ["multiple of 32"], id="size-zero"),
    pytest.param({"size": "224x128", "width": "256"}, "size", ["disagrees"], id="size-disagrees-with-width"),
    pytest.param({"width": "224"}, "width", ["height", "together"], id="width-without-height"),
    pytest.param({"width": "abc", "height": "128"}, "width", ["integer"], id="width-not-integer"),
    pytest.param(
        {"width": "640", "height": "640"}, "width", ["640x640", "area cap", str(512 * 512)], id="width-over-area-cap"
    ),
    pytest.param({"size": "640x640"}, "size", ["640x640", "area cap"], id="size-over-area-cap"),
    pytest.param({"width": "1024", "height": "32"}, "width", ["aspect ratio"], id="aspect-over-4"),
    pytest.param(
        {"aspect_ratio": "5:4"}, "aspect_ratio", ['"5:4"', "21:9, 16:9, 4:3, 1:1, 3:4, 9:16"], id="aspect_ratio-unknown"
    ),
    pytest.param({"short_edge": "256"}, "short_edge", ["128", "256"], id="short_edge-not-the-models"),
    pytest.param({"short_edge": "abc"}, "short_edge", ["integer"], id="short_edge-not-integer"),
    # steps
    pytest.param({"num_inference_steps": "1"}, "num_inference_steps", ["2..1000", "got 1"], id="steps-too-few"),
    pytest.param({"num_inference_steps": "1001"}, "num_inference_steps", ["2..1000", "got 1001"], id="steps-too-many"),
    pytest.param({"num_inference_steps": "abc"}, "num_inference_steps", ["integer", '"abc"'], id="steps-not-integer"),
    pytest.param({"num_inference_steps": "2.5"}, "num_inference_steps", ["integer"], id="steps-fraction"),
    # length
    pytest.param({"num_frames": "400"}, "num_frames", ["22..362", "400"], id="num_frames-too-many"),
    pytest.param({"num_frames": "0"}, "num_frames", ["22"], id="num_frames-zero"),
    pytest.param({"num_frames": "abc"}, "num_frames", ["integer"], id="num_frames-not-integer"),
    pytest.param({"seconds": "100"}, "seconds", ["22..362"], id="seconds-too-long"),
    pytest.param({"seconds": "0"}, "seconds", ["> 0"], id="seconds-zero"),
    pytest.param({"seconds": "abc"}, "seconds", ["number"], id="seconds-not-number"),
    pytest.param({"seconds": "nan"}, "seconds", ["finite"], id="seconds-nan"),
    pytest.param({"seconds": "1e308"}, "seconds", [], id="seconds-overflows-frame-count"),
    pytest.param({"extra_params": extra(duration=100)}, "extra_params.duration", ["22..362"], id="duration-too-long"),
    pytest.param(
        {"num_frames": "44", "seconds": "2"},
        "seconds",
        ["one of num_frames, seconds, extra_params.duration"],
        id="num_frames-and-seconds",
    ),
    pytest.param(
        {"num_frames": "44", "extra_params": extra(duration=2)},
        "extra_params.duration",
        ["one of num_frames, seconds, extra_params.duration"],
        id="num_frames-and-duration",
    ),
    pytest.param(
        {"seconds": "2", "extra_params": extra(duration=2)},
        "extra_params.duration",
        ["one of num_frames, seconds, extra_params.duration"],
        id="seconds-and-duration",
    ),
    pytest.param({"fps": "25"}, "fps", ["24", "25"], id="fps-not-24"),
    # sampling
    pytest.param({"seed": "-1"}, "seed", ["0..", "-1"], id="seed-negative"),
    pytest.param({"seed": str(2**63)}, "seed", ["0..9223372036854775807"], id="seed-over-int64"),
    pytest.param({"seed": "abc"}, "seed", ["integer"], id="seed-not-integer"),
    pytest.param({"flow_shift": "-1"}, "flow_shift", ["> 0"], id="flow_shift-negative"),
    pytest.param({"flow_shift": "abc"}, "flow_shift", ["number"], id="flow_shift-not-number"),
    pytest.param({"flow_shift": "inf"}, "flow_shift", ["finite"], id="flow_shift-inf"),
    pytest.param({"quality": "ultra"}, "quality", ["lossless, high"], id="quality-unknown"),
    # fields refused by name
    pytest.param({"guidance_scale": "5"}, "guidance_scale", ["not accepted", "CFG-distilled"], id="guidance_scale"),
    pytest.param(
        {"negative_prompt": "blurry"}, "negative_prompt", ["not accepted", "negative branch"], id="negative_prompt"
    ),
    pytest.param(
        {"num_outputs_per_prompt": "2"},
        "num_outputs_per_prompt",
        ["one video per request"],
        id="num_outputs_per_prompt",
    ),
    pytest.param({"foo": "bar"}, "foo", ["unknown field", "prompt, model"], id="unknown-field"),
    # prompt
    pytest.param({"prompt": None}, "prompt", ["required"], id="prompt-missing"),
    pytest.param({"prompt": "   "}, "prompt", ["non-empty"], id="prompt-blank"),
]


@pytest.mark.parametrize(("fields", "param", "mentions"), BAD_FIELDS)
def test_bad_field_is_refused_by_name(server, client, fields, param, mentions):
    data = {k: v for k, v in {**BASE, **fields}.items() if v is not None}
    r = client.post("/v1/videos", data=data)
    assert_error(r, 400, param, *mentions)
    assert server.scheduler.depth == 0  # nothing was queued


def test_bad_field_on_the_sync_endpoint(server, client):
    """The sync endpoint maps requests the same way (and answers at once, rendering nothing)."""
    before = client.get("/metrics").text
    r = client.post("/v1/videos/sync", data={**BASE, "num_frames": "400"})
    assert_error(r, 400, "num_frames", "22..362")
    assert server.scheduler.depth == 0
    renders = lambda text: [line for line in text.splitlines() if line.startswith("h3serve_renders_total")]  # noqa: E731
    assert renders(client.get("/metrics").text) == renders(before)  # nothing was rendered


def test_unknown_model_is_404(client):
    r = client.post("/v1/videos", data={**BASE, "model": "other-model"})
    assert_error(r, 404, "model", '"other-model"', '"h3serve-tiny"', code="model_not_found")


# ---- JSON bodies: values of the wrong JSON type ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "param", "mentions"),
    [
        pytest.param({"num_frames": True}, "num_frames", ["integer"], id="bool-frames"),
        pytest.param({"num_inference_steps": 2.5}, "num_inference_steps", ["integer"], id="float-steps"),
        pytest.param({"prompt": ["a", "b"]}, "prompt", ["string"], id="list-prompt"),
        pytest.param({"extra_params": [1]}, "extra_params", ["JSON object"], id="list-extra_params"),
        pytest.param({"aspect_ratio": ["1:1"]}, "aspect_ratio", ["1:1"], id="list-aspect_ratio"),
        pytest.param({"quality": ["high"]}, "quality", ["lossless, high"], id="list-quality"),
        pytest.param({"width": 10**400, "height": 128}, "width", [], id="huge-width"),
        pytest.param({"seconds": 1e308}, "seconds", [], id="huge-seconds"),
        pytest.param({"input_reference": 5}, "input_reference", ["base64"], id="number-keyframe"),
    ],
)
def test_json_value_of_the_wrong_type(client, fields, param, mentions):
    r = client.post("/v1/videos", json={**BASE, "num_inference_steps": 2, **fields})
    assert_error(r, 400, param, *mentions)


# ---- keyframe uploads -----------------------------------------------------------------------------------------------
def test_upload_that_is_not_an_image(client):
    r = client.post("/v1/videos", data=BASE, files=[("input_reference", ("notes.txt", b"hello", "text/plain"))])
    assert_error(r, 400, "input_reference", "could not be decoded as an image")


def test_empty_upload(client):
    r = client.post("/v1/videos", data=BASE, files=[("input_reference", ("empty.png", b"", "image/png"))])
    assert_error(r, 400, "input_reference", "empty")


def test_three_keyframes_multipart(client):
    files = [png_file("input_references", seed=i) for i in range(3)]
    r = client.post("/v1/videos", data=BASE, files=files)
    assert_error(r, 400, "input_references", "2")


def test_three_keyframes_json(client):
    keyframe = base64.b64encode(png_bytes()).decode()
    r = client.post("/v1/videos", json={**BASE, "input_references": [keyframe] * 3})
    assert_error(r, 400, "input_references", "at most 2")


def test_t2va_with_a_keyframe(client):
    r = client.post("/v1/videos", data={**BASE, "extra_params": extra(task="t2va")}, files=[png_file()])
    assert_error(r, 400, "input_reference", "t2va")


def test_keyframe_task_without_a_keyframe(client):
    r = client.post("/v1/videos", data={**BASE, "extra_params": extra(task="i2va")})
    assert_error(r, 400, "input_reference", "i2va")


@pytest.mark.parametrize(
    ("indices", "files"),
    [([0, 0], 2), ([0, 1], 2), ([0], 2), ([0, -1], 1), ("first", 1)],
    ids=["duplicate", "not-0-or-minus-1", "too-few", "too-many", "not-a-list"],
)
def test_bad_frame_indices(client, indices, files):
    uploads = [png_file("input_references", seed=i) for i in range(files)]
    r = client.post("/v1/videos", data={**BASE, "extra_params": extra(frame_indices=indices)}, files=uploads)
    assert_error(r, 400, "extra_params.frame_indices", "frame_indices")


def test_task_disagrees_with_frame_indices(client):
    r = client.post(
        "/v1/videos", data={**BASE, "extra_params": extra(task="i2va", frame_indices=[-1])}, files=[png_file()]
    )
    assert_error(r, 400, "extra_params.frame_indices", "i2va", "[-1]")


def test_keyframe_of_extreme_aspect_without_a_canvas(client):
    r = client.post("/v1/videos", data=BASE, files=[png_file(width=200, height=10)])
    assert_error(r, 400, "input_reference", "width and height")


def test_invalid_base64_keyframe(client):
    r = client.post("/v1/videos", json={**BASE, "input_reference": "data:image/png;base64,!!!not base64!!!"})
    assert_error(r, 400, "input_reference", "base64")


@pytest.mark.parametrize(
    ("extra_params", "files", "task", "size"),
    [
        pytest.param(None, 1, "i2va", "192x128", id="i2va-by-default"),  # canvas from the 96x64 keyframe
        pytest.param(None, 2, "fl2va", "192x128", id="fl2va-by-default"),
        pytest.param(extra(frame_indices=[-1]), 1, "l2va", "192x128", id="l2va-by-index"),
        pytest.param(extra(frame_indices=[-1, 0]), 2, "fl2va", "192x128", id="fl2va-reversed"),
    ],
)
def test_keyframe_renders(client, extra_params, files, task, size):
    data = {**BASE, **({"extra_params": extra_params} if extra_params else {})}
    uploads = [png_file("input_references", seed=i) for i in range(files)]
    r = client.post("/v1/videos", data=data, files=uploads)
    assert r.status_code == 200, r.text
    job = r.json()
    assert (job["task"], job["size"], job["status"]) == (task, size, "queued")
    completed(client, job)
    info = content_info(client, job["id"])
    assert f"{info.width}x{info.height}" == size
    assert info.frame_count == job["num_frames"] == 22


def test_json_keyframe_as_data_url_renders(client):
    url = "data:image/png;base64," + base64.b64encode(png_bytes(64, 64, seed=3)).decode()
    body = {"prompt": "a red ball", "num_inference_steps": 2, "input_reference": url, "extra_params": {"task": "i2va"}}
    r = client.post("/v1/videos", json=body)
    assert r.status_code == 200, r.text
    job = r.json()
    assert (job["task"], job["size"]) == ("i2va", "128x128")  # the square keyframe gives the square canvas
    completed(client, job)
    info = content_info(client, job["id"])
    assert (info.width, info.height) == (128, 128)


# ---- accepted edge values -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "size"),
    [
        pytest.param({"aspect_ratio": "1:1"}, "128x128", id="1:1"),
        pytest.param({"aspect_ratio": "9:16"}, "128x224", id="9:16"),
        pytest.param({"aspect_ratio": "1:1", "short_edge": "128"}, "128x128", id="1:1-short_edge"),
        pytest.param({"aspect_ratio": "16:9", "width": "64", "height": "64"}, "64x64", id="width-height-win"),
        pytest.param({"size": "96x64"}, "96x64", id="size"),
        pytest.param({}, "224x128", id="default"),
    ],
)
def test_canvas_choice(client, fields, size):
    r = client.post("/v1/videos", data={**BASE, **fields})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["size"] == size
    completed(client, job)
    info = content_info(client, job["id"])
    assert f"{info.width}x{info.height}" == size


def test_num_frames_snaps_up_to_the_grid(client):
    r = client.post("/v1/videos/sync", data={**SMALL, "num_frames": "23"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "video/mp4"
    assert r.headers["x-num-frames"] == "39"  # 17n+5: 23 -> 39
    assert probe_mp4(io.BytesIO(r.content)).frame_count == 39


def test_seconds_and_duration_give_frames(client):
    r = client.post("/v1/videos", data={**SMALL, "seconds": "1"})  # 24 frames -> 39
    assert r.status_code == 200, r.text
    assert r.json()["num_frames"] == 39
    completed(client, r.json())
    r = client.post("/v1/videos", data={**SMALL, "extra_params": extra(duration=0.5)})  # 12 frames -> 22
    assert r.status_code == 200, r.text
    assert r.json()["num_frames"] == 22
    completed(client, r.json())


def test_served_model_id_is_accepted(client):
    r = client.post("/v1/videos/sync", data={**SMALL, "model": "h3serve-tiny", "fps": "24", "seed": "7"})
    assert r.status_code == 200, r.text
    assert r.headers["x-seed"] == "7"
    info = probe_mp4(io.BytesIO(r.content))
    assert (info.width, info.height, info.frame_count) == (64, 64, 22)


# ---- job routes -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/videos/video_gen_deadbeef"),
        ("GET", "/v1/videos/video_gen_deadbeef/content"),
        ("DELETE", "/v1/videos/video_gen_deadbeef"),
    ],
)
def test_unknown_job_id(client, method, path):
    r = client.request(method, path)
    assert_error(r, 404, "video_id", code="not_found", names="video_gen_deadbeef")  # a path parameter: its value


@pytest.mark.parametrize(
    ("query", "param", "mentions"),
    [
        ("limit=0", "limit", ["1..100", "0"]),
        ("limit=101", "limit", ["1..100", "101"]),
        ("limit=abc", "limit", []),
        ("after=video_gen_nope", "after", ["video_gen_nope"]),
    ],
    ids=["limit-0", "limit-101", "limit-not-integer", "after-unknown"],
)
def test_bad_list_query(client, query, param, mentions):
    r = client.get(f"/v1/videos?{query}")
    assert_error(r, 400, param, *mentions)


def test_content_of_an_unfinished_job_is_409(server, client):
    r = client.post("/v1/videos", data={**BASE, "num_inference_steps": "600"})
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    state = wait_status(client, job_id, {"queued", "in_progress"})["status"]
    r = client.get(f"/v1/videos/{job_id}/content")
    error = assert_error(r, 409, None, job_id, code="not_completed")
    assert "queued" in error["message"] or "in_progress" in error["message"], (state, error)

    r = client.delete(f"/v1/videos/{job_id}")  # cancel, so the test stays short
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled"
    assert r.json()["error"]["code"] == "cancelled"
    assert_error(client.get(f"/v1/videos/{job_id}/content"), 409, None, "cancelled", code="not_completed")
    assert server.scheduler.depth == 0

    r = client.delete(f"/v1/videos/{job_id}")  # a finished job: deleted
    assert r.json() == {"id": job_id, "object": "video.deleted", "deleted": True}
    assert_error(client.get(f"/v1/videos/{job_id}"), 404, "video_id", code="not_found", names=job_id)


def test_nothing_lost_on_bad_input(server, client):
    r = client.post("/v1/videos", data={**BASE, "num_inference_steps": "4", "seed": "3"})
    assert r.status_code == 200, r.text
    job = r.json()
    bad = [
        client.post("/v1/videos", content=b"{not json", headers={"content-type": "application/json"}),
        client.post("/v1/videos", content=b"x", headers={"content-type": "text/plain"}),
        client.post("/v1/videos", data={**BASE, "num_frames": "400"}),
        client.post("/v1/videos", data={**BASE, "guidance_scale": "5"}),
        client.post("/v1/videos", data={**BASE, "model": "other-model"}),
        client.post("/v1/videos/sync", data={**BASE, "size": "100x128"}),
        client.post("/v1/videos", data=BASE, files=[("input_reference", ("x.txt", b"hello", "text/plain"))]),
        client.get("/v1/videos/video_gen_deadbeef/content"),
        client.delete("/v1/videos/video_gen_deadbeef"),
    ]
    assert [b.status_code for b in bad] == [400, 415, 400, 400, 404, 400, 400, 404, 404]
    final = completed(client, job)
    assert (final["num_inference_steps"], final["seed"], final["progress"]) == (4, 3, 100)
    info = content_info(client, job["id"])
    assert (info.width, info.height, info.frame_count) == (224, 128, 22)
    assert server.scheduler.depth == 0
    listed = client.get("/v1/videos", params={"limit": 100}).json()["data"]
    assert job["id"] in [j["id"] for j in listed]


# ---- the tight server: prompt cap, upload cap, sync timeout ---------------------------------------------------------
def test_prompt_over_the_cap(tight):
    with tight.client() as c:
        r = c.post("/v1/videos", data={**BASE, "prompt": "x" * (TIGHT_PROMPT_CHARS + 1)})
        assert_error(r, 400, "prompt", f"limit is {TIGHT_PROMPT_CHARS}", str(TIGHT_PROMPT_CHARS + 1))
        # The cap counts characters, not bytes: 50 two-byte characters are accepted.
        r = c.post("/v1/videos", data={**SMALL, "prompt": "é" * TIGHT_PROMPT_CHARS})
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == "é" * TIGHT_PROMPT_CHARS
        completed(c, r.json())


def test_upload_over_the_cap(tight):
    big = bytes(int(1.5 * (1 << 20)))
    with tight.client() as c:
        r = c.post("/v1/videos", data=BASE, files=[("input_reference", ("big.png", big, "image/png"))])
        assert_error(r, 413, "input_reference", f"{TIGHT_UPLOAD_MB} MiB", code="too_large")
        r = c.post("/v1/videos", json={**BASE, "input_reference": base64.b64encode(big).decode()})
        assert_error(r, 413, "input_reference", f"{TIGHT_UPLOAD_MB} MiB", code="too_large")


def test_body_over_the_cap(tight):
    cap = BodyLimits(TIGHT_UPLOAD_MB << 20, max_files=2, timeout=60).body_cap  # two keyframes (base64) and the fields
    assert cap > 2 * (TIGHT_UPLOAD_MB << 20)
    body = json.dumps({**BASE, "user": "u" * (cap + 1)}).encode()
    with tight.client() as c:
        r = c.post("/v1/videos", content=body, headers={"content-type": "application/json"})
        assert_error(r, 413, None, str(cap), code="too_large")
        # Under the body cap, one field over the field cap is a 413 naming the field.
        r = c.post("/v1/videos", json={**BASE, "user": "u" * ((1 << 20) + 1)})
        assert_error(r, 413, "user", code="too_large")


def test_sync_timeout_cancels_the_render(tight, monkeypatch):
    """A render still running at the sync timeout is answered 504 and cancelled. The first render is held until its
    cancel flag is set (then it runs, and stops at its first cancellation point), so it outlasts the timeout however
    fast the machine; the order of events says the cancel reached it before the next render started."""
    engine = tight.scheduler.engine
    render = engine.render
    events: list[str] = []

    def held_render(request, ctx=None, on_step=None):
        if request.steps == 800:  # the request under test; the others render as they come
            held = time.monotonic() + 120  # a bound on a broken server only: the cancel comes after 2 s
            while not ctx.cancelled and time.monotonic() < held:
                time.sleep(0.01)
            events.append(f"held render: cancelled={ctx.cancelled} ({ctx.reason})")
        else:
            events.append("next render")
        return render(request, ctx, on_step)

    monkeypatch.setattr(engine, "render", held_render)
    with tight.client() as c:
        start = time.monotonic()
        r = c.post("/v1/videos/sync", data={**BASE, "num_inference_steps": "800"})
        took = time.monotonic() - start
        assert_error(r, 504, None, f"H3_VIDEO_SYNC_TIMEOUT={TIGHT_SYNC_TIMEOUT}", code="timeout")
        assert took >= TIGHT_SYNC_TIMEOUT, took  # not answered before the timeout (a busy machine only adds)

        # Had the timed-out render kept running, this one would wait behind it. Async: its own speed is not tested.
        job = c.post("/v1/videos", data=SMALL).json()
        assert wait_status(c, job["id"], DONE)["status"] == "completed"
        assert events == [
            f"held render: cancelled=True (the sync timeout of {TIGHT_SYNC_TIMEOUT} s passed)",
            "next render",
        ]
        assert probe_mp4(io.BytesIO(c.get(f"/v1/videos/{job['id']}/content").content)).frame_count == 22
        assert tight.scheduler.depth == 0
        health = c.get("/health").json()
        assert (health["ready"], health["queue_depth"]) == (True, 0)
        metrics = c.get("/metrics").text
        assert 'h3serve_renders_total{outcome="cancelled"} 1.0' in metrics, metrics


def test_a_chunked_body_without_content_length_is_capped_while_it_streams(tight):
    """No Content-Length to check up front: the server counts the bytes as they arrive and answers 413 at the cap,
    before the body has ended (a server that first read the whole body would still be waiting for the rest)."""
    cap = 2 * (TIGHT_UPLOAD_MB << 20) + (1 << 20)
    with socket.create_connection(("127.0.0.1", tight.port), timeout=10) as sock:
        head = b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b'{"prompt": "x", "user": "' + b"u" * (1 << 16)
        try:
            for _ in range(2 * cap // len(chunk)):  # twice the cap, and the body never ends
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                if select.select([sock], [], [], 0)[0]:
                    break  # the answer has come: stop sending
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while chunks were still in flight; the answer is already here
        answer = b""
        while b"}}" not in answer:  # the status line, the headers, then the JSON error body
            try:
                data = sock.recv(4096)
            except ConnectionResetError:
                data = b""
            assert data, f"the connection closed before a full answer: {answer!r}"
            answer += data
    head, _, body = answer.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413"), head
    assert json.loads(body)["error"]["code"] == "too_large"
