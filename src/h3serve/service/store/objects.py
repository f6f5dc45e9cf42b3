"""Where the async jobs' MP4s are kept (issue 58): `LocalOutputs`, the output folder's videos/ (the default, as
before), or `S3Outputs`, a bucket and prefix on S3 or any S3-compatible server (H3_OUTPUT_URL=s3://BUCKET/PREFIX,
H3_S3_ENDPOINT, the credentials and region from the standard AWS_* variables, a profile or an instance role).

    write    the encoder's MP4, visible whole or not at all: local, written under a temporary name and renamed; S3, a
             multipart upload completed only when every part is up, and aborted (and the key deleted) on any failure
             or cancel, so no half object is ever listed or served
    open     a stored MP4 for /content: its size, its ETag and a reader of any byte range (`Opened`)
    presign  (S3) a GET URL signed for a bounded time (H3_S3_PRESIGN), never an unsigned one
    delete   the MP4 of a job whose record goes (S3: before the record, so a DELETE that fails can be sent again)
    listing  (S3) the job MP4s under the prefix and the uploads never completed, for `store check` and `rebuild`

The MP4 is uploaded once it is encoded, in PART_BYTES parts, not while it is encoded: the MP4 is written with its
`moov` first (faststart, the output contract), and FFmpeg writes `moov` last and then moves it to the front of the
file, so no byte of the final file is known before the encode ends. The encode goes to the temporary folder
(`folders.service_folders`' "temp") and is removed after the upload, whatever happens.

The library is boto3 (with botocore), not obstore: boto3 exposes the multipart upload's steps one by one (create,
part, complete, abort), so a failed or cancelled upload is aborted by this code, at the point it knows it failed, and
a cancel is seen between parts; it signs presigned URLs with SigV4 and reads the standard AWS configuration (variables,
profiles, instance roles) as every AWS tool does; and it was checked against the S3-compatible servers the tests run
(../shared/h3/TEST_SERVERS.md). It is imported only when H3_OUTPUT_URL is set. Checksums are asked for and checked
only where S3 requires them (`when_required`): S3-compatible servers differ in what they send back, and a range read
from one (rclone's) carries the whole object's checksum, which botocore's default would refuse.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from h3serve.errors import SettingError
from h3serve.service.store.rows import JOB_ID, MP4
from h3serve.settings import Settings, split_output_url

log = logging.getLogger(__name__)

MP4_TYPE = "video/mp4"
# S3's parts are 5 MiB at least (all but the last) and 10,000 at most: 8 MiB parts hold an 80 GB MP4, far above the
# largest render (362 frames at 1344x768 are a few hundred MB at the encoder's rates).
PART_BYTES = 8 << 20
PROBE_PREFIX = ".h3serve-probe-"  # the start's probe key (an upload begun and aborted: never an object)
START_TIMEOUT_S = 10  # the start's check: seconds to connect, and to read an answer, with no retry
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
ATTEMPTS = 3  # botocore's standard retry mode: each request up to 3 times, with backoff, on throttling and drops
POOL = 32  # connections: each /content streaming from the bucket holds one for its download


class ObjectGone(Exception):
    """A job's MP4 that is not in the store (deleted since its record was read, or lost)."""


class ObjectsUnavailable(Exception):
    """The bucket did not do what a route asked (it did not answer, or refused): `reason` in words a client may see
    (S3's error code, or the connection's trouble; no endpoint, key or credentials). A retry may succeed."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class UploadFailed(Exception):
    """An MP4 that could not be stored in the bucket; `reason` is S3's error code or the connection's trouble, in words
    a client may see (no endpoint, key or credentials)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Body(Protocol):
    def read(self, size: int) -> bytes: ...

    def close(self) -> None: ...


class Opened(Protocol):
    """A stored MP4 opened for sending: its `size`, an `etag` (the validator If-Range compares) and a reader of the
    bytes [start, start + length) (`body`), which the response closes. `close` lets go of what `body` was not asked
    for."""

    size: int
    etag: str

    def body(self, start: int, length: int) -> Body: ...

    def close(self) -> None: ...


class OutputObjects(Protocol):
    """Where the async jobs' MP4s are kept: `LocalOutputs` or `S3Outputs`. `where`: how the log and the reports name
    it. `remote`: the MP4s are not in videos/."""

    where: str
    remote: bool

    def write(self, name: str, encode: Callable[[Path], Any], check: Callable[[], None] | None = None) -> None: ...

    def open(self, name: str) -> Opened: ...

    def presign(self, name: str, seconds: int) -> str: ...

    def delete(self, name: str) -> None: ...


# ---- the output folder -----------------------------------------------------------------------------------------------
class LocalOutputs:
    """videos/ in the output folder: `write_mp4` writes under a temporary name there and renames the file when
    complete. The store's `delete` removes the file (after its record; a start removes an MP4 no record names)."""

    remote = False

    def __init__(self, videos: Path):
        self.videos = videos
        self.where = str(videos)

    def write(self, name: str, encode: Callable[[Path], Any], check: Callable[[], None] | None = None) -> None:
        encode(self.videos / name)  # atomic: a failed or cancelled write leaves no file

    def open(self, name: str) -> LocalOpened:
        return LocalOpened(open_regular(self.videos / name))

    def presign(self, name: str, seconds: int) -> str:
        raise ValueError("an MP4 in the output folder has no presigned URL (H3_S3_PRESIGN needs H3_OUTPUT_URL)")

    def delete(self, name: str) -> None:
        (self.videos / name).unlink(missing_ok=True)


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading if it is a regular file the server could have written: never through a symbolic
    link (something put at `videos/<id>.mp4` by hand must not make `/content` serve a file outside the folder), and
    never blocking on a FIFO. OSError otherwise (ELOOP for a link, EINVAL for anything else not regular)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")  # closed by the response: when sent, or when dropped unsent
    except BaseException:
        os.close(fd)
        raise


class LocalOpened:
    """An MP4 file held open: its length is the open file's (fstat), which no later unlink changes (POSIX), so a
    download answered 200 always sends its whole Content-Length, whatever a racing DELETE does."""

    def __init__(self, fh: BinaryIO):
        self.fh = fh
        st = os.fstat(fh.fileno())
        self.size = st.st_size
        self.etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}"'  # the file is never rewritten in place: size and time

    def body(self, start: int, length: int) -> Body:
        self.fh.seek(start)
        return self.fh

    def close(self) -> None:
        self.fh.close()


# ---- S3 --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Listing:
    """What `S3Outputs.listing` found under the prefix: the job ids with an MP4 (`<id>.mp4`), the other keys directly
    under it (left alone), and the multipart uploads never completed or aborted (a server killed mid-upload)."""

    ids: list[str]
    others: list[str]
    incomplete: list[str]


class S3Outputs:
    """A bucket and prefix (`s3://BUCKET/PREFIX`) on S3 or an S3-compatible server (`endpoint`). One boto3 client,
    shared by the encoder and the routes' threads (botocore's clients are thread-safe)."""

    remote = True

    def __init__(
        self,
        url: str,
        endpoint: str | None = None,
        *,
        part_bytes: int = PART_BYTES,
        attempts: int = ATTEMPTS,
        timeout: float | None = None,
    ):
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = split_output_url(url)
        self.endpoint = endpoint
        self.part_bytes = part_bytes
        self.where = f"s3://{self.bucket}/{self.prefix}" + (f" at {endpoint}" if endpoint else "")
        config = Config(
            signature_version="s3v4",  # presigned URLs too: never the legacy SigV2 query form
            # An S3-compatible server is named by its address: path-style keeps the bucket out of the host name.
            s3={"addressing_style": "path" if endpoint else "auto"},
            retries={"max_attempts": attempts, "mode": "standard"},
            connect_timeout=timeout or CONNECT_TIMEOUT_S,
            read_timeout=timeout or READ_TIMEOUT_S,
            max_pool_connections=POOL,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.session = boto3.session.Session()
        self.client = self.session.client("s3", endpoint_url=endpoint, config=config)

    @classmethod
    def of(cls, settings: Settings, **options: Any) -> S3Outputs:
        assert settings.output_url is not None
        return cls(settings.output_url, settings.s3_endpoint, **options)

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def url(self, name: str) -> str:
        """The object as `store check` names it (s3://BUCKET/KEY: no endpoint, nothing signed)."""
        return f"s3://{self.bucket}/{self.key(name)}"

    # ---- writing -------------------------------------------------------------------------------------------
    def write(self, name: str, encode: Callable[[Path], Any], check: Callable[[], None] | None = None) -> None:
        """Encode into the temporary folder, then `upload` (the file is removed after, whatever happens)."""
        with tempfile.TemporaryDirectory(prefix="h3serve-upload-") as folder:
            path = Path(folder) / name
            encode(path)
            self.upload(path, name, check)

    def upload(self, path: Path, name: str, check: Callable[[], None] | None = None) -> None:
        """`path` to the object `name` by multipart upload, PART_BYTES a part, `check` called before each part
        (whatever it raises stops the upload: a cancel). The object exists only once the upload completes; on any
        failure the upload is aborted and the key deleted (a completion whose answer was lost may have made it), and
        UploadFailed says why (or the error `check` raised goes on)."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.key(name)
        try:
            upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key, ContentType=MP4_TYPE)["UploadId"]
        except (BotoCoreError, ClientError) as err:
            raise UploadFailed(reason(err)) from err
        try:
            parts = []
            with open(path, "rb") as fh:
                while chunk := fh.read(self.part_bytes):
                    if check is not None:
                        check()
                    number = len(parts) + 1
                    answer = self.client.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=number, Body=chunk
                    )
                    parts.append({"PartNumber": number, "ETag": answer["ETag"]})
            if check is not None:
                check()
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
            )
        except BaseException as err:
            self._discard(key, upload)
            if isinstance(err, (BotoCoreError, ClientError)):
                raise UploadFailed(reason(err)) from err
            raise

    def _discard(self, key: str, upload: str) -> None:
        """A failed upload's parts and key go; a failure here is logged (the parts stay until a lifecycle rule, or
        `store check` lists them), never raised over the upload's own error."""
        for what, call in (
            (
                "abort the upload",
                lambda: self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload),
            ),
            ("delete the key", lambda: self.client.delete_object(Bucket=self.bucket, Key=key)),
        ):
            try:
                call()
            except Exception as err:
                log.warning("%s: could not %s after a failed upload (%s)", self.url(key[len(self.prefix) :]), what, err)

    # ---- reading -------------------------------------------------------------------------------------------
    def open(self, name: str) -> S3Opened:
        """The object's size and ETag (a HEAD); ObjectGone when there is no such object, ObjectsUnavailable when the
        bucket does not answer or refuses."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        except ClientError as err:
            if _missing(err):
                raise ObjectGone(name) from None
            raise ObjectsUnavailable(reason(err)) from err
        except BotoCoreError as err:
            raise ObjectsUnavailable(reason(err)) from err
        return S3Opened(self, name, int(head["ContentLength"]), head.get("ETag") or "")

    def presign(self, name: str, seconds: int) -> str:
        """A GET URL for the object, signed (SigV4) with this server's credentials for `seconds`; its download is
        named as /content names it."""
        params = {
            "Bucket": self.bucket,
            "Key": self.key(name),
            "ResponseContentType": MP4_TYPE,
            "ResponseContentDisposition": f'attachment; filename="{name}"',
        }
        return self.client.generate_presigned_url("get_object", Params=params, ExpiresIn=seconds)

    def delete(self, name: str) -> None:
        """The object goes (S3 answers a deleted or absent key alike); ObjectsUnavailable when the bucket does not
        answer or refuses."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key(name))
        except (BotoCoreError, ClientError) as err:
            raise ObjectsUnavailable(reason(err)) from err

    def listing(self) -> Listing:
        """Every key directly under the prefix, sorted into job MP4s and the rest, and the uploads not completed;
        ObjectsUnavailable when the bucket does not answer or refuses."""
        from botocore.exceptions import BotoCoreError, ClientError

        ids, others = [], []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix, Delimiter="/"
            )
            for page in pages:
                for entry in page.get("Contents", []):
                    name = entry["Key"][len(self.prefix) :]
                    if name.endswith(MP4) and JOB_ID.fullmatch(name[: -len(MP4)]):
                        ids.append(name[: -len(MP4)])
                    else:
                        others.append(name)
            uploads = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix).get("Uploads", [])
        except (BotoCoreError, ClientError) as err:
            raise ObjectsUnavailable(reason(err)) from err
        return Listing(sorted(ids), sorted(others), sorted(u["Key"] for u in uploads))

    # ---- the start's check ---------------------------------------------------------------------------------
    def probe(self) -> None:
        """What a server needs of the bucket, tried before any weight loads: it answers, it exists, and these
        credentials may begin, abort and delete an upload under the prefix (a probe key: never an object)."""
        key = self.key(f"{PROBE_PREFIX}{uuid.uuid4().hex}")
        self.client.head_bucket(Bucket=self.bucket)
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
        self.client.delete_object(Bucket=self.bucket, Key=key)


class S3Opened:
    """An object found by a HEAD: `body` reads a byte range of it (If-Match its ETag, so a range is never cut from
    another object put under the same key since)."""

    def __init__(self, outputs: S3Outputs, name: str, size: int, etag: str):
        self.outputs, self.name, self.size, self.etag = outputs, name, size, etag

    def body(self, start: int, length: int) -> Body:
        from botocore.exceptions import BotoCoreError, ClientError

        o = self.outputs
        asked: dict[str, Any] = {"Bucket": o.bucket, "Key": o.key(self.name)}
        if length == 0:
            return _Empty()
        asked["Range"] = f"bytes={start}-{start + length - 1}"
        if self.etag:
            asked["IfMatch"] = self.etag
        try:
            return o.client.get_object(**asked)["Body"]
        except ClientError as err:
            if _missing(err) or _code(err) in ("PreconditionFailed", "412"):
                raise ObjectGone(self.name) from None
            raise ObjectsUnavailable(reason(err)) from err
        except BotoCoreError as err:
            raise ObjectsUnavailable(reason(err)) from err

    def close(self) -> None:
        pass


class _Empty:
    def read(self, size: int) -> bytes:
        return b""

    def close(self) -> None:
        pass


def _code(err: Any) -> str:
    return str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))


def _missing(err: Any) -> bool:
    return _code(err) in ("NoSuchKey", "404", "NotFound")


def reason(err: BaseException) -> str:
    """A botocore error in words for a client or a setting's refusal: S3's error code and message, or what the
    connection did (no URL, key or credentials)."""
    from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    if isinstance(err, ClientError):
        code, message = _code(err), str(err.response.get("Error", {}).get("Message", "")).strip()
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        words = {"404": "not found", "403": "access denied", "301": "the bucket is in another region"}.get(code)
        return f"{code or status}: {words or message or 'no message'}"
    if isinstance(err, ConnectTimeoutError | EndpointConnectionError):
        return "the storage endpoint did not answer"
    if isinstance(err, ReadTimeoutError):
        return "the storage endpoint stopped answering"
    return type(err).__name__


# ---- choosing, and the start's check ---------------------------------------------------------------------------------
def open_outputs(settings: Settings, videos: Path) -> OutputObjects:
    """The MP4s' store H3_OUTPUT_URL names: S3 (boto3 imported only then), else `videos`."""
    if settings.output_url is None:
        return LocalOutputs(videos)
    return S3Outputs.of(settings)


def check_outputs(settings: Settings) -> None:
    """H3_OUTPUT_URL's bucket, checked before any weight loads (`S3Outputs.probe`, one try, short timeouts):
    SettingError naming H3_S3_ENDPOINT when nothing answers there, else H3_OUTPUT_URL (no credentials, no such
    bucket, access denied). Nothing with the output folder."""
    if settings.output_url is None:
        return
    try:
        import boto3  # noqa: F401
    except ImportError:
        raise SettingError("output_url", "an s3:// output needs boto3: pip install 'h3serve[fleet]'") from None
    from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, EndpointConnectionError

    outputs = S3Outputs.of(settings, attempts=1, timeout=START_TIMEOUT_S)
    if outputs.session.get_credentials() is None:
        raise SettingError(
            "output_url",
            f"no AWS credentials for {outputs.where} (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an "
            "instance role): the MP4s are never written or served unsigned",
        )
    try:
        outputs.probe()
    except (ConnectTimeoutError, EndpointConnectionError) as err:
        setting = "s3_endpoint" if settings.s3_endpoint else "output_url"
        raise SettingError(setting, f"{outputs.where}: {reason(err)}") from None
    except ClientError as err:
        code = _code(err)
        if code in ("404", "NoSuchBucket", "NotFound"):
            why = f"the bucket {outputs.bucket} does not exist; create it first"
        elif code in ("403", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId"):
            why = f"access denied ({code}): the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) may not write under it"
        elif code in ("301", "PermanentRedirect", "AuthorizationHeaderMalformed"):
            why = f"the bucket is in another region ({code}): set AWS_REGION to its region"
        else:
            why = reason(err)
        raise SettingError("output_url", f"{outputs.where}: {why}") from None
    except BotoCoreError as err:
        raise SettingError("output_url", f"{outputs.where}: {reason(err)}") from None
    finally:
        with contextlib.suppress(Exception):
            outputs.client.close()
