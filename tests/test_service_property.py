"""Generated requests against the real server on loopback (hypothesis): JSON and multipart bodies for both render
routes, from fields that are right, wrong, null, of the wrong type, huge, cut short or not text. Whatever comes,
the server never answers 5xx and never hangs; every 4xx has the error shape with a message naming the problem; and a
valid request afterwards still renders.

The runs are derandomized (the same examples every run, so CI is repeatable) and bounded: 3,000 requests in
all. Valid requests are kept cheap (2-3 grid points at the tiny model's small canvas) so that the few that pass
validation render quickly."""

from __future__ import annotations

import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from h3serve.service.schemas import EXTRA_PARAMS, FIELDS, NOT_USED
from service_fixtures import live_server, png_bytes, settings

EXAMPLES = 750  # per test: 4 tests, 3,000 requests
ROUTES = ("/v1/videos", "/v1/videos/sync")
BOUNDARY = "hyp0thesis"
PLAUSIBLE = {
    "prompt": ["a red ball", "一只猫", "", " ", "x" * 300],
    "width": ["224", 224, "256", "100", "0", "-32", 224.0, "2e3"],
    "height": ["128", 128, "160", "31", "99999999999999999999999"],
    "num_inference_steps": ["2", 3, "1", "1001", "2.5", 2.0],
    "num_frames": ["22", 22, "23", "0", "400"],
    "seconds": ["1", 0.9, "nan", "inf", "-1", "1e308"],
    "size": ["224x128", "256x256", "abc", "0x0", "224X128"],
    "seed": ["1", 7, "-1", "9223372036854775808", "1" * 300],
    "aspect_ratio": ["16:9", "1:1", "5:4", ""],
    "fps": ["24", 24, "25"],
    "flow_shift": ["12", 3.0, "0", "inf"],
    "quality": ["lossless", "high", "ultra"],
    "model": ["h3serve-tiny", "other"],
    "user": ["u1", "u" * 300],
    "extra_params": [
        {"task": "t2va"},
        {"task": "i2va"},
        {"task": "ref2va"},
        {"duration": 0.9},
        {"frame_indices": [0, -1]},
        {"mute_references": [0]},
        {"audio_flow_shift": "x"},
        {"unknown": 1},
        "{not json",
        [1, 2],
    ],
}
NAMES = [*FIELDS, *NOT_USED, "extra", "Prompt", "\ud800", "é"]
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc80\ud800"])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**30, max_value=10**60),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    SURROGATES,
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from([*EXTRA_PARAMS, "x"]), inner, max_size=3), max_leaves=6)  # fmt: skip


@st.composite
def fields(draw) -> dict:
    """A request's fields: mostly plausible values of real fields, some anything under any name."""
    out = {}
    if draw(st.booleans()) or draw(st.booleans()):
        out["prompt"] = draw(st.sampled_from(PLAUSIBLE["prompt"]) | st.text(max_size=30))
    out["num_inference_steps"] = draw(st.sampled_from(PLAUSIBLE["num_inference_steps"]))
    for name in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=4, unique=True)):
        out[name] = draw(st.sampled_from(PLAUSIBLE[name]) | VALUES)
    for name in draw(st.lists(st.sampled_from(NAMES) | st.text(max_size=6), max_size=2, unique=True)):
        out[name] = draw(VALUES)
    return out


def _json_body(draw_fields: dict, files: list[bytes]) -> bytes:
    body = dict(draw_fields)
    if files:
        import base64

        body["input_references" if len(files) > 1 else "input_reference"] = [
            base64.b64encode(f).decode() for f in files
        ]
    return json.dumps(body, ensure_ascii=True).encode()  # lone surrogates as \\udXXX escapes


def _text(value) -> bytes:
    if isinstance(value, bytes):
        return value
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")  # a surrogate goes out as the invalid UTF-8 a careless client sends


def _multipart(draw_fields: dict, files: list[bytes], cut: int | None) -> bytes:
    out = bytearray()
    for name, value in draw_fields.items():
        if value is None:
            continue
        out += f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode("utf-8", "surrogatepass")
        out += _text(value) + b"\r\n"
    for data in files:
        out += (
            (
                f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="input_reference"; filename="k.png"\r\n\r\n'
            ).encode()
            + data
            + b"\r\n"
        )
    out += f"--{BOUNDARY}--\r\n".encode()
    return bytes(out[:cut]) if cut is not None else bytes(out)


FILES = st.lists(st.sampled_from([png_bytes(224, 128), png_bytes(96, 64, seed=1), b"\x89PNG\r\n\x1a\n", b"GIF89a"])
                 | st.binary(min_size=1, max_size=64), max_size=3)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(settings(tmp_path_factory.mktemp("property"), max_queue=4, body_timeout=10)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with server.client(timeout=60) as c:  # one connection pool for every example
        yield c


def _check(response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400 and response.status_code != 499:
        error = response.json()["error"]
        assert set(error) == {"code", "message", "param"}, error
        assert len(error["message"]) >= 10, error
        assert "object at 0x" not in error["message"] and "Traceback" not in error["message"], error
        assert len(error["message"]) < 2000, error


PROPERTY = hsettings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("route", ROUTES)
@PROPERTY
@given(body=fields(), files=FILES)
def test_generated_json_requests_never_5xx(client, route, body, files):
    _check(client.post(route, content=_json_body(body, files), headers={"content-type": "application/json"}))


@pytest.mark.parametrize("route", ROUTES)
@PROPERTY
@given(body=fields(), files=FILES, cut=st.none() | st.integers(min_value=0, max_value=400))
def test_generated_multipart_requests_never_5xx(client, route, body, files, cut):
    headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    _check(client.post(route, content=_multipart(body, files, cut), headers=headers))


def test_a_valid_request_still_renders_after_the_generated_ones(client):
    # Runs after the property tests in this module (pytest keeps file order).
    r = client.post("/v1/videos/sync", data={"prompt": "still fine", "num_inference_steps": "2", "seed": "3"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "video/mp4" and len(r.content) > 1000
