"""Internal errors over HTTP on loopback: the client gets the error shape with a generic message and a request id;
the exception, its text and its traceback go to the server log under that id, never into a response or a record."""

from __future__ import annotations

import logging
import re
import time

import torch

from h3serve.accel.profile import Profile
from h3serve.pipeline.engine import Engine
from service_fixtures import live_server, settings, wait_status

SECRET = "/home/operator/models/private-key.pem"  # what an exception's text may hold: paths, names, internals
REQUEST = {"prompt": "a failing render", "num_inference_steps": "2", "seed": "1"}


def request_id(message: str) -> str:
    match = re.search(r"see the server log, request id (\S+)$", message)
    assert match, f"the message does not say where to look: {message!r}"
    return match[1]


def logged(caplog, rid: str) -> str:
    """What the server logged about one request id: the messages and their tracebacks."""
    formatter = logging.Formatter()
    records = [r for r in caplog.records if rid in r.getMessage()]
    assert records, f"nothing logged under request id {rid}"
    return "\n".join(
        r.getMessage() + "\n" + (formatter.formatException(r.exc_info) if r.exc_info else "") for r in records
    )


def test_an_unhandled_error_is_a_generic_500_and_its_traceback_is_logged(tmp_path, caplog):
    def broken() -> None:
        raise RuntimeError(f"cannot open {SECRET}")

    with live_server(settings(tmp_path, startup_warmup=False), ready=False) as s, s.client() as c:
        s.app.add_api_route("/broken", broken)  # a route with a bug in it: the app's handler must answer for it
        r = c.get("/broken")
        time.sleep(0.5)  # let the server thread finish logging (see tests/test_service_inputs.py assert_error)
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(r.json()) == {"error"} and set(error) == {"code", "message", "param"}
    assert (error["code"], error["param"]) == ("internal_error", None)
    for leak in (SECRET, "RuntimeError", "Traceback", "broken"):
        assert leak not in r.text, r.text
    rid = request_id(error["message"])
    assert r.headers["x-request-id"] == rid
    log = logged(caplog, rid)
    assert SECRET in log and "Traceback" in log and "in broken" in log


def test_a_failed_render_is_a_generic_500_and_its_job_says_where_to_look(tmp_path, caplog):
    broken = Engine.load(None, Profile())
    with torch.no_grad():
        next(broken.components.dit.parameters()).fill_(float("nan"))  # every render fails: latents not finite
    with live_server(settings(tmp_path, startup_warmup=False), broken) as s, s.client() as c:
        r = c.post("/v1/videos/sync", data=REQUEST)
        time.sleep(0.5)
        job = c.post("/v1/videos", data=REQUEST).json()
        failed = wait_status(c, job["id"], {"failed", "completed"})
        listed = c.get("/v1/videos").json()["data"]

    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("render_failed", None)
    rid = request_id(error["message"])
    assert r.headers["x-request-id"] == rid and rid.startswith("video_gen_")
    assert failed["status"] == "failed" and failed["error"]["code"] == "render_failed", failed
    assert request_id(failed["error"]["message"]) == job["id"]
    for text in (r.text, str(failed), str(listed)):
        for leak in ("not finite", "RuntimeError", "Traceback"):
            assert leak not in text, text
    for logged_id in (rid, job["id"]):
        log = logged(caplog, logged_id)
        assert "the denoised latents are not finite" in log and "Traceback" in log
