"""Reading a request body, strictly: the documented forms only, complete, valid UTF-8, within its limits and its time.

Two content types are accepted, `multipart/form-data` and `application/json`; anything else is a 415 naming them
(an `application/x-www-form-urlencoded` body, what `curl -d` sends, would reach us as latin-1). The body is read
from the ASGI stream under a deadline (`H3_BODY_TIMEOUT`, a 408 that frees the connection) and a byte cap counted
as it arrives (a 413, whatever Content-Length claimed). A client that goes away mid-body is `ClientGone`: one INFO
line in the log, not an error.

A multipart body must be well formed and complete: every part with a `form-data` Content-Disposition and a name,
and the closing boundary at the end (a body cut short would otherwise lose its last part silently, turning an I2VA
request into a T2VA one). Text parts are UTF-8 (no other charset), at most MAX_FIELD_BYTES each; file parts are
the keyframe or reference uploads, each at most the upload cap. A JSON body is an object in UTF-8, with no key given
twice at any depth, no lone surrogate (`\\ud800`) in any key or string, and no integer longer than MAX_INT_DIGITS
(kept as a `LongInt` marker, which the field's validation refuses by name).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header
from starlette.requests import Request

from h3serve.service.errors import ApiError, bad_request, named, shown

FILE_FIELDS = ("input_reference", "input_references")
MAX_FIELD_BYTES = 1 << 20  # any non-file form field or JSON string (the prompt cap is far below this)
MAX_FIELDS = 64  # text fields of one form
MAX_INT_DIGITS = 40  # the longest integer a JSON body may hold (a seed has at most 19 digits)
CONTENT_TYPES = ("multipart/form-data", "application/json")
CLOSE = {"Connection": "close"}  # a refused body may still be arriving: the connection is not reused


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


@dataclass(frozen=True)
class Upload:
    field: str  # input_reference or input_references
    data: bytes
    filename: str = ""


@dataclass(frozen=True)
class Body:
    fields: dict[str, Any]
    uploads: list[Upload]  # in request order


@dataclass(frozen=True)
class BodyLimits:
    upload_cap: int  # bytes per file
    max_files: int  # files one request may carry
    timeout: float  # seconds for the whole body
    field_cap: int = MAX_FIELD_BYTES

    @property
    def body_cap(self) -> int:
        # base64 in a JSON body is 4/3 of the file; the form's fields are on top.
        return self.max_files * (self.upload_cap * 4 // 3 + 4) + MAX_FIELDS * 1024 + self.field_cap


@dataclass(frozen=True)
class LongInt:
    """A JSON integer too long to be any field's value: its digit count, for the refusal."""

    digits: int

    def __str__(self) -> str:
        return f"an integer of {self.digits} digits"


def content_type(request: Request) -> tuple[str, dict[bytes, bytes]]:
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    return kind.decode("latin-1"), options


async def read_body(request: Request, limits: BodyLimits) -> Body:
    """The request's fields and file uploads; ApiError (400, 408, 413, 415) naming the problem, or ClientGone."""
    kind, options = content_type(request)
    if kind not in CONTENT_TYPES:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"content type {shown(kind or 'none')} is not accepted; send {' or '.join(CONTENT_TYPES)}",
            headers=CLOSE,
        )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limits.body_cap:
        raise ApiError(
            413, "too_large", f"the request body is {int(length)} bytes; the limit is {limits.body_cap}", headers=CLOSE
        )
    try:
        async with asyncio.timeout(limits.timeout):
            if kind == "application/json":
                charset = options.get(b"charset", b"utf-8").decode("latin-1").lower()
                if charset not in ("utf-8", "utf8"):
                    raise bad_request(None, f"a JSON body must be UTF-8, not charset {shown(charset)}")
                return _json_body(b"".join([chunk async for chunk in _chunks(request, limits.body_cap)]), limits)
            boundary = options.get(b"boundary")
            if not boundary:
                raise bad_request(None, "the multipart/form-data content type has no boundary parameter")
            return await _MultipartReader(boundary, limits).read(_chunks(request, limits.body_cap))
    except TimeoutError:
        raise ApiError(
            408,
            "timeout",
            f"the request body did not arrive within H3_BODY_TIMEOUT={limits.timeout:g} s",
            headers=CLOSE,
        ) from None


async def _chunks(request: Request, cap: int) -> AsyncIterator[bytes]:
    """The body as it arrives, counted against `cap`."""
    seen = 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > cap:
            raise ApiError(413, "too_large", f"the request body is over the limit of {cap} bytes", headers=CLOSE)
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


# ---- JSON -----------------------------------------------------------------------------------------------------------
class _Duplicate(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def _integer(text: str) -> int | LongInt:
    digits = len(text.lstrip("-"))
    return LongInt(digits) if digits > MAX_INT_DIGITS else int(text)


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def load_json(text: str | bytes, param: str | None = None) -> Any:
    """Strict JSON: UTF-8 (bytes), no key twice in an object, no lone surrogate, long integers as LongInt, no
    NaN/Infinity. Refusals are 400s under `param` (a duplicate key or a surrogate names its key when `param` is
    None)."""
    where = f"{param}: " if param else ""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise bad_request(param, f"{where}the JSON is not valid UTF-8 (byte {err.start})") from None
    try:
        value = json.loads(text, object_pairs_hook=_object, parse_int=_integer, parse_constant=_constant)
    except _Duplicate as err:
        name = named(err.key)
        raise bad_request(param or name, f"{where}{shown(err.key)} is given twice; give each key once") from None
    except RecursionError:
        raise bad_request(param, f"{where}the JSON is nested too deeply") from None
    except ValueError as err:  # JSONDecodeError says where; NaN/Infinity say what
        raise bad_request(param, f"{where}not valid JSON ({err})") from None
    _no_surrogates(value, param)
    return value


def _surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _no_surrogates(value: Any, param: str | None) -> None:
    """Every key and string of `value` is text: a lone surrogate is refused under the top-level key it is in."""
    if isinstance(value, str):
        if _surrogate(value):
            raise bad_request(param, f"{param or 'a string'} holds a lone surrogate escape ({shown(value)}), not text")
    elif isinstance(value, list):
        for item in value:
            _no_surrogates(item, param)
    elif isinstance(value, dict):
        for key, item in value.items():
            if _surrogate(key):
                raise bad_request(named(key), f"the key {shown(key)} holds a lone surrogate escape, not text")
            _no_surrogates(item, param or key)


def _json_body(data: bytes, limits: BodyLimits) -> Body:
    body = load_json(data)
    if not isinstance(body, dict):
        raise bad_request(None, f"the JSON body must be an object, got {shown(body)}")
    uploads: list[Upload] = []
    for name in FILE_FIELDS:
        if name not in body:
            continue
        value = body.pop(name)
        values = value if isinstance(value, list) else [value]
        uploads += [_upload(name, decode_data_url(name, v), limits.upload_cap) for v in values]
    for name, value in body.items():
        if isinstance(value, str) and len(value) > limits.field_cap:
            raise _field_too_large(name, limits.field_cap)
    return Body(body, uploads)


def decode_data_url(param: str, value: Any) -> bytes:
    """A file in a JSON body: a base64 string, optionally as a data: URL."""
    if not isinstance(value, str):
        raise bad_request(param, f"{param} in a JSON body must be a base64 string or data: URL, got {shown(value)}")
    payload = value.split(",", 1)[1] if value.startswith("data:") else value
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(param, f"{param} is not valid base64") from None


def _upload(name: str, data: bytes, cap: int, filename: str = "") -> Upload:
    if len(data) > cap:
        raise ApiError(
            413, "too_large", f"{name}: the file is larger than H3_MAX_UPLOAD_MB ({cap >> 20} MiB)", name, CLOSE
        )
    if not data:
        raise bad_request(name, f"{name}: the file is empty")
    return Upload(name, data, filename)


def _field_too_large(name: str, cap: int) -> ApiError:
    name = named(name)  # any part name: the fields are checked by name after the body is read
    return ApiError(413, "too_large", f"{name} is over the limit of {cap} bytes for a field", name, CLOSE)


# ---- multipart ------------------------------------------------------------------------------------------------------
@dataclass
class _Part:
    name: str = ""
    filename: str | None = None
    charset: str | None = None
    data: bytearray | None = None


class _MultipartReader:
    """python-multipart's streaming parser, with the checks Starlette's form reader leaves out: a complete body,
    part headers present and well formed, UTF-8 text, per-part caps counted as the data arrives."""

    def __init__(self, boundary: bytes, limits: BodyLimits):
        self.limits = limits
        self.fields: dict[str, Any] = {}
        self.uploads: list[Upload] = []
        self.part: _Part | None = None
        self.header_name = bytearray()
        self.header_value = bytearray()
        self.headers: dict[str, bytes] = {}
        self.error: ApiError | None = None
        callbacks = {
            "on_part_begin": self._begin,
            "on_header_field": lambda data, start, end: self.header_name.extend(data[start:end]),
            "on_header_value": lambda data, start, end: self.header_value.extend(data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._data,
            "on_part_end": self._end,
        }
        self.parser = MultipartParser(boundary, callbacks)

    async def read(self, chunks: AsyncIterator[bytes]) -> Body:
        async for chunk in chunks:
            try:
                self.parser.write(chunk)
            except MultipartParseError as err:
                raise self.error or bad_request(None, f"the multipart body is malformed ({err})") from None
            if self.error is not None:
                raise self.error
        if self.parser.state != MultipartState.END:
            raise bad_request(
                self.part.name if self.part is not None and self.part.name else None,
                "the multipart body is incomplete: it ends before its closing boundary (--BOUNDARY--)"
                + (f", inside the part {shown(self.part.name)}" if self.part is not None and self.part.name else ""),
            )
        return Body(self.fields, self.uploads)

    def _fail(self, error: ApiError) -> None:
        # Raised from a callback, python-multipart would wrap it; kept and raised by `read` instead.
        if self.error is None:
            self.error = error
        raise MultipartParseError(error.message)

    def _begin(self) -> None:
        self.part, self.headers = _Part(), {}

    def _header_end(self) -> None:
        self.headers[bytes(self.header_name).decode("latin-1").lower()] = bytes(self.header_value)
        self.header_name.clear()
        self.header_value.clear()

    def _headers_finished(self) -> None:
        part = self.part
        disposition, options = parse_options_header(self.headers.get("content-disposition"))
        if disposition != b"form-data" or b"name" not in options:
            self._fail(bad_request(None, "a multipart part has no 'Content-Disposition: form-data; name=...' header"))
        try:
            part.name = options[b"name"].decode("utf-8")
            part.filename = options[b"filename"].decode("utf-8") if b"filename" in options else None
        except UnicodeDecodeError:
            self._fail(bad_request(None, "a multipart part's name or filename is not valid UTF-8"))
        if not part.name:
            self._fail(bad_request(None, "a multipart part has an empty name"))
        _, type_options = parse_options_header(self.headers.get("content-type"))
        charset = type_options.get(b"charset")
        if part.filename is None and charset is not None and charset.lower() not in (b"utf-8", b"utf8"):
            self._fail(bad_request(part.name, f"{part.name}: text fields must be UTF-8, not charset {shown(charset)}"))
        if part.filename is None and len(self.fields) >= MAX_FIELDS:
            self._fail(bad_request(part.name, f"the form has more than {MAX_FIELDS} text fields"))
        if part.filename is not None and len(self.uploads) >= self.limits.max_files:
            self._fail(
                bad_request(
                    part.name, f"{part.name}: at most {self.limits.max_files} files in one request for this model"
                )
            )
        part.data = bytearray()

    def _data(self, data: bytes, start: int, end: int) -> None:
        part = self.part
        part.data.extend(data[start:end])
        if part.filename is not None and len(part.data) > self.limits.upload_cap:
            cap = self.limits.upload_cap
            message = f"{named(part.name)}: the file is larger than H3_MAX_UPLOAD_MB ({cap >> 20} MiB)"
            self._fail(ApiError(413, "too_large", message, named(part.name), CLOSE))
        if part.filename is None and len(part.data) > self.limits.field_cap:
            self._fail(_field_too_large(part.name, self.limits.field_cap))

    def _end(self) -> None:
        part, self.part = self.part, None
        name = part.name
        if name in FILE_FIELDS:
            if part.filename is None:
                self._fail(bad_request(name, f"{name} must be an uploaded file (a multipart part with a filename)"))
            try:
                self.uploads.append(_upload(name, bytes(part.data), self.limits.upload_cap, part.filename))
            except ApiError as err:
                self._fail(err)
            return
        said = named(name)  # any part name here: the fields are checked by name after the body is read
        if part.filename is not None:
            self._fail(bad_request(said, f"{said} must be a text field, not a file"))
        if name in self.fields:
            self._fail(bad_request(said, f"{said} is given more than once; give it once"))
        try:
            self.fields[name] = bytes(part.data).decode("utf-8")
        except UnicodeDecodeError as err:
            self._fail(bad_request(said, f"{said} is not valid UTF-8 text (byte {err.start})"))
