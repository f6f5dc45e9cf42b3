"""The MP4s in S3-compatible storage (H3_OUTPUT_URL, service/store/objects.py) against a real `rclone serve s3`
(tests/s3_fixtures.py), with real tiny-model renders on loopback servers: the object is the bytes of the local-folder
render of the same request; /content streams it with byte ranges (and the local path takes the same ranges), or
redirects to a signed URL; DELETE removes it; a failed or cancelled upload leaves no object; `store check`/`rebuild`
report a record whose object is missing; the start refuses a bad URL, a missing bucket, an endpoint that does not
answer and missing credentials, naming the setting."""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

import httpx
import pytest

from h3serve.cli import main
from h3serve.errors import SettingError
from h3serve.pipeline.context import RenderCancelled
from h3serve.service.store import inspect_store, rebuild_store
from h3serve.service.store.objects import S3Outputs, UploadFailed, check_outputs
from h3serve.settings import SettingsError, load_settings
from s3_fixtures import aws_env, s3_server_at, s3_server_fixture  # noqa: F401 (the session's `s3_server`)
from service_fixtures import free_port, live_server, settings, wait_status

JOB = {"prompt": "a lighthouse at dusk, waves on rocks", "width": "224", "height": "128",
       "num_inference_steps": "3", "seed": "7"}  # fmt: skip


def _s3_settings(output_dir: Path, server, bucket: str, prefix: str = "renders/h3", **more):
    return settings(output_dir, startup_warmup=False, output_url=f"s3://{bucket}/{prefix}",
                    s3_endpoint=server.endpoint, **more)  # fmt: skip


@contextlib.contextmanager
def _s3_live(output_dir: Path, server, bucket: str, prefix: str = "renders/h3", **more):
    """A loopback server whose MP4s go to `bucket`/`prefix` on `server` (its credentials in the AWS_* variables)."""
    with aws_env(server), live_server(_s3_settings(output_dir, server, bucket, prefix, **more)) as s:
        yield s


def _render(client: httpx.Client, job: dict = JOB) -> dict:
    r = client.post("/v1/videos", data=job)
    assert r.status_code == 200, r.text
    return wait_status(client, r.json()["id"], {"completed", "failed"})


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:
    return s3_server.bucket()


@pytest.fixture(scope="module")
def servers(s3_server, bucket, tmp_path_factory):
    """A local-folder server and an S3 one, each with one completed render of JOB: (local, s3, local job, s3 job)."""
    with (
        live_server(settings(tmp_path_factory.mktemp("local"), startup_warmup=False)) as local,
        _s3_live(tmp_path_factory.mktemp("s3"), s3_server, bucket) as remote,
    ):
        with local.client() as a, remote.client() as b:
            one, two = _render(a), _render(b)
        assert one["status"] == two["status"] == "completed", (one, two)
        yield local, remote, one, two


def test_the_object_is_the_local_render_bitwise_and_content_streams_it(servers, s3_server, bucket):
    local, remote, one, two = servers
    with local.client() as a, remote.client() as b:
        mine, theirs = a.get(f"/v1/videos/{one['id']}/content"), b.get(f"/v1/videos/{two['id']}/content")
    assert mine.status_code == theirs.status_code == 200
    assert theirs.content == mine.content and len(mine.content) > 1000
    assert theirs.headers["content-type"] == "video/mp4" and theirs.headers["accept-ranges"] == "bytes"
    key = f"renders/h3/{two['id']}.mp4"
    assert s3_server.keys(bucket, "renders/h3/") == [key]
    assert s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read() == mine.content
    # Nothing of the MP4 in the S3 server's output folder: only the record beside where the MP4 would be.
    videos = remote.app.state.store.videos
    assert sorted(p.name for p in videos.iterdir()) == [f"{two['id']}.json"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_byte_ranges_on_both_stores(servers, where):
    local, remote, one, two = servers
    server, job = (local, one) if where == "local" else (remote, two)
    url = f"/v1/videos/{job['id']}/content"
    with server.client() as c:
        whole = c.get(url).content
        size, etag = len(whole), c.get(url).headers["etag"]
        part = c.get(url, headers={"Range": "bytes=10-99"})
        assert part.status_code == 206 and part.content == whole[10:100]
        assert part.headers["content-range"] == f"bytes 10-99/{size}" and part.headers["content-length"] == "90"
        tail = c.get(url, headers={"Range": "bytes=-100"})
        assert tail.status_code == 206 and tail.content == whole[-100:]
        rest = c.get(url, headers={"Range": f"bytes={size - 5}-"})
        assert rest.status_code == 206 and rest.content == whole[-5:]
        clipped = c.get(url, headers={"Range": f"bytes={size - 3}-{size + 50}"})
        assert (
            clipped.headers["content-range"] == f"bytes {size - 3}-{size - 1}/{size}" and clipped.content == whole[-3:]
        )
        beyond = c.get(url, headers={"Range": f"bytes={size}-"})
        assert beyond.status_code == 416 and beyond.headers["content-range"] == f"bytes */{size}"
        assert beyond.json()["error"]["code"] == "range_not_satisfiable"
        for ignored in ("bytes=0-1,5-9", "items=0-9", "bytes=9-2", "bytes=x-"):  # RFC 9110: ignored, sent whole
            r = c.get(url, headers={"Range": ignored})
            assert (r.status_code, r.content) == (200, whole), ignored
        stale = c.get(url, headers={"Range": "bytes=0-9", "If-Range": '"another"'})
        assert (stale.status_code, stale.content) == (200, whole)
        fresh = c.get(url, headers={"Range": "bytes=0-9", "If-Range": etag})
        assert (fresh.status_code, fresh.content) == (206, whole[:10])


def test_presign_mode_redirects_to_a_signed_url_that_downloads(servers, s3_server, bucket, tmp_path):
    _, remote, _, two = servers
    expected = s3_server.client().get_object(Bucket=bucket, Key=f"renders/h3/{two['id']}.mp4")["Body"].read()
    # A second server on the same bucket and prefix (the same object), answering with signed URLs.
    with _s3_live(tmp_path, s3_server, bucket, s3_presign=60) as presigning, presigning.client() as c:
        # Its store is its own: give it the record the first server wrote, as a shared store would hold it.
        presigning.app.state.store.insert(remote.app.state.store.get(two["id"]))
        r = c.get(f"/v1/videos/{two['id']}/content", follow_redirects=False)
    assert r.status_code == 307 and r.headers["cache-control"] == "no-store"
    location = r.headers["location"]
    assert location.startswith(f"{s3_server.endpoint}/{bucket}/renders/h3/{two['id']}.mp4?")
    assert "X-Amz-Signature=" in location and "X-Amz-Expires=60" in location
    got = httpx.get(location)
    assert got.status_code == 200 and got.content == expected
    assert got.headers["content-disposition"] == f'attachment; filename="{two["id"]}.mp4"'
    assert httpx.get(location.split("?")[0]).status_code in (400, 401, 403)  # the bare URL: refused


def test_delete_removes_the_record_and_the_object(s3_server, bucket, tmp_path):
    with _s3_live(tmp_path, s3_server, bucket, "deleting") as s, s.client() as c:
        job = _render(c)
        assert job["status"] == "completed"
        assert s3_server.keys(bucket, "deleting/") == [f"deleting/{job['id']}.mp4"]
        r = c.delete(f"/v1/videos/{job['id']}")
        assert r.status_code == 200 and r.json()["deleted"] is True
        assert s3_server.keys(bucket, "deleting/") == []
        assert c.get(f"/v1/videos/{job['id']}").status_code == 404
        assert c.get(f"/v1/videos/{job['id']}/content").status_code == 404


def test_an_object_gone_from_the_bucket_is_a_410(s3_server, bucket, tmp_path):
    with _s3_live(tmp_path, s3_server, bucket, "vanishing") as s, s.client() as c:
        job = _render(c)
        s3_server.client().delete_object(Bucket=bucket, Key=f"vanishing/{job['id']}.mp4")
        r = c.get(f"/v1/videos/{job['id']}/content")
    assert r.status_code == 410 and r.json()["error"]["code"] == "gone"


def test_a_server_stopped_before_the_upload_fails_the_job_and_leaves_no_object(tmp_path):
    root, port = tmp_path / "s3data", free_port()
    with s3_server_at(root, port) as own:
        name = own.bucket()
        with _s3_live(tmp_path / "out", own, name, "failing") as s, s.client() as c:
            own.stop()  # the bucket's server goes away before the job's MP4 is uploaded
            job = _render(c)
            assert job["status"] == "failed" and job["file_name"] is None
            assert job["error"]["code"] == "upload_failed"
            assert "could not be stored in the output bucket" in job["error"]["message"]
            assert "127.0.0.1" not in job["error"]["message"]  # no endpoint in a client's message
            own.start()  # the same folder and port again: nothing was left under the prefix
            assert own.keys(name, "failing/") == []
            assert c.get(f"/v1/videos/{job['id']}/content").status_code == 409


def _file(path: Path, size: int) -> Path:
    path.write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    return path


def test_an_upload_cut_mid_way_leaves_no_object(tmp_path):
    """The server stops after the first of three parts went up: UploadFailed, and once it is back no object."""
    root, port = tmp_path / "s3data", free_port()
    with s3_server_at(root, port) as own:
        name = own.bucket()
        with aws_env(own):
            outputs = S3Outputs(f"s3://{name}/cut", own.endpoint, part_bytes=5 << 20, attempts=1)
        source = _file(tmp_path / "big.mp4", (12 << 20) + 123)
        parts = []

        def check() -> None:
            parts.append(1)
            if len(parts) == 2:  # before the second part
                own.stop()

        with pytest.raises(UploadFailed):
            outputs.upload(source, "video_gen_" + "a" * 32 + ".mp4", check)
        assert len(parts) == 2  # the first part went up; the second met the stopped server
        own.start()
        assert own.keys(name) == []


def test_a_multipart_upload_is_whole_and_a_cancel_mid_way_aborts_it(s3_server, bucket, tmp_path):
    with aws_env(s3_server):
        outputs = S3Outputs(f"s3://{bucket}/parts", s3_server.endpoint, part_bytes=5 << 20)
    source = _file(tmp_path / "big.mp4", (11 << 20) + 7)
    seen: list[list[str]] = []  # what the bucket lists before each part, and before the completion
    outputs.upload(source, "whole.mp4", lambda: seen.append(s3_server.keys(bucket, "parts/")))
    assert seen == [[], [], [], []]  # 3 parts: invisible until complete
    got = s3_server.client().get_object(Bucket=bucket, Key="parts/whole.mp4")["Body"].read()
    assert got == source.read_bytes()
    calls = []

    def cancel() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RenderCancelled("cancelled")

    with pytest.raises(RenderCancelled):
        outputs.upload(source, "cancelled.mp4", cancel)
    assert s3_server.keys(bucket, "parts/") == ["parts/whole.mp4"]
    assert outputs.listing().incomplete == []  # aborted, not left behind


def test_store_check_and_rebuild_report_a_missing_object_and_an_unrecorded_one(s3_server, bucket, tmp_path, capsys):
    out = tmp_path / "out"
    with _s3_live(out, s3_server, bucket, "checked") as s, s.client() as c:
        kept, lost = _render(c), _render(c)
    client = s3_server.client()
    client.delete_object(Bucket=bucket, Key=f"checked/{lost['id']}.mp4")
    stray = f"video_gen_{uuid.uuid4().hex}"
    client.put_object(Bucket=bucket, Key=f"checked/{stray}.mp4", Body=b"not a render")
    with aws_env(s3_server):
        outputs = S3Outputs(f"s3://{bucket}/checked", s3_server.endpoint)
        report = inspect_store(out, outputs=outputs)
        assert report.missing_mp4s == [lost["id"]]
        assert report.unrecorded_objects == [stray] and sorted(report.objects) == sorted([kept["id"], stray])
        assert not report.refusals()  # as a local MP4 gone: its download says so (410), no start is refused
        lines = "\n".join(report.lines())
        assert f"completed record whose MP4 is missing: {lost['id']}" in lines
        assert f"object without a record in the store: s3://{bucket}/checked/{stray}.mp4" in lines

        flags = [
            "--output-dir",
            str(out),
            "--output-url",
            f"s3://{bucket}/checked",
            "--s3-endpoint",
            s3_server.endpoint,
        ]
        assert main(["store", "check", *flags]) == 0
        printed = capsys.readouterr().out
        assert f"completed record whose MP4 is missing: {lost['id']}" in printed
        assert f"objects: 2 MP4(s) in s3://{bucket}/checked/" in printed

        rebuilt = rebuild_store(out, outputs=outputs)
        assert rebuilt.missing_objects == [lost["id"]] and rebuilt.unrecorded_objects == [stray]
        assert any(lost["id"] in line and "missing" in line for line in rebuilt.lines(out / "jobs.sqlite3"))
    assert s3_server.keys(bucket, "checked/") == sorted(f"checked/{i}.mp4" for i in (kept["id"], stray))  # untouched


def test_a_bucket_that_cannot_be_listed_fails_the_check(tmp_path):
    with s3_server_at() as own:
        name = own.bucket()
        with aws_env(own):
            outputs = S3Outputs(f"s3://{name}/x", own.endpoint, attempts=1)
    report = inspect_store(tmp_path, outputs=outputs)  # the server has stopped
    assert report.objects_problem and "cannot be listed" in report.objects_problem
    assert report.refusals() == [report.objects_problem]


# ---- the settings and the start's check -----------------------------------------------------------------------------
def _refused(env: dict[str, str]) -> SettingsError:
    with pytest.raises(SettingsError) as caught:
        load_settings(env=env)
    return caught.value


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("http://bucket/prefix", "s3://BUCKET"),
        ("s3://Upper_Case/x", "no S3 bucket name"),
        ("s3://bucket/a/../b", "'..'"),
        ("s3://key:secret@bucket/x", "no user"),
        ("s3://bucket/x?versionId=1", "no user, port, ?query"),
    ],
)
def test_a_bad_output_url_is_refused_naming_the_setting(value, words):
    err = _refused({"H3_OUTPUT_URL": value})
    assert err.settings == ["output_url"] and "H3_OUTPUT_URL" in str(err) and words in str(err)


def test_s3_settings_without_an_output_url_and_a_bad_endpoint_are_refused():
    err = _refused({"H3_S3_PRESIGN": "60", "H3_S3_ENDPOINT": "http://127.0.0.1:9"})
    assert sorted(err.settings) == ["s3_endpoint", "s3_presign"] and "only with H3_OUTPUT_URL" in str(err)
    err = _refused({"H3_OUTPUT_URL": "s3://bucket", "H3_S3_ENDPOINT": "ftp://host"})
    assert err.settings == ["s3_endpoint"]
    assert _refused({"H3_OUTPUT_URL": "s3://bucket", "H3_S3_PRESIGN": "7200"}).settings == ["s3_presign"]
    s = load_settings(env={"H3_OUTPUT_URL": "s3://my-bucket/a/b/", "H3_S3_PRESIGN": "300"})
    assert (s.output_url, s.s3_presign) == ("s3://my-bucket/a/b/", 300)


def test_the_start_refuses_a_missing_bucket_an_unanswering_endpoint_and_no_credentials(s3_server, bucket, tmp_path):
    with aws_env(s3_server):
        check_outputs(_s3_settings(tmp_path, s3_server, bucket))  # sound: nothing raised, nothing left
        with pytest.raises(SettingError) as caught:
            check_outputs(_s3_settings(tmp_path, s3_server, "no-such-bucket-here"))
        assert caught.value.setting == "output_url" and "does not exist" in str(caught.value)
        nobody = settings(tmp_path, output_url=f"s3://{bucket}/x", s3_endpoint=f"http://127.0.0.1:{free_port()}")
        with pytest.raises(SettingError) as caught:
            check_outputs(nobody)
        assert caught.value.setting == "s3_endpoint" and "did not answer" in str(caught.value)
    with aws_env(s3_server), pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(SettingError) as caught:
            check_outputs(_s3_settings(tmp_path, s3_server, bucket))
        assert caught.value.setting == "output_url" and "access denied" in str(caught.value)
        mp.delenv("AWS_ACCESS_KEY_ID")
        mp.delenv("AWS_SECRET_ACCESS_KEY")
        with pytest.raises(SettingError) as caught:
            check_outputs(_s3_settings(tmp_path, s3_server, bucket))
        assert caught.value.setting == "output_url" and "no AWS credentials" in str(caught.value)
    assert s3_server.keys(bucket, "renders/h3/.h3serve-probe") == []
