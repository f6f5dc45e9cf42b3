"""Generated requests against the real server on loopback (hypothesis): JSON and multipart bodies for both render
routes, from fields that are right, wrong, null, of the wrong type, huge, cut short or not text. Whatever comes,
the server never answers 5xx and never hangs; every 4xx has the error shape with a message naming the problem; and a
valid request afterwards still renders.

The runs are derandomized (the same examples every run, so CI is repeatable) and bounded: 3,000 requests in
all. Valid requests are kept cheap (2-3 grid points at the tiny model's small canvas) so that the few that pass
validation render quickly."""

from __future__ import annotations

import dataclasses
import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from h3serve.config import FPS, TINY_DIT
from h3serve.pipeline.admission import Admission
from h3serve.pipeline.request import RequestFields
from h3serve.pipeline.rules import MAX_SEED, TINY_RULES
from h3serve.service.bodies import FILE_FIELDS
from h3serve.service.errors import ApiError
from h3serve.service.schemas import (
    EXTRA_PARAMS,
    FIELDS,
    NOT_USED,
    ExtraParams,
    PreviewRule,
    ServerTerms,
    VideoCreateRequest,
    admit,
)
from h3serve.vocab import Task
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


# ---- the request model, without a server: each field's bounds, the seed's range, the engine's fields ----------------

SERVED = "h3serve-tiny"
ADMISSION = Admission.build("both", TINY_RULES, TINY_DIT, step_cache=False)
TERMS = ServerTerms(SERVED, max_prompt=200, rules=TINY_RULES, steps=4, admission=ADMISSION, tasks=tuple(Task),
                    previews=PreviewRule(default=0, minimum=2))  # fmt: skip


class _Admitting:
    """What `admit` needs of an engine: its admission (the rules, no weights)."""

    def __init__(self) -> None:
        self.admission = ADMISSION

    def validate(self, fields: RequestFields):
        return self.admission.validate(fields)


ENGINE = _Admitting()
MAX_SIDE = 512 * 512 // 32 + 32  # a side over TINY_RULES' area cap, whatever the other side
FORM_OR_JSON = lambda values: st.sampled_from(values) | st.sampled_from(values).map(str)  # noqa: E731
# Values each API field refuses, by its type, its declared bounds or the model's rules (the engine's), sent as JSON
# values or as a form's text. The key is the field a refusal must name.
BAD = {
    "prompt": st.sampled_from(["", "   ", "x" * 201]) | st.integers(),
    "model": st.sampled_from(["other", "h3serve-tiny2"]),
    "seconds": FORM_OR_JSON([0, -1, 3601, 1e9, 20]) | st.sampled_from(["nan", "inf", "x", "1e400"]),
    "size": st.sampled_from(["abc", "0x0", "100x100", "64x", "x64", "99999x32", f"{MAX_SIDE}x{MAX_SIDE}"]),
    "user": st.text(min_size=257, max_size=300) | st.integers() | st.booleans(),
    "width": FORM_OR_JSON([0, -32, 33, 100, MAX_SIDE]) | st.sampled_from(["2.5", "x", "1" * 50, True]),
    "height": FORM_OR_JSON([0, -32, 31, 100, MAX_SIDE]) | st.sampled_from(["2.5", "x", "1" * 50, 1.5]),
    "num_frames": FORM_OR_JSON([0, -5, 363, 10**6]) | st.sampled_from(["2.5", "x", [22]]),
    "fps": FORM_OR_JSON([0, 25, 30, -24]) | st.sampled_from(["x", 24.5]),
    "num_inference_steps": FORM_OR_JSON([0, 1, -3, 1001]) | st.sampled_from(["2.5", "x", {}]),
    "flow_shift": FORM_OR_JSON([0, -1, 0.0]) | st.sampled_from(["inf", "nan", "x", []]),
    "seed": st.integers(max_value=-1) | st.integers(min_value=MAX_SEED + 1) | st.sampled_from(["-1", "x", "1.5"]),
    "aspect_ratio": st.sampled_from(["5:4", "", "16:10", "16x9"]) | st.integers(),
    "short_edge": FORM_OR_JSON([0, 768, 127, 129]) | st.sampled_from(["x"]),
    "quality": st.sampled_from(["ultra", "", "high"]) | st.integers(),  # high: this server has no step cache
    "lora": st.sampled_from([{"name": "x"}, "{}", "[]", {"path": ""}, {"scale": 1}, 5]),
    "lora_name": st.sampled_from(["x", "", "   "]) | st.integers(),  # this server declares no adapter
    "lora_strength": FORM_OR_JSON([0.5, 1]) | st.sampled_from(["x", "nan"]),  # without lora_name
    "preview_every": FORM_OR_JSON([-1, 1, 3, 100]) | st.sampled_from(["x", "1.5"]),  # 1: under this server's least
    "extra_params": st.sampled_from(["{not json", "[1]", [1], 5, "null"]),
    "extra_params.task": st.sampled_from(["t3va", "", "REF2VA", 5, []]),
    "extra_params.duration": FORM_OR_JSON([0, -1, 3601, 20]) | st.sampled_from(["nan", "x"]),
    "extra_params.audio_flow_shift": FORM_OR_JSON([0, -2]) | st.sampled_from(["inf", "x", True]),
    "extra_params.frame_indices": st.sampled_from([[0], [-1], [0, -1], "x", 5]),  # no keyframe sent
    "extra_params.mute_references": st.sampled_from([[0], [], "x", [True]]),  # not a ref2va request
}


def test_every_api_field_has_values_its_bounds_refuse():
    """A field added to the API without bounds checked here fails this test."""
    assert set(BAD) == (set(FIELDS) - set(FILE_FIELDS)) | {f"extra_params.{key}" for key in EXTRA_PARAMS}
    aliases = {f.alias or name for name, f in VideoCreateRequest.model_fields.items()}
    assert aliases == set(FIELDS) - set(FILE_FIELDS)
    assert {f.alias or name for name, f in ExtraParams.model_fields.items()} == set(EXTRA_PARAMS)


def _sent(field: str, value) -> dict:
    """A valid request but for `field` (a canvas side alone is told what is wrong with it before it is told to come
    in a pair)."""
    fields = {"prompt": "a fox", "num_inference_steps": 4}
    if field.startswith("extra_params."):
        return fields | {"extra_params": {field.removeprefix("extra_params."): value}}
    return fields | {field: value}


def _param_of(fields: dict) -> tuple[int, str]:
    try:
        admit(fields, [], ENGINE, TERMS)
    except ApiError as err:
        assert len(err.message) >= 10 and "Traceback" not in err.message, err.message
        return err.status, err.param
    raise AssertionError(f"accepted: {fields}")


@hsettings(PROPERTY, max_examples=300)
@given(case=st.sampled_from(sorted(BAD)).flatmap(lambda f: BAD[f].map(lambda v: (f, v))))
def test_each_field_out_of_its_bounds_is_refused_naming_it(case):
    field, value = case
    status, param = _param_of(_sent(field, value))
    assert (status, param) == ((404, "model") if field == "model" else (400, field)), (field, value)


def test_an_engine_refusal_names_the_field_that_set_the_value():
    """The engine names its own fields (width, num_frames, steps); the refusal names what the client sent."""
    assert _param_of({"prompt": "p", "size": "100x64"}) == (400, "size")
    assert _param_of({"prompt": "p", "width": 64, "height": 100}) == (400, "height")
    assert _param_of({"prompt": "p", "seconds": 20}) == (400, "seconds")
    assert _param_of({"prompt": "p", "extra_params": {"duration": 20}}) == (400, "extra_params.duration")
    assert _param_of({"prompt": "p", "num_frames": 400}) == (400, "num_frames")
    assert _param_of({"prompt": "p", "num_inference_steps": "1"}) == (400, "num_inference_steps")
    assert _param_of({"prompt": "p", "flow_shift": "0"}) == (400, "flow_shift")


@hsettings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    side=st.sampled_from([(64, 64), (96, 64), (64, 128), (224, 128)]),
    frames=st.integers(min_value=22, max_value=362),
    steps=st.integers(min_value=2, max_value=60),
    seed=st.integers(min_value=0, max_value=MAX_SEED),
    shifts=st.tuples(st.floats(0.5, 20), st.floats(0.5, 20)),
    quality=st.sampled_from(["lossless", None]),
    form=st.booleans(),
)
def test_the_model_round_trips_to_the_engine_fields(side, frames, steps, seed, shifts, quality, form):
    """What the API fields say reaches the engine's fields unchanged, from a JSON body or a form's text."""
    put = str if form else (lambda v: v)
    sent = {"prompt": "a fox", "size": f"{side[0]}x{side[1]}", "num_frames": put(frames),
            "num_inference_steps": put(steps), "seed": put(seed), "flow_shift": put(shifts[0]),
            "extra_params": json.dumps({"audio_flow_shift": shifts[1]}) if form else {"audio_flow_shift": shifts[1]},
            "fps": put(FPS), "preview_every": put(0)}  # fmt: skip
    if quality is not None:
        sent["quality"] = quality
    fields = VideoCreateRequest.parse(sent, TERMS).to_fields([], TERMS)
    expected = RequestFields(prompt="a fox", task=Task.T2VA, width=side[0], height=side[1], num_frames=frames,
                             steps=steps, seed=seed, video_shift=shifts[0], audio_shift=shifts[1], keyframes=[],
                             mute_references=[], quality=quality, preview_every=0)  # fmt: skip
    assert fields == expected
    request = ENGINE.validate(fields)
    assert (request.width, request.height, request.steps, request.seed) == (*side, steps, seed)
    assert (request.video_shift, request.audio_shift) == shifts


def test_left_out_fields_stay_for_the_server_to_fill():
    fields = VideoCreateRequest.parse({"prompt": "p"}, TERMS).to_fields([], TERMS)
    assert (fields.width, fields.height, fields.num_frames, fields.steps) == (None, None, None, None)
    assert (fields.video_shift, fields.audio_shift, fields.preview_every, fields.quality) == (None,) * 4


def test_a_seed_left_out_is_drawn_from_the_whole_documented_range():
    """0..MAX_SEED, as docs/api.md says: 64 draws all below 2**31 would happen once in 2**(32*64) tries."""
    seeds = [VideoCreateRequest.parse({"prompt": "p"}, TERMS).to_fields([], TERMS).seed for _ in range(64)]
    assert all(0 <= s <= MAX_SEED for s in seeds)
    assert max(seeds) >= 2**31 and len(set(seeds)) == 64


@pytest.mark.parametrize("drawn", [0, 2**31, MAX_SEED])
def test_the_drawn_seed_reaches_the_engine(drawn):
    terms = dataclasses.replace(TERMS, draw_seed=lambda: drawn)
    _, request = admit({"prompt": "p", "num_inference_steps": 3}, [], ENGINE, terms)
    assert request.seed == drawn
