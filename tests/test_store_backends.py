"""The job store's contract (`store.interface.JobRecords`), the same tests against both stores: SQLite in the output
folder (the default) and PostgreSQL (H3_STORE), the latter on a real server (tests/pg_fixtures.py). Then what only the
PostgreSQL store does: servers sharing a database under names of their own, its URL's password never shown, what it
refuses. The fleet's claims on it: tests/test_fleet_claims.py."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from h3serve.cli import main
from h3serve.service.schemas import JobError, JobStatus, VideoJob
from h3serve.service.store import (
    COLUMNS,
    FIELDS,
    STORE_FILE,
    DamagedRecord,
    RecordDamaged,
    ValueRefused,
    check_job_store,
    open_store,
)
from h3serve.settings import Settings, SettingsError, load_settings, shown_url, url_problem
from service_fixtures import FormClient, live_server, settings, wait_status


def record(job_id: str, created_at: int = 100, status: JobStatus = JobStatus.QUEUED, **more: Any) -> VideoJob:
    fields = dict(model="m", prompt="p", size="224x128", seconds="1", task="t2va", num_frames=22)
    fields.update(num_inference_steps=4, seed=1)
    return VideoJob(id=job_id, status=status, created_at=created_at, **{**fields, **more})


# ---- the contract, against both --------------------------------------------------------------------------------------
def test_every_field_round_trips_and_a_name_that_is_no_field_is_refused(backend, tmp_path):
    assert tuple(VideoJob.model_fields) == FIELDS
    store = backend.open(tmp_path)
    try:
        full = VideoJob(
            id="video_gen_full", object="video", status=JobStatus.FAILED, progress=37, model="m", prompt="p ü\n",
            size="224x128", seconds="0.917", quality="high", created_at=5, completed_at=6, expires_at=7,
            error=JobError(code="render_failed", message="m"), media_type="video/mp4", file_name="video_gen_full.mp4",
            inference_time_s=1.5, stage_durations={"denoise": 0.25}, peak_memory_mb=12.5, num_gpus=2, task="i2va",
            num_frames=22, num_inference_steps=4, seed=(1 << 63) - 1, flow_shift=6.0, audio_flow_shift=2.5,
            step_cache="server", cached_steps=[1, 3], preview_every=5, adapters=[{"name": "a", "scale": 0.5}],
        )  # fmt: skip
        unset = [f for f in VideoJob.model_fields if getattr(full, f) == VideoJob.model_fields[f].default]
        assert unset == ["object", "media_type"]  # constants: nothing else to set them to
        store.insert(full)
        assert store.get(full.id) == full
        store.update(full.id, error=None, cached_steps=None, status=JobStatus.COMPLETED)
        back = store.get(full.id)
        assert (back.error, back.cached_steps, back.status) == (None, None, JobStatus.COMPLETED)
        for bad in ({"status; DROP TABLE jobs": "x"}, {"error_code": "x"}, {"id": "other"}):
            with pytest.raises(ValueError, match="cannot set"):
                store.update(full.id, **bad)
        assert store.get(full.id) == back
        assert store.get("video_gen_absent") is None and store.entry("video_gen_absent") is None
        assert store.path(back) == tmp_path / "videos" / "video_gen_full.mp4"
    finally:
        store.close()


def test_the_list_is_newest_first_then_by_insertion_and_pages_by_the_last_id(backend, tmp_path):
    store = backend.open(tmp_path)
    try:
        # Created-at ties on purpose: the insertion order breaks them, in both stores.
        order = [("a", 10), ("b", 30), ("c", 20), ("d", 20), ("e", 30), ("f", 5)]
        for job_id, created in order:
            store.insert(record(job_id, created))
        newest = ["e", "b", "d", "c", "a", "f"]
        jobs, more = store.list(100)
        assert ([j.id for j in jobs], more) == (newest, False)
        jobs, more = store.list(100, oldest_first=True)
        assert [j.id for j in jobs] == ["f", "a", "c", "d", "b", "e"] and not more
        for oldest_first, expected in ((False, newest), (True, newest[::-1])):
            ids, after = [], None
            while True:
                page, more = store.list(2, after, oldest_first=oldest_first)
                ids += [j.id for j in page]
                if not more:
                    break
                after = page[-1].id
            assert ids == expected
        assert store.list(3) == (store.list(100)[0][:3], True)
    finally:
        store.close()


def test_counts_have_every_state_and_a_delete_removes_the_record_and_only_its_own_mp4(backend, tmp_path):
    store = backend.open(tmp_path)
    try:
        assert store.counts() == {s.value: 0 for s in JobStatus}
        store.insert(record("video_gen_done", status=JobStatus.COMPLETED, file_name="video_gen_done.mp4"))
        store.insert(record("video_gen_queued"))
        store.insert(record("video_gen_other", status=JobStatus.FAILED))
        (tmp_path / "videos" / "video_gen_done.mp4").write_bytes(b"mp4")
        (tmp_path / "videos" / "video_gen_other.mp4").write_bytes(b"not its")
        counts = store.counts()
        assert (counts["completed"], counts["queued"], counts["failed"], sum(counts.values())) == (1, 1, 1, 3)
        store.delete("video_gen_done")
        assert store.get("video_gen_done") is None
        assert not (tmp_path / "videos" / "video_gen_done.mp4").exists()
        store.delete("video_gen_queued")
        store.delete("video_gen_never")  # absent: nothing happens
        # A row edited to name another job's MP4: its delete removes the row, never that file.
        store.insert(record("video_gen_hostile", status=JobStatus.COMPLETED))
        named = "UPDATE jobs SET file_name='video_gen_other.mp4' WHERE id=?"
        assert backend.execute(tmp_path, named, ("video_gen_hostile",)) == 1
        store.delete("video_gen_hostile")
        assert store.entry("video_gen_hostile") is None
        assert (tmp_path / "videos" / "video_gen_other.mp4").exists()  # another job's file is never touched
        assert [j.id for j in store.list(10)[0]] == ["video_gen_other"]
    finally:
        store.close()


def test_a_reopened_store_fails_the_jobs_left_active_and_keeps_the_finished_ones(backend, tmp_path):
    store = backend.open(tmp_path)
    store.insert(record("video_gen_q"))
    store.insert(record("video_gen_r", status=JobStatus.IN_PROGRESS, progress=40))
    store.insert(record("video_gen_c", status=JobStatus.COMPLETED, file_name="video_gen_c.mp4"))
    videos = tmp_path / "videos"
    (videos / "video_gen_c.mp4").write_bytes(b"done")
    (videos / "video_gen_r.mp4").write_bytes(b"renamed into place, never marked completed")
    (videos / ".video_gen_q.mp4.tmp").write_bytes(b"half")
    store.close()  # as a crash would leave it: no shutdown wrote anything
    store = backend.open(tmp_path)
    try:
        assert store.recovered == 2
        for job_id in ("video_gen_q", "video_gen_r"):
            job = store.get(job_id)
            assert (job.status, job.error.code) == (JobStatus.FAILED, "interrupted")
            assert job.completed_at is not None
        assert store.get("video_gen_c").status == JobStatus.COMPLETED
        assert sorted(p.name for p in videos.iterdir() if p.suffix != ".json") == ["video_gen_c.mp4"]
    finally:
        store.close()


def test_a_row_that_goes_bad_while_open_is_listed_as_damaged_and_the_next_open_refuses_it(backend, tmp_path, caplog):
    store = backend.open(tmp_path)
    try:
        for i, job_id in enumerate(["video_gen_a", "video_gen_b", "video_gen_c"]):
            store.insert(record(job_id, created_at=10 + i))
        assert backend.execute(tmp_path, "UPDATE jobs SET status='exploded' WHERE id=?", ("video_gen_b",)) == 1
        assert backend.execute(tmp_path, "UPDATE jobs SET cached_steps='[1,' WHERE id=?", ("video_gen_c",)) == 1
        for _ in range(2):
            jobs, _ = store.list(10)
        assert [j.id for j in jobs] == ["video_gen_c", "video_gen_b", "video_gen_a"]
        assert [j.status for j in jobs] == ["damaged", "damaged", JobStatus.QUEUED]
        assert isinstance(jobs[0], DamagedRecord) and "cached_steps: not JSON" in jobs[0].error.message
        with pytest.raises(RecordDamaged) as raised:
            store.get("video_gen_b")
        assert raised.value.record.error.code == "damaged_record"
        told = [r for r in caplog.records if "cannot be read" in r.getMessage()]
        assert len(told) == 2  # each damaged row logged once
        counts = store.counts()  # by the status column: a status that is no state is in none of them
        assert (counts["queued"], sum(counts.values())) == (2, 2)
    finally:
        store.close()
    with pytest.raises(ValueError, match="video_gen_b") as refused:
        backend.open(tmp_path)
    assert "2 job record(s) cannot be read" in str(refused.value)
    with pytest.raises(ValueError, match="2 job record"):
        check_job_store(tmp_path, backend.url)


def test_an_older_table_gains_the_new_columns_on_open(backend, tmp_path):
    old = [c for c in COLUMNS if c.name not in ("cached_steps", "step_cache", "adapters", "preview_every")]
    kinds = {"INTEGER": "BIGINT", "REAL": "DOUBLE PRECISION", "TEXT": "TEXT"} if backend.url else {}
    rowid = "rowid BIGINT GENERATED ALWAYS AS IDENTITY, " if backend.url else ""
    columns = ", ".join(
        f"{c.name} {kinds.get(c.sql_type, c.sql_type)}{' PRIMARY KEY' if c.name == 'id' else ''}" for c in old
    )
    if backend.url is None:
        tmp_path.mkdir(exist_ok=True)
        sqlite3.connect(tmp_path / STORE_FILE).close()
    backend.execute(tmp_path, f"CREATE TABLE jobs ({rowid}{columns})")
    values = {c.name: getattr(record("video_gen_old"), c.field) for c in old if c.part is None}
    values = {k: (v.value if isinstance(v, JobStatus) else v) for k, v in values.items() if v is not None}
    names = ", ".join(values)
    marks = ", ".join("?" * len(values))
    backend.execute(tmp_path, f"INSERT INTO jobs ({names}) VALUES ({marks})", (*values.values(),))
    store = backend.open(tmp_path)
    try:
        assert store.recovered == 1  # it was queued
        job = store.get("video_gen_old")
        assert (job.cached_steps, job.step_cache, job.adapters, job.preview_every) == (None, None, [], 0)
        store.update(job.id, cached_steps=[2])
        assert store.get(job.id).cached_steps == [2]
    finally:
        store.close()


def test_a_service_keeps_its_jobs_in_the_store_across_a_restart(backend, tmp_path):
    """The real app on the store H3_STORE names: an async job rendered, listed and downloaded; after a restart it is
    still there."""
    s = settings(tmp_path, startup_warmup=False, store=backend.url)
    with live_server(s) as server, FormClient(base_url=server.url) as c:
        job = c.post("/v1/videos", data={"prompt": "a kettle", "num_inference_steps": "2", "seed": "7"}).json()
        done = wait_status(c, job["id"], {"completed", "failed"})
        assert done["status"] == "completed", done
        mp4 = c.get(f"/v1/videos/{job['id']}/content").content
        assert mp4[4:8] == b"ftyp"
    with live_server(s) as server, FormClient(base_url=server.url) as c:
        assert [j["id"] for j in c.get("/v1/videos").json()["data"]] == [job["id"]]
        assert c.get(f"/v1/videos/{job['id']}/content").content == mp4
        assert c.delete(f"/v1/videos/{job['id']}").json()["deleted"] is True
        assert c.get("/v1/videos").json()["data"] == []
    assert list((tmp_path / "videos").glob("*.mp4")) == []
    assert (tmp_path / STORE_FILE).exists() == (backend.url is None)  # the records were where H3_STORE said


# ---- the PostgreSQL store alone -------------------------------------------------------------------------------------
def test_servers_share_a_database_and_a_second_running_server_of_the_same_name_is_refused(pg_url, tmp_path):
    """A fleet: two stores on one database, each with its own name; a second running store of a taken name (an
    H3_SERVER_ID set twice) is refused, at the start's check too, until the first closes."""
    from h3serve.service.store.postgres import PostgresJobStore, PostgresStoreError

    first = PostgresJobStore(pg_url, tmp_path / "one", server_id="alpha")
    second = PostgresJobStore(pg_url, tmp_path / "two")  # a generated name
    try:
        assert second.server_id != "alpha" and second.server_id.count("-") >= 1
        first.insert(record("video_gen_shared"))
        assert second.get("video_gen_shared") == first.get("video_gen_shared")
        with pytest.raises(PostgresStoreError, match="is named 'alpha' \\(H3_SERVER_ID\\)") as busy:
            PostgresJobStore(pg_url, tmp_path / "three", server_id="alpha")
        assert busy.value.busy
        with pytest.raises(PostgresStoreError, match="is named 'alpha'"):
            check_job_store(tmp_path / "three", pg_url, "alpha")
        check_job_store(tmp_path / "three", pg_url, "beta")
        from h3serve.errors import SettingError
        from h3serve.service.folders import _check_job_store

        with pytest.raises(SettingError, match="is named 'alpha'") as named:  # the service's start, before weights
            _check_job_store(tmp_path / "three", pg_url, "alpha")
        assert named.value.setting == "server_id"
    finally:
        first.close()
        second.close()
    check_job_store(tmp_path / "three", pg_url, "alpha")
    PostgresJobStore(pg_url, tmp_path / "three", server_id="alpha").close()


def test_the_table_is_the_record_fields_with_postgresql_types(pg_url, tmp_path):
    import psycopg

    open_store(tmp_path, pg_url).close()
    with psycopg.connect(pg_url) as db:
        table = db.execute(
            "SELECT column_name, data_type, is_nullable FROM information_schema.columns WHERE table_name='jobs' "
            "ORDER BY ordinal_position"
        ).fetchall()
    assert [name for name, _, _ in table] == ["rowid", *(c.name for c in COLUMNS)]
    kinds = {name: kind for name, kind, _ in table}
    assert (kinds["progress"], kinds["inference_time_s"], kinds["prompt"]) == ("bigint", "double precision", "text")
    not_null = {name for name, _, nullable in table if nullable == "NO"}
    assert {"id", "status", "created_at", "seed"} <= not_null and "completed_at" not in not_null


def test_a_foreign_table_a_sqlite_folder_and_a_nul_are_refused_by_name(pg_url, tmp_path):
    import psycopg

    from h3serve.service.store.postgres import PostgresJobStore, PostgresStoreError

    with psycopg.connect(pg_url, autocommit=True) as db:
        db.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT)")
    with pytest.raises(PostgresStoreError, match="not h3serve's: columns name"):
        PostgresJobStore(pg_url, tmp_path / "a")
    with psycopg.connect(pg_url, autocommit=True) as db:
        db.execute("DROP TABLE jobs")
    sqlite_folder = tmp_path / "b"
    sqlite_folder.mkdir()
    (sqlite_folder / STORE_FILE).write_bytes(b"")
    with pytest.raises(PostgresStoreError, match=f"holds a SQLite job store \\({STORE_FILE}\\)"):
        check_job_store(sqlite_folder, pg_url)
    store = PostgresJobStore(pg_url, tmp_path / "c")
    try:
        with pytest.raises(ValueRefused, match="prompt: PostgreSQL's text cannot hold the NUL character") as refused:
            store.insert(record("video_gen_nul", prompt="a\x00b"))
        assert refused.value.field == "prompt"
        assert store.list(10) == ([], False)
    finally:
        store.close()
    # Through the API: a 400 naming the parameter, and nothing queued.
    s = settings(tmp_path / "d", startup_warmup=False, store=pg_url)
    with live_server(s) as server, FormClient(base_url=server.url) as c:
        answer = c.post("/v1/videos", data={"prompt": "a\x00b", "num_inference_steps": "2"})
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, "prompt"), answer.text
        assert c.get("/v1/videos").json()["data"] == []


def test_the_store_setting_is_checked_before_anything_loads_and_its_password_never_shown(tmp_path, capsys):
    secret = "s3cretpw"
    for bad, words in (
        (f"mysql://u:{secret}@h/db", "got a mysql:// URL"),
        (f"postgresql://u:{secret}@h:port/db", "a port that is no number"),
        (f"postgresql://u:{secret}@h/db#x", "without a #fragment"),
    ):
        with pytest.raises(SettingsError) as refused:
            load_settings(env={"H3_STORE": bad})
        text = str(refused.value)
        assert "H3_STORE (--store)" in text and words in text and secret not in text, text
        assert refused.value.settings == ["store"]
    good = f"postgresql://h3:{secret}@db.example:5433/jobs?sslmode=require"
    assert url_problem(good) is None
    assert shown_url(good) == "postgresql://h3:***@db.example:5433/jobs?***"
    assert secret not in str(Settings(output_dir=tmp_path, store=good).resolved(resolve_device=False))
    # A server that does not answer: named by its URL, without the password, before any weight loads.
    from h3serve.service.store.postgres import PostgresStoreError

    with pytest.raises(PostgresStoreError, match="cannot connect") as down:
        check_job_store(tmp_path, f"postgresql://h3:{secret}@127.0.0.1:1/jobs?connect_timeout=2")
    assert secret not in str(down.value) and "postgresql://h3:***@127.0.0.1:1/jobs" in str(down.value)
    assert main(["store", "check", "--output-dir", str(tmp_path), "--store", "postgresql://h3@127.0.0.1:1/x"]) == 1
    assert "not yet on PostgreSQL" in capsys.readouterr().err
