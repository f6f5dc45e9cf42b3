"""The web page at / (docs/web.md). Without a browser: its files and headers, nothing private and nothing from
elsewhere, and what it reads from the API (the request limits, a running job's `live` stage). With one: the page in a
real headless Chromium (Debian's chromium and chromium-driver, driven by Selenium) against the real server on loopback
with the tiny model, from asking for the key to playing, downloading and cancelling renders.

The browser test saves a screenshot of each step under `H3TEST_ARTIFACTS/web/` (default: `artifacts/web/` in the
repository, git-ignored). It is skipped when the browser or its driver is missing, and fails instead under
H3TEST_REQUIRE_BROWSER=1, which CI sets (.ci/run installs both).
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
import tomllib
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

import pytest

from h3serve.config import CLIP_FRAMES, FPS, LATENTS_PER_CLIP
from h3serve.pipeline.preview import due
from h3serve.pipeline.rules import MAX_SEED, TINY_RULES
from h3serve.service.page import CSP, TYPES
from h3serve.settings import load_settings
from h3serve.vocab import seconds_to_frames, snap_up
from service_fixtures import live_server, settings, wait_status

ROOT = Path(__file__).resolve().parents[1]
WEB = Path(str(resources.files("h3serve") / "service" / "web"))
KEY = "w" * 16 + "0123456789abcdef-._~"
PRIVATE = "a private prompt about a lighthouse"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
LONG = "1000"  # steps: seconds of rendering on the tiny model, time to watch and to cancel
WAIT_S = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(settings(tmp_path_factory.mktemp("web"), api_key=KEY)) as s:
        yield s


# ---- without a browser ----------------------------------------------------------------------------------------------
def test_the_page_needs_no_key_and_shows_nothing_private(server):
    with server.client(KEY) as c:
        job = c.post("/v1/videos", data={"prompt": PRIVATE, "num_inference_steps": "2"}).json()
    with server.client() as anonymous:
        page = anonymous.get("/")
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert PRIVATE not in page.text and job["id"] not in page.text
        for name, kind in TYPES.items():
            r = anonymous.get(f"/web/{name}")
            assert r.status_code == 200 and r.headers["content-type"] == kind
            assert r.content == (WEB / name).read_bytes()
            assert r.headers["content-security-policy"] == CSP and r.headers["x-content-type-options"] == "nosniff"
        assert page.headers["content-security-policy"] == CSP and "default-src 'self'" in CSP
        assert page.headers["x-content-type-options"] == "nosniff"
        for name in ("nope.js", "..%2Fapp.py", "%2E%2E", "index.htm", "page.css.map"):
            missing = anonymous.get(f"/web/{name}")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found", name
        assert anonymous.get("/web/").status_code == 404
        assert anonymous.get("/", params={"key": KEY}).status_code == 400  # strict query, as every route
        assert anonymous.get("/v1/videos").status_code == 401  # the page adds no way in


def test_the_page_fetches_nothing_from_elsewhere():
    names = sorted(p.name for p in WEB.iterdir() if p.is_file())
    assert names == sorted(TYPES)
    for name in names:
        text = (WEB / name).read_text(encoding="utf-8")
        assert not re.search(r"https?:|wss?:|//[a-z0-9.-]+\.[a-z]{2,}/", text, flags=re.I), name
    html = (WEB / "index.html").read_text(encoding="utf-8")
    for target in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert target.startswith("/web/") or target == "data:,", target
    js = (WEB / "page.js").read_text(encoding="utf-8")
    for target in re.findall(r"call\(\"[A-Z]+\", [`\"]([^`\"]+)", js):
        assert target.startswith(("/v1/", "/health")), target


def test_the_page_is_packaged_and_left_out_of_the_schema(server):
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-data"]
    for name in TYPES:
        assert any(fnmatch.fnmatch(f"service/web/{name}", glob) for glob in data["h3serve"]), name
    with server.client(KEY) as c:
        paths = c.get("/openapi.json").json()["paths"]
    assert "/" not in paths and "/web/{name}" not in paths and "/v1/videos" in paths


def test_models_reports_the_limits_the_page_shows(server):
    with server.client(KEY) as c:
        limits = c.get("/v1/models").json()["data"][0]["limits"]
    canvas, frames = TINY_RULES.canvas, TINY_RULES.frames
    assert limits["size"]["multiple"] == canvas.multiple and limits["size"]["max_pixels"] == canvas.max_pixels
    assert limits["size"]["default"] == "224x128" and limits["size"]["aspect_ratios"]["9:16"] == "128x224"
    assert limits["frames"] == {"min": frames.min_frames, "max": frames.max_frames, "default": 22, "fps": FPS}
    assert limits["num_inference_steps"] == {"min": 2, "max": 1000, "default": 50}
    assert limits["seed"] == {"min": 0, "max": MAX_SEED}
    assert (limits["references"], limits["quality"], limits["keyframes"]) == (None, None, 2)  # FL2VA, no step cache


def test_a_running_job_says_its_stage_and_step(server):
    with server.client(KEY) as c:
        job = c.post("/v1/videos", data={"prompt": "watched", "num_inference_steps": LONG}).json()
        assert job["live"]["stage"] in ("queued", "starting", "text")
        deadline = time.monotonic() + WAIT_S
        while (live := c.get(f"/v1/videos/{job['id']}").json()["live"])["stage"] != "denoise" or not live["done"]:
            assert time.monotonic() < deadline, live
            time.sleep(0.02)
        assert live["total"] == int(LONG) - 1 and 0 < live["done"] < live["total"] and live["elapsed_s"] > 0
        listed = next(j for j in c.get("/v1/videos").json()["data"] if j["id"] == job["id"])
        assert listed["live"]["stage"] in ("denoise", "video", "audio", "encode")
        cancelled = c.delete(f"/v1/videos/{job['id']}").json()
        assert cancelled["status"] == "cancelled" and cancelled["live"] is None


def test_a_finished_record_shows_no_live_state_even_while_the_scheduler_holds_the_job():
    """The store marks a job completed before its future is set: a poll in between must not show it encoding."""
    from h3serve.service.app import shown_record
    from h3serve.service.schemas import JobStatus, VideoJob

    job = VideoJob(id="video_gen_x", status=JobStatus.COMPLETED, model="m", prompt="p", size="224x128", seconds="1",
                   created_at=0, task="t2va", num_frames=22, num_inference_steps=4, seed=0)  # fmt: skip
    live = {"video_gen_x": {"stage": "encode", "done": 0, "total": 1, "elapsed_s": 1.0, "ahead": None}}
    assert shown_record(job, live)["live"] is None
    running = job.model_copy(update={"status": JobStatus.IN_PROGRESS})
    assert shown_record(running, live)["live"]["stage"] == "encode"


def test_the_page_snaps_frames_on_the_servers_grid():
    js = (WEB / "page.js").read_text(encoding="utf-8")
    assert re.search(r"const CLIP_FRAMES = (\d+);", js)[1] == str(CLIP_FRAMES)
    assert re.search(r"const LATENTS_PER_CLIP = (\d+);", js)[1] == str(LATENTS_PER_CLIP)


def test_the_browser_tests_switches_are_not_settings():
    # CI exports H3TEST_REQUIRE_BROWSER=1 for the whole run: outside the H3_ prefix, a server never reads it.
    env = {"H3TEST_REQUIRE_BROWSER": "1", "H3TEST_ARTIFACTS": "/tmp/artifacts"}
    assert load_settings(env=env).api_port == 8000


# ---- in a browser ---------------------------------------------------------------------------------------------------
@pytest.fixture
def browser(tmp_path, monkeypatch):
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("the selenium package")
    if missing:
        reason = f"the browser test needs {', '.join(missing)} (apt-get install chromium chromium-driver)"
        if os.environ.get("H3TEST_REQUIRE_BROWSER") == "1":
            pytest.fail(reason + "; H3TEST_REQUIRE_BROWSER=1 asks for it")
        pytest.skip(reason)
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager never downloads a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-proxy-server",
             "--window-size=1280,1000", f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    for flag in flags:
        options.add_argument(flag)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options.add_experimental_option(
        "prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False}
    )
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def shot(browser) -> Iterator[Callable[..., None]]:
    """`shot(name, zoom=1)`: a full-page screenshot, numbered in step order; at `zoom` 2 the page is laid out in half
    the width, as at 200% zoom, and the check is that nothing needs a horizontal scroll."""
    folder = Path(os.environ.get("H3TEST_ARTIFACTS") or ROOT / "artifacts") / "web"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    count = iter(range(1, 100))

    def take(name: str, zoom: int = 1) -> None:
        width = 1280 // zoom
        metrics = {"width": width, "height": 1000, "deviceScaleFactor": zoom, "mobile": False}
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        height, scroll_width = browser.execute_script(
            "return [document.documentElement.scrollHeight, document.documentElement.scrollWidth]"
        )
        assert scroll_width <= width, f"{name}: the page is {scroll_width} CSS pixels wide in a {width} window"
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {**metrics, "height": height})
        browser.save_screenshot(str(folder / f"{next(count):02d}-{name}.png"))
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})

    yield take


def until(condition: Callable[[], object], what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def test_the_page_in_a_browser(browser, shot, server):  # the browser first: without one, no server starts
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    def text(element_id: str) -> str:
        return browser.find_element(By.ID, element_id).text

    def shown(element_id: str) -> bool:
        return browser.find_element(By.ID, element_id).is_displayed()

    def fill(element_id: str, value: str) -> None:
        field = browser.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)

    def card(job_id: str):
        return browser.find_element(By.CSS_SELECTOR, f'li.job[data-job-id="{job_id}"]')

    def newest_job_id() -> str:
        def created() -> str | None:
            status = text("submit-status")
            return (match := re.search(r"Queued as (video_gen_\w+)", status)) and match[1]

        return until(created, "the job to be queued")

    with server.client(KEY) as api:
        private = api.post("/v1/videos", data={"prompt": PRIVATE, "num_inference_steps": "2"}).json()
        wait_status(api, private["id"], {"completed"})

    # 1. Without the key: the server's facts (from /health), a request for the key, and no job.
    browser.get(server.url + "/")
    until(lambda: shown("key-section") and "needs its API key" in text("key-message"), "the key to be asked for")
    until(lambda: text("server-ready") == "ready", "the readiness")
    assert text("server-model").startswith("h3serve-tiny") and text("server-gpus") == "1"
    assert "cpu" in text("server-profile") and "TORCH_SDPA" in text("server-profile")
    assert not shown("create") and not shown("queue") and PRIVATE not in browser.page_source
    unlabelled = browser.execute_script(
        "return [...document.querySelectorAll('input, select, textarea')].filter(e => !e.labels.length"
        " && !e.getAttribute('aria-label')).map(e => e.id || e.name)"
    )
    assert unlabelled == []
    shot("key-asked")

    # 2. A wrong key: a clear 401.
    fill("key", KEY[:-1] + "x")
    browser.find_element(By.ID, "key").send_keys(Keys.ENTER)  # the keyboard alone
    until(lambda: "refused this key (401" in text("key-message"), "the 401 message")
    assert not shown("create")
    shot("wrong-key")

    # 3. The key: the form and the jobs, the earlier job among them.
    fill("key", KEY)
    browser.find_element(By.ID, "key").send_keys(Keys.ENTER)
    until(lambda: shown("create") and shown("queue"), "the form")
    until(lambda: card(private["id"]).find_element(By.CLASS_NAME, "job-prompt").text == PRIVATE, "the job list")
    assert browser.execute_script("return sessionStorage.getItem('h3serve.key')") == KEY
    shot("signed-in")

    # 4. The duration snaps up to 17n+5 as the server snaps it (0.9375 s is 22.5 frames: Python rounds half to even).
    for value in ("2", "0.9375", "1"):
        fill("seconds", value)
        frames = snap_up(seconds_to_frames(float(value)))
        written = f"{frames / FPS:.3f}".rstrip("0").rstrip(".")  # as the job record writes `seconds`
        assert f"gets {frames} frames ({written} s)" in text("seconds-snap"), (value, text("seconds-snap"))

    # 5. A render: progress moves, then the video plays in the page.
    fill("prompt", "A lighthouse at dusk, waves on the rocks, gulls overhead.")
    browser.find_element(By.ID, "size-explicit").click()
    fill("width", "192")
    fill("height", "128")
    fill("steps", LONG)
    fill("seed", "7")
    browser.find_element(By.ID, "submit").click()
    first = newest_job_id()
    seen: set[str] = set()

    def step_shown() -> bool:
        stage = card(first).find_element(By.CLASS_NAME, "job-stage").text
        seen.add(stage)
        match = re.search(r"denoise, step (\d+) of (\d+)", stage)
        return bool(match and int(match[1]) > 0 and int(match[2]) == int(LONG) - 1 and "left" in stage)

    until(step_shown, "a denoise step to show")
    shot("rendering")
    until(lambda: card(first).get_attribute("data-status") == "completed", "the render to complete")
    assert len(seen) >= 2, seen  # it moved
    with server.client(KEY) as api:
        job = wait_status(api, first, {"completed"})
    metadata = (
        f"const v = document.querySelector('li.job[data-job-id=\"{first}\"] video');"
        "return v && v.readyState >= 1 && [v.duration, v.videoWidth, v.videoHeight]"
    )
    duration, width, height = until(lambda: browser.execute_script(metadata), "the video's metadata")
    assert (width, height) == (192, 128) and job["size"] == "192x128"
    assert abs(duration - job["num_frames"] / FPS) < 0.1 and job["num_frames"] == snap_up(seconds_to_frames(1.0))
    settings_line = card(first).find_element(By.CLASS_NAME, "job-settings").text
    assert "seed 7" in settings_line and "192x128" in settings_line and f"{LONG} steps" in settings_line
    shot("finished")

    # 6. The download is the job's MP4, byte for byte.
    card(first).find_element(By.CLASS_NAME, "job-download").click()
    saved = browser.downloads / job["file_name"]
    until(lambda: saved.is_file() and not list(browser.downloads.glob("*.crdownload")), "the download")
    with server.client(KEY) as api:
        assert saved.read_bytes() == api.get(f"/v1/videos/{first}/content").content
    shot("downloaded")

    # 7. A second render, cancelled while it runs.
    fill("prompt", "A render to cancel.")
    browser.find_element(By.ID, "submit").click()
    second = newest_job_id()
    until(lambda: card(second).get_attribute("data-status") == "in_progress", "the second render to start")
    card(second).find_element(By.CLASS_NAME, "job-cancel").click()
    until(lambda: card(second).get_attribute("data-status") == "cancelled", "the cancel")
    assert "cancelled" in card(second).find_element(By.CLASS_NAME, "job-error").text
    assert not card(second).find_element(By.CLASS_NAME, "job-cancel").is_displayed()
    shot("cancelled")
    card(second).find_element(By.CLASS_NAME, "job-delete").click()  # a finished job: its record goes
    until(lambda: not browser.find_elements(By.CSS_SELECTOR, f'li.job[data-job-id="{second}"]'), "the delete")
    with server.client(KEY) as api:
        assert api.get(f"/v1/videos/{second}").status_code == 404

    # 8. Invalid values: the API's error next to the field it names.
    fill("steps", "1")
    browser.find_element(By.ID, "submit").click()
    until(lambda: "2..1000" in text("steps-error"), "the steps error")
    steps = browser.find_element(By.ID, "steps")
    assert steps.get_attribute("aria-invalid") == "true" and "steps-error" in steps.get_attribute("aria-describedby")
    assert text("form-error") == "" and text("size-error") == ""
    shot("invalid-steps")
    fill("steps", "2")
    fill("width", "100")
    browser.find_element(By.ID, "submit").click()
    until(lambda: "multiple of 32" in text("size-error"), "the size error")
    assert text("steps-error") == "" and steps.get_attribute("aria-invalid") is None
    shot("invalid-size")

    # 9. At 200% zoom the page still reads in one column, without a horizontal scroll (`shot` checks).
    shot("zoom-200", zoom=2)


def test_a_damaged_record_is_a_card_that_says_so_and_the_rest_are_listed(browser, tmp_path):
    """A row the store cannot read (docs/api.md: status `damaged`) is listed as a card with its id and the error,
    without the settings it lost and without reuse buttons, and the page's other jobs are listed beside it."""
    import sqlite3

    from selenium.webdriver.common.by import By

    with live_server(settings(tmp_path, api_key=KEY)) as server:
        with server.client(KEY) as api:
            jobs = [api.post("/v1/videos", data={"prompt": f"job {i}", "num_inference_steps": "2"}).json()["id"]
                    for i in range(2)]  # fmt: skip
            for job_id in jobs:
                wait_status(api, job_id, {"completed"})
        db = sqlite3.connect(tmp_path / "jobs.sqlite3")
        assert db.execute("UPDATE jobs SET status='exploded' WHERE id=?", (jobs[0],)).rowcount == 1
        db.commit()
        db.close()
        browser.get(server.url + "/")
        # Shown and enabled, not only in the document: under load the field was found before it could take keys.
        key = until(lambda: [e for e in browser.find_elements(By.ID, "key") if e.is_displayed() and e.is_enabled()],
                    "the key field, ready for input")[0]  # fmt: skip
        key.send_keys(KEY + "\n")

        def card(job_id: str):
            found = browser.find_elements(By.CSS_SELECTOR, f'li.job[data-job-id="{job_id}"]')
            return found[0] if found else None

        damaged = until(lambda: card(jobs[0]), "the damaged record's card")
        until(lambda: card(jobs[1]) and "Completed" in card(jobs[1]).text, "the sound record's card")
        assert damaged.get_attribute("data-status") == "damaged"
        assert "Damaged record" in damaged.text and "damaged_record" in damaged.text
        assert "could not be read" in damaged.find_element(By.CLASS_NAME, "job-settings").text
        assert "undefined" not in damaged.text
        assert not damaged.find_element(By.CLASS_NAME, "job-reuse").is_displayed()
        # No script error (the 401 of the page's first call, before the key, is the network's log, not the page's).
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
        assert errors == [], errors


# Notes, in the page, when each job's first preview has loaded (its size, caption, the card's status and whether its
# cancel button shows then) and when its <video> appears: the order of the two, whatever the test's polling misses.
RECORDER = """
window.h3seen = [];
const note = (what, node, extra) => {
  const card = node.closest("li.job");
  window.h3seen.push({ what, job: card.dataset.jobId, status: card.dataset.status, t: performance.now(), ...extra });
};
document.addEventListener("load", (e) => {
  const img = e.target;
  if (!(img instanceof HTMLImageElement) || !img.closest(".job-preview")) return;
  note("preview", img, { width: img.naturalWidth, height: img.naturalHeight,
    caption: img.closest("figure").querySelector("figcaption").textContent,
    cancel: img.closest("li.job").querySelector(".job-cancel").offsetParent !== null });
}, true);
new MutationObserver(() => {
  for (const video of document.querySelectorAll("li.job video")) {
    if (!video.h3seen) {
      video.h3seen = true;
      note("video", video, {});
    }
  }
}).observe(document.getElementById("jobs"), { childList: true, subtree: true });
"""


def test_a_job_shows_its_previews_from_its_events_before_its_video(browser, tmp_path):
    """The form's `preview_every` goes with the request; the job's card follows its events (read with fetch() and the
    key, GET /v1/videos/{id}/events) and shows each preview (fetched with the key) while the job renders, the cancel
    button below it; then the video takes its place and the card ends completed."""
    from selenium.webdriver.common.by import By

    steps, every = 8, 2
    with live_server(settings(tmp_path, api_key=KEY, preview_min_every=1)) as server:
        browser.get(server.url + "/")
        key = until(lambda: (k := browser.find_element(By.ID, "key")).is_displayed() and k, "the key field")
        key.send_keys(KEY + "\n")
        until(lambda: browser.find_element(By.ID, "create").is_displayed(), "the form")
        browser.execute_script(RECORDER)
        for element_id, value in (("prompt", "A preview of a lighthouse."), ("steps", str(steps)),
                                  ("preview-every", str(every))):  # fmt: skip
            browser.find_element(By.ID, element_id).send_keys(value)
        browser.find_element(By.ID, "submit").click()
        status = lambda: browser.find_element(By.ID, "submit-status").text  # noqa: E731
        job_id = until(lambda: (m := re.search(r"Queued as (video_gen_\w+)", status())) and m[1], "the job")
        card = browser.find_element(By.CSS_SELECTOR, f'li.job[data-job-id="{job_id}"]')

        def seen(what: str) -> list[dict]:
            notes = browser.execute_script("return window.h3seen")
            return [n for n in notes if n["job"] == job_id and n["what"] == what]

        until(lambda: seen("video"), "the video")
        until(lambda: card.get_attribute("data-status") == "completed", "the card to end completed")
        previews, videos = seen("preview"), seen("video")
        assert previews, "no preview loaded in the card"
        first = previews[0]
        assert first["t"] < videos[0]["t"], (previews, videos)
        assert first["width"] > 0 and first["height"] > 0, first
        assert first["status"] in ("queued", "in_progress") and first["cancel"], first
        forwards = steps - 1
        for note in previews:
            match = re.fullmatch(rf"Preview after forward (\d+)/{forwards} \(.*\)\.", note["caption"])
            assert match and due(int(match[1]), forwards, every), note
        # The video has replaced the preview, and the preview's object URL has gone with it.
        assert not card.find_elements(By.CLASS_NAME, "job-preview")
        assert f"a preview every {every} forwards" in card.find_element(By.CLASS_NAME, "job-settings").text
        # The card followed the job's event stream (a fetch the page made with the key: the stream needs it).
        fetched = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert any(name.endswith(f"/v1/videos/{job_id}/events") for name in fetched), fetched
        with server.client(KEY) as api:
            job = api.get(f"/v1/videos/{job_id}").json()
        assert job["status"] == "completed" and job["preview_every"] == every and job["num_inference_steps"] == steps
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
        assert errors == [], errors
