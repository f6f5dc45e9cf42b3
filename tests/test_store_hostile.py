"""The output folder against a hostile hand (issue 54, fourth round): record files that name a path outside videos/,
that are no regular file, too large, a link, or named as no job is; `store rebuild` beside a live server; a locked
store; `videos` that is not a folder. Real folders made by a real server on loopback (tests/test_store_damage.py's),
real files and locks; nothing mocked."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import test_store_damage as damage
from h3serve.cli import main
from h3serve.service.store import STORE_FILE, JobStore
from service_fixtures import live_server, settings, wait_status
from test_store_damage import completed, damage_row, preflight, store_cli, stored

made = damage.made  # the server-made folder (module-scoped), and a fresh copy of it per test
folder = damage.folder

# Over the most a record file may hold (store.RECORD_CAP, 4 MiB): the hostile pass's 300 MB record, made small.
OVERSIZED = 8 << 20
# The child's data segment limit when a rebuild runs apart (`rebuild_apart`): its imports need 250 MB, and a reader of
# /dev/zero that does not stop fails at this limit instead of taking the machine's memory.
CHILD_DATA = 1 << 30
CHILD = (
    "import resource, sys; resource.setrlimit(resource.RLIMIT_DATA, ({limit}, {limit})); "
    "from h3serve.cli import main; sys.exit(main(sys.argv[1:]))"
)


def job_id(first: str = "") -> str:
    """A job id of the server's shape; `first` fixes its first hex digits (so that ids sort as a test needs)."""
    return f"video_gen_{(first + uuid.uuid4().hex)[:32]}"


def a_record(out: Path, records: dict[str, dict], new_id: str, **changes) -> dict:
    """A finished job's record as the server writes it (a copy of a failed one's shape), under a new id."""
    base = json.loads((out / "videos" / f"{completed(records)[0]}.json").read_text())
    return {**base, "id": new_id, "status": "failed", "file_name": None, **changes}


def rebuild_apart(out: Path, *more: str) -> subprocess.CompletedProcess:
    """`h3serve store rebuild` in a process of its own: a rebuild that read a FIFO would wait forever, one that read
    /dev/zero would take all memory (the data limit ends it; the timeout ends a wait that never would)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("H3_")}
    code = CHILD.format(limit=CHILD_DATA)
    return subprocess.run(
        [sys.executable, "-c", code, "store", "rebuild", "--output-dir", str(out), *more],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


# ---- finding 3: a record's file name ---------------------------------------------------------------------------
def test_a_record_naming_a_file_outside_videos_is_skipped_never_served_nor_deleted(made, folder, capsys):
    _, records = made
    victim = folder.parent / "victim.txt"  # videos/../../victim.txt
    victim.write_text("not the server's")
    hostile, other = completed(records)[0], completed(records)[1]
    sidecar = folder / "videos" / f"{hostile}.json"
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "file_name": "../../victim.txt"}))
    (folder / STORE_FILE).write_bytes(b"")  # lost: the records in videos/ are all a rebuild has

    code, out = store_cli(capsys, "rebuild", folder)
    assert code == 0, out
    with live_server(settings(folder)) as s, s.client() as c:
        assert c.get(f"/v1/videos/{hostile}/content").status_code == 404
        assert c.delete(f"/v1/videos/{hostile}").status_code == 404
    assert victim.read_text() == "not the server's"
    assert f'record skipped: "videos/{hostile}.json": file_name: not this job\'s MP4' in out
    assert hostile not in stored(folder) and other in stored(folder)
    (unrecorded,) = folder.glob("unrecorded-*")
    assert sorted(p.name for p in unrecorded.iterdir()) == sorted([f"{hostile}.json", f"{hostile}.mp4"])

    # A row of the store that names such a file is a damaged row: the start refuses it, nothing is served from it.
    damage_row(folder, "UPDATE jobs SET file_name='../../victim.txt' WHERE id=?", other)
    code, err = preflight(capsys, folder)
    assert code == 1 and f"(id {other}): file_name: not this job's MP4" in err
    code, out = store_cli(capsys, "rebuild", folder)
    assert code == 0, out
    assert stored(folder)[other]["file_name"] == f"{other}.mp4"  # its record file is the one that came back
    assert victim.read_text() == "not the server's"

    # A row whose id itself is a path (and its file_name that id's MP4, so the name rule alone would pass it) is
    # damaged too: the id names videos/<id>.mp4 and previews/<id>.png.
    damage_row(folder, "UPDATE jobs SET id='../../victim', file_name='../../victim.mp4' WHERE id=?", other)
    code, err = preflight(capsys, folder)
    assert code == 1 and "id: not a plain name" in err, err
    assert victim.read_text() == "not the server's"


# ---- finding 4: what a record file is --------------------------------------------------------------------------
def test_rebuild_reads_no_fifo_device_link_or_oversized_record_and_lists_each(made, folder, tmp_path, capsys):
    _, records = made
    videos = folder / "videos"
    # Named so that the device comes first: a rebuild that reads it fails there, before the FIFO would hold it.
    device, fifo, linked, big = job_id("0"), job_id("f"), job_id("a"), job_id("b")
    os.symlink("/dev/zero", videos / f"{device}.json")
    os.mkfifo(videos / f"{fifo}.json")
    outside = tmp_path / "outside.json"  # a sound record, but outside videos/
    outside.write_text(json.dumps(a_record(folder, records, linked)))
    os.symlink(outside, videos / f"{linked}.json")
    (videos / f"{big}.json").write_text(json.dumps(a_record(folder, records, big, prompt="x" * OVERSIZED)))

    proc = rebuild_apart(folder)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert f'"videos/{device}.json": is a symbolic link, not a regular file' in out
    assert f'"videos/{fifo}.json": is a FIFO, not a regular file' in out
    assert f'"videos/{linked}.json": is a symbolic link, not a regular file' in out
    assert f'"videos/{big}.json": is 8 MiB' in out and "over the cap of 4 MiB" in out
    assert set(stored(folder)) == set(records)  # the hostile ones are not jobs; every real one is back
    (unrecorded,) = folder.glob("unrecorded-*")
    assert sorted(p.name for p in unrecorded.iterdir()) == sorted(f"{i}.json" for i in (device, fifo, linked, big))
    assert (unrecorded / f"{linked}.json").is_symlink() and outside.is_file()  # moved, never followed
    assert store_cli(capsys, "check", folder)[0] == 0


# ---- finding 5: a rebuild never stops halfway ------------------------------------------------------------------
def test_a_record_named_a_colon_b_or_holding_values_sqlite_cannot_take_never_stops_a_rebuild(made, folder, capsys):
    _, records = made
    videos = folder / "videos"
    (videos / "a:b.json").write_text("{}")
    huge, surrogate = job_id(), job_id()
    (videos / f"{huge}.json").write_text(json.dumps(a_record(folder, records, huge, seed=1 << 70)))
    (videos / f"{surrogate}.json").write_text(
        json.dumps(a_record(folder, records, surrogate)).replace('"prompt": "', '"prompt": "\\ud800')
    )
    (folder / STORE_FILE).write_bytes(b"")  # lost: a rebuild is due

    code, out = store_cli(capsys, "rebuild", folder)
    assert code == 0, out
    assert '"videos/a:b.json" (its name is no job id' in out
    assert f'"videos/{huge}.json": seed: an integer beyond SQLite\'s 64 bits' in out
    assert f'"videos/{surrogate}.json": ' in out  # refused by the JSON reader or as text SQLite cannot hold
    assert set(stored(folder)) == set(records)
    code, out = store_cli(capsys, "rebuild", folder, "--force")  # and again: nothing left to stop on
    assert code == 0 and '"videos/a:b.json" (its name is no job id' in out
    assert (videos / "a:b.json").read_text() == "{}"  # not ours: left where it is
    assert not list(folder.glob(".*.tmp"))  # no half-built store left behind
    assert preflight(capsys, folder)[0] == 0


# ---- finding 6: a rebuild beside a live server -----------------------------------------------------------------
def test_store_rebuild_is_refused_while_a_server_uses_the_folder_force_or_not(made, folder, capsys):
    _, records = made
    gone = completed(records)[0]
    with live_server(settings(folder)) as s, s.client() as c:
        for more in (("--force",), ()):
            code = main(["store", "rebuild", "--output-dir", str(folder), *more])
            err = capsys.readouterr().err
            assert code == 1
            assert f"{folder / 'h3serve.lock'}: the output folder is in use by h3serve server, pid {os.getpid()}" in err
            assert "Nothing was changed" in err
        assert not list(folder.glob(f"{STORE_FILE}.damaged-*"))
        new = c.post("/v1/videos", data={"prompt": "after the refused rebuild", "num_inference_steps": "2"}).json()
        wait_status(c, new["id"], {"completed"})
        assert c.delete(f"/v1/videos/{gone}").json()["deleted"] is True
    after = stored(folder)
    assert new["id"] in after and gone not in after
    code, out = store_cli(capsys, "rebuild", folder, "--force")  # the server gone, the lock is free
    assert code == 0, out
    after = stored(folder)
    assert new["id"] in after and gone not in after


# ---- warts -----------------------------------------------------------------------------------------------------
def test_a_json_in_videos_that_is_no_jobs_record_is_listed_as_ignored_and_does_not_refuse_the_start(folder, capsys):
    (folder / "videos" / "notes.json").write_text("the operator's notes")
    code, err = preflight(capsys, folder)
    assert code == 0, err
    code, out = store_cli(capsys, "check", folder)
    assert code == 0 and '  ignored: "videos/notes.json" (its name is no job id' in out
    # A record of the server's name that the store lacks is still refused: a job's record is never ignored.
    (folder / "videos" / f"{job_id()}.json").write_text("{damaged")
    code, err = preflight(capsys, folder)
    assert code == 1 and "have their record in videos/ but not in the store" in err


def test_store_check_calls_videos_that_is_no_folder_damage_and_rebuild_changes_nothing(folder, capsys):
    videos = folder / "videos"
    shutil.rmtree(videos)
    videos.write_text("a file where the folder was")
    before = (folder / STORE_FILE).read_bytes()
    code, out = store_cli(capsys, "check", folder)
    assert code == 1 and f"damaged: {videos} is not a folder" in out and "verdict: damaged" in out
    code = main(["store", "rebuild", "--output-dir", str(folder)])
    assert code == 1 and "is not a folder" in capsys.readouterr().err
    assert (folder / STORE_FILE).read_bytes() == before and videos.read_text() == "a file where the folder was"


def test_a_locked_store_and_a_second_server_are_refused_naming_the_output_folder_before_any_weight_loads(
    folder, capsys
):
    # Another process's write transaction (a sqlite3 shell left in BEGIN): the server's first write would wait on it.
    db = sqlite3.connect(folder / STORE_FILE, isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")
    try:
        code, err = preflight(capsys, folder)
    finally:
        db.execute("ROLLBACK")
        db.close()
    assert code == 1
    assert f"H3_OUTPUT_DIR (--output-dir): {folder / STORE_FILE}: locked by another process" in err
    assert "close whatever holds it" in err

    # A server's store holds the folder: a second start on it is refused at its check, before anything loads.
    store = JobStore(folder)
    try:
        code, err = preflight(capsys, folder)
    finally:
        store.close()
    assert code == 1
    assert f"H3_OUTPUT_DIR (--output-dir): {folder / 'h3serve.lock'}: the output folder is in use by h3serve " in err
    assert "stop that one first, or use another output folder" in err
    assert preflight(capsys, folder)[0] == 0  # closed: free again


def test_store_alone_names_its_subcommands(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["store"])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert "store_command" not in err and "{check,rebuild}" in err
