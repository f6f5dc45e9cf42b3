"""The job store under damage: a start refuses a damaged store (before any weight loads) naming the file and what is
wrong; every finished job leaves its record beside its MP4, so `h3serve store rebuild` brings every job of the folder
back; a row that goes bad while the server runs is listed as damaged and the rest are served; `h3serve store check`
reports it all. Real folders made by a real server on loopback, real SQLite files damaged on disk; nothing mocked."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from h3serve.cli import main
from h3serve.service.store import STORE_FILE, JobStore, StoreDamaged, check_store, inspect_store, rebuild_store
from service_fixtures import free_port, live_server, settings, wait_status

JOBS = 6
# Long prompts make the store several pages long, so that "a page in the middle" is a page of job records.
PROMPT = "A lighthouse keeper climbs the spiral stairs at dusk, wind against the glass. " * 45  # ~3,500 characters


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """An output folder a real server made: JOBS completed jobs and one cancelled, then a clean stop. Returns the
    folder and every record as the API showed it (without `live`). Each test damages a copy (`folder`)."""
    out = tmp_path_factory.mktemp("made")
    with live_server(settings(out)) as s, s.client() as c:
        ids = [c.post("/v1/videos", data={"prompt": f"{i} {PROMPT}", "num_inference_steps": "2"}).json()["id"]
               for i in range(JOBS)]  # fmt: skip
        for job_id in ids:
            wait_status(c, job_id, {"completed"})
        cancelled = c.post("/v1/videos", data={"prompt": "slow", "num_inference_steps": "1000"}).json()["id"]
        wait_status(c, cancelled, {"in_progress"})
        assert c.delete(f"/v1/videos/{cancelled}").json()["status"] == "cancelled"
        listed = c.get("/v1/videos", params={"limit": 100}).json()["data"]
    records = {j["id"]: {k: v for k, v in j.items() if k != "live"} for j in listed}
    assert len(records) == JOBS + 1
    return out, records


@pytest.fixture
def folder(made, tmp_path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(made[0], copy)
    return copy


def stored(out: Path) -> dict[str, dict]:
    store = JobStore(out)
    try:
        jobs, _ = store.list(100)
        return {j.id: j.model_dump() for j in jobs}
    finally:
        store.close()


def preflight(capsys, out: Path) -> tuple[int, str]:
    code = main(["check", "--preflight", "--output-dir", str(out), "--api-port", str(free_port())])
    return code, capsys.readouterr().err


def store_cli(capsys, command: str, out: Path, *more: str) -> tuple[int, str]:
    code = main(["store", command, "--output-dir", str(out), *more])
    return code, capsys.readouterr().out


def damage_row(out: Path, sql: str, job_id: str) -> None:
    db = sqlite3.connect(out / STORE_FILE)
    assert db.execute(sql, (job_id,)).rowcount == 1
    db.commit()
    db.close()


def completed(records: dict[str, dict]) -> list[str]:
    return sorted(i for i, r in records.items() if r["status"] == "completed")


# ---- what a finished job leaves, and what a start accepts ------------------------------------------------------------
def test_every_finished_job_has_its_record_beside_its_mp4_and_a_delete_removes_both(made, folder):
    _, records = made
    videos = folder / "videos"
    for job_id, record in records.items():
        sidecar = videos / f"{job_id}.json"
        assert sidecar.is_file(), f"{record['status']} job {job_id} has no sidecar"
        assert json.loads(sidecar.read_text()) == record
    assert list(videos.glob(".*")) == []  # no temporary file left
    assert sorted(p.stem for p in videos.glob("*.mp4")) == completed(records)
    gone = completed(records)[0]
    with live_server(settings(folder)) as s, s.client() as c:
        assert c.delete(f"/v1/videos/{gone}").json()["deleted"] is True
    assert not (videos / f"{gone}.json").exists() and not (videos / f"{gone}.mp4").exists()
    assert check_store(folder).rows == JOBS  # a deleted job is not "lost": nothing is refused


def test_a_new_folder_and_a_fresh_empty_store_without_videos_start(tmp_path, capsys):
    assert preflight(capsys, tmp_path / "new")[0] == 0
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / STORE_FILE).touch()  # 0 bytes, and nothing beside it
    code, err = preflight(capsys, tmp_path / "fresh")
    assert code == 0, err
    assert "job store" in err


# ---- an empty store beside MP4s --------------------------------------------------------------------------------------
def test_an_empty_store_beside_mp4s_is_refused_before_any_weight_loads_then_rebuilt(made, folder, capsys):
    _, records = made
    (folder / STORE_FILE).write_bytes(b"")  # the case: 0 bytes, 13 MP4s beside it
    code, err = preflight(capsys, folder)
    assert code == 1
    assert f"H3_OUTPUT_DIR (--output-dir): {folder / STORE_FILE}: " in err
    assert "the store holds no jobs but videos/ holds 6 MP4(s)" in err and "h3serve store rebuild" in err

    # `serve` refuses in the same words, before the model loads (its log would say "loaded").
    env = {k: v for k, v in os.environ.items() if not k.startswith("H3_")}
    proc = subprocess.run(
        [sys.executable, "-m", "h3serve.cli", "serve", "--output-dir", str(folder), "--api-port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the store holds no jobs but videos/ holds 6 MP4(s)" in proc.stderr and " loaded" not in proc.stderr

    code, out = store_cli(capsys, "rebuild", folder)
    assert code == 0, out
    assert f"rebuilt {folder / STORE_FILE}: {JOBS + 1} job(s), {JOBS + 1} from the records in videos/" in out
    assert stored(folder) == records
    aside = list(folder.glob(f"{STORE_FILE}.damaged-*"))
    assert len(aside) == 1 and aside[0].stat().st_size == 0  # the old store kept, as it was
    assert preflight(capsys, folder)[0] == 0


# ---- a damaged page --------------------------------------------------------------------------------------------------
def test_a_page_damaged_in_the_middle_is_refused_naming_the_file_then_rebuild_brings_every_job_back(
    made, folder, capsys
):
    _, records = made
    path = folder / STORE_FILE
    assert not (folder / f"{STORE_FILE}-wal").exists()  # a clean stop merged the WAL: the pages are in the file
    db = sqlite3.connect(path)
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    pages = path.stat().st_size // page_size
    assert pages >= 5, f"the store is {pages} pages: too short to damage one in the middle"
    with open(path, "r+b") as f:  # page numbers are 1-based; page 1 holds the header and the schema
        f.seek((pages // 2) * page_size)
        f.write(b"\xa5" * page_size)
    damaged = path.read_bytes()
    report = inspect_store(folder)
    assert report.integrity != "ok" and report.problem.startswith("SQLite's integrity check failed")

    code, err = preflight(capsys, folder)
    assert code == 1
    assert f"H3_OUTPUT_DIR (--output-dir): {path}: SQLite's integrity check failed" in err
    with pytest.raises(StoreDamaged, match="integrity check failed"):
        JobStore(folder)  # the server's own open refuses it too: create_app never serves it
    assert path.read_bytes() == damaged  # checked read-only: nothing changed

    code, out = store_cli(capsys, "check", folder)
    assert code == 1 and "verdict: damaged" in out and f"store: {path}" in out

    code, out = store_cli(capsys, "rebuild", folder)
    assert code == 0, out
    assert stored(folder) == records  # every job of the copied folder, record for record
    aside = [p for p in folder.glob(f"{STORE_FILE}.damaged-*") if not p.name.endswith(("-wal", "-shm"))]
    assert [p.read_bytes() for p in aside] == [damaged]  # kept as it was
    assert store_cli(capsys, "check", folder)[0] == 0
    with live_server(settings(folder)) as s, s.client() as c:
        job_id = completed(records)[0]
        assert c.get(f"/v1/videos/{job_id}/content").content == (folder / "videos" / f"{job_id}.mp4").read_bytes()
        assert len(c.get("/v1/videos", params={"limit": 100}).json()["data"]) == JOBS + 1


# ---- one bad row -----------------------------------------------------------------------------------------------------
BAD_ROWS = {
    "an unknown status": ("UPDATE jobs SET status='exploded' WHERE id=?", "status: Input should be"),
    "malformed JSON": ("UPDATE jobs SET stage_durations='{\"denoise\": 0.' WHERE id=?", "stage_durations: not JSON"),
    "text that is not UTF-8": ("UPDATE jobs SET prompt=CAST(x'ff00fe' AS TEXT) WHERE id=?", "prompt: not UTF-8"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_one_bad_row_is_refused_at_start_naming_it_and_rebuild_brings_it_back(case, made, folder, capsys):
    sql, why = BAD_ROWS[case]
    _, records = made
    bad = completed(records)[2]
    damage_row(folder, sql, bad)
    code, err = preflight(capsys, folder)
    assert code == 1
    assert f"{folder / STORE_FILE}: 1 job record(s) cannot be read: row " in err
    assert f"(id {bad}): {why}" in err

    code, out = store_cli(capsys, "check", folder)
    assert code == 1 and f"(id {bad}): {why}" in out and f"rows: {JOBS + 1} (1 damaged)" in out

    code, out = store_cli(capsys, "rebuild", folder)
    assert code == 0, out
    assert stored(folder) == records  # the bad row's job is back from its sidecar


def test_a_foreign_jobs_table_is_refused_and_rebuild_keeps_it_aside(made, folder, capsys):
    _, records = made
    path = folder / STORE_FILE
    path.unlink()
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, name TEXT, payload BLOB)")
    db.execute("INSERT INTO jobs VALUES (1, 'nightly backup', x'00')")
    db.commit()
    db.close()
    code, err = preflight(capsys, folder)
    assert code == 1
    assert f"{path}: its jobs table is not h3serve's: columns name, payload are not a job record's" in err
    with pytest.raises(StoreDamaged):
        JobStore(folder)  # and its table was not altered
    db = sqlite3.connect(path)
    assert [r[1] for r in db.execute("PRAGMA table_info(jobs)")] == ["id", "name", "payload"]
    db.close()

    assert store_cli(capsys, "rebuild", folder)[0] == 0
    assert stored(folder) == records
    (aside,) = folder.glob(f"{STORE_FILE}.damaged-*")
    db = sqlite3.connect(aside)
    assert db.execute("SELECT name FROM jobs").fetchall() == [("nightly backup",)]
    db.close()


def test_a_row_that_goes_bad_while_serving_is_listed_as_damaged_and_the_rest_are_served(made, folder, caplog):
    _, records = made
    first, second = completed(records)[1], completed(records)[3]
    with live_server(settings(folder)) as s, s.client() as c:
        damage_row(folder, "UPDATE jobs SET status='exploded' WHERE id=?", first)
        damage_row(folder, "UPDATE jobs SET cached_steps='[1,' WHERE id=?", second)
        with caplog.at_level(logging.ERROR, logger="h3serve"):
            for _ in range(2):
                answer = c.get("/v1/videos", params={"limit": 100})
                assert answer.status_code == 200, answer.text
                listed = {j["id"]: j for j in answer.json()["data"]}
            assert set(listed) == set(records)
            for job_id in (first, second):
                assert listed[job_id]["status"] == "damaged"
                assert listed[job_id]["error"]["code"] == "damaged_record"
                one = c.get(f"/v1/videos/{job_id}")
                assert one.status_code == 200 and one.json()["status"] == "damaged"
                content = c.get(f"/v1/videos/{job_id}/content")
                assert content.status_code == 409 and content.json()["error"]["code"] == "damaged_record"
            assert "cached_steps: not JSON" in listed[second]["error"]["message"]
            for job_id in set(records) - {first, second}:
                assert {k: v for k, v in listed[job_id].items() if k != "live"} == records[job_id]
            # Paging through a damaged record: `after` a damaged id goes on from it.
            ids, after = [], None
            while True:
                page = c.get("/v1/videos", params={"limit": 2, **({"after": after} if after else {})}).json()
                ids += [j["id"] for j in page["data"]]
                if not page["has_more"]:
                    break
                after = page["last_id"]
            assert ids == list(listed)
        told = [r for r in caplog.records if "cannot be read" in r.getMessage()]
        assert sorted(first in r.getMessage() for r in told) == [False, True]  # each damaged row logged once
        assert c.get("/v1/videos/" + completed(records)[0]).json()["status"] == "completed"


# ---- `h3serve store check` ----------------------------------------------------------------------------------------
def test_store_check_reports_the_files_beside_the_store_and_exits_by_its_verdict(made, folder, capsys):
    _, records = made
    code, out = store_cli(capsys, "check", folder)
    assert code == 0, out
    assert "integrity: ok" in out and f"rows: {JOBS + 1} (0 damaged)" in out and out.rstrip().endswith("sound")

    gone, stray = completed(records)[0], "video_gen_" + "0" * 32
    (folder / "videos" / f"{gone}.mp4").unlink()
    (folder / "videos" / f"{stray}.mp4").write_bytes(b"not ours")
    code, out = store_cli(capsys, "check", folder)
    assert code == 0, out  # reported, not refused: the download of `gone` says 410, the stray MP4 is no job
    assert f"completed record whose MP4 is missing: {gone}" in out
    assert f"MP4 without a record in the store: videos/{stray}.mp4" in out

    lost = completed(records)[4]
    db = sqlite3.connect(folder / STORE_FILE)
    db.execute("DELETE FROM jobs WHERE id=?", (lost,))
    db.commit()
    db.close()
    code, out = store_cli(capsys, "check", folder)
    assert code == 1
    assert f"record in videos/ the store lacks: videos/{lost}.json" in out
    assert "1 finished job(s) have their record in videos/ but not in the store" in out

    assert store_cli(capsys, "rebuild", folder)[0] == 0
    after = stored(folder)
    assert set(after) == set(records) and after[lost] == records[lost]
    assert (folder / "videos" / f"{lost}.mp4").is_file()
    (unrecorded,) = folder.glob("unrecorded-*")
    assert [p.name for p in unrecorded.iterdir()] == [f"{stray}.mp4"]  # moved aside, never deleted


def test_rebuild_leaves_a_sound_store_alone_without_force_and_never_replaces_a_kept_one(made, folder, capsys):
    before = (folder / STORE_FILE).read_bytes()
    code, out = store_cli(capsys, "rebuild", folder)
    assert code == 0 and "nothing rebuilt" in out
    assert (folder / STORE_FILE).read_bytes() == before and not list(folder.glob(f"{STORE_FILE}.damaged-*"))
    for _ in range(2):  # twice within the same second: the first store kept aside is not replaced by the second
        rebuild_store(folder, now=0.0)
    kept = sorted(p for p in folder.glob(f"{STORE_FILE}.damaged-*") if not p.name.endswith(("-wal", "-shm")))
    assert len(kept) == 2 and kept[0].read_bytes() == before
    assert stored(folder) == made[1]


def test_a_start_removes_an_mp4_no_record_names_as_a_stopped_delete_left_it(folder):
    """A DELETE killed between its record and its file (or a job killed between its MP4's rename and its completion)
    leaves an MP4 that nothing names and no sidecar claims: the next start finishes the job of removing it, and
    leaves every recorded MP4 alone."""
    videos = folder / "videos"
    kept = sorted(p.name for p in videos.glob("*.mp4"))
    orphan = videos / "video_gen_0123456789abcdef0123456789abcdef.mp4"
    orphan.write_bytes(b"an mp4 nobody can reach")
    JobStore(folder).close()  # a start: its recovery runs
    assert not orphan.exists()
    assert sorted(p.name for p in videos.glob("*.mp4")) == kept and kept
