"""A job record as a row of the `jobs` table: the table derived from `VideoJob`, its fixed statements, and the two
directions between a record and its row.

The table is derived from `VideoJob`, the one statement of the record: one column per field, a nested record
(`error: JobError`) as one column per part (`error_code`, `error_message`), dicts and lists as JSON text. A field
added to `VideoJob` is a column of a new store, and an older store gains it on open (NULL in its old rows, read back
as the field's default). Every name that goes into SQL is a column of that list, checked once at import.

Nothing read back becomes a path unchecked: a row's id is a plain name (PLAIN_ID) and its file `<id>.mp4`, or the row
is damaged (`file_problem`).
"""

from __future__ import annotations

import json
import re
import types
import typing
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from h3serve.service.schemas import VideoJob

STORE_FILE = "jobs.sqlite3"
MP4 = ".mp4"
# A job id as `new_job_id` makes it (and always has): what a record file's name must be to be a job's record. Nothing
# else in videos/ is read as one, and only a name of this shape is ever written or removed there by id.
JOB_ID = re.compile(r"video_gen_[0-9a-f]{32}")
KEY = "id"  # the primary key: VideoJob.id
_NAME = re.compile(r"[a-z][a-z0-9_]*")  # what a column name may be: it is written into SQL, so nothing else is let in
# SQLite's type for a field's Python type, in this order (bool is an int, a StrEnum a str); dicts and lists are JSON.
_SQL_TYPES = ((int, "INTEGER"), (float, "REAL"), (str, "TEXT"))


@dataclass(frozen=True)
class Column:
    name: str  # the SQL column
    field: str  # the VideoJob field it stores
    part: str | None  # for a nested record's column, the part it holds: error_code is part "code" of field "error"
    sql_type: str
    json: bool  # a dict or a list, stored as JSON text
    required: bool  # the field admits no None: NOT NULL in a new table


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the type a field holds, whether it admits None) for `X` or `X | None`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not types.NoneType]
        if len(kinds) != 1:
            raise TypeError(f"a job record field may be one type or that type | None, not {annotation}")
        return kinds[0], True
    return annotation, False


def _sql_type(field: str, kind: Any) -> tuple[str, bool]:
    """(SQLite type, stored as JSON) for one field's type."""
    if typing.get_origin(kind) in (dict, list) or kind in (dict, list):
        return "TEXT", True
    for python, sql in _SQL_TYPES:
        if isinstance(kind, type) and issubclass(kind, python):
            return sql, False
    raise TypeError(f"job record field {field!r} is a {kind}, which has no column type here")


def columns_of(model: type[BaseModel]) -> tuple[Column, ...]:
    """The table of a record model: its fields in order, nested records flattened one level, names checked."""
    columns = []
    for name, info in model.model_fields.items():
        kind, optional = _unwrap(info.annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            for part, sub in kind.model_fields.items():
                sql, is_json = _sql_type(f"{name}.{part}", _unwrap(sub.annotation)[0])
                columns.append(Column(f"{name}_{part}", name, part, sql, is_json, required=False))
        else:
            sql, is_json = _sql_type(name, kind)
            columns.append(Column(name, name, None, sql, is_json, required=not optional))
    names = [c.name for c in columns]
    for name in names:
        if not _NAME.fullmatch(name):
            raise ValueError(f"job record column {name!r} is not a plain lower-case name ({_NAME.pattern})")
    if len(set(names)) != len(names):
        raise ValueError(f"job record columns collide: {names}")
    return tuple(columns)


COLUMNS = columns_of(VideoJob)
FIELDS = tuple(dict.fromkeys(c.field for c in COLUMNS))  # VideoJob's fields, in order
_BY_FIELD = {f: tuple(c for c in COLUMNS if c.field == f) for f in FIELDS}


def column_of(field: str) -> str:
    """The column of a plain field, for the fixed statements below; a field renamed in VideoJob fails at import."""
    found = _BY_FIELD.get(field, ())
    if len(found) != 1 or found[0].part is not None:
        raise ValueError(f"{field!r} is not a plain field of VideoJob (fields: {', '.join(FIELDS)})")
    return found[0].name


def definition(c: Column, new_table: bool) -> str:
    if c.name == KEY:
        return f"{c.name} {c.sql_type} PRIMARY KEY NOT NULL"
    # ALTER TABLE cannot add a NOT NULL column without a default: an added column is nullable in an older store.
    return f"{c.name} {c.sql_type}" + (" NOT NULL" if c.required and new_table else "")


ID_COLUMN, STATUS_COLUMN, CREATED_COLUMN = column_of(KEY), column_of("status"), column_of("created_at")
_NAMES = ", ".join(c.name for c in COLUMNS)
CREATE = f"CREATE TABLE IF NOT EXISTS jobs ({', '.join(definition(c, new_table=True) for c in COLUMNS)})"
INSERT = f"INSERT INTO jobs ({_NAMES}) VALUES ({', '.join('?' * len(COLUMNS))})"
SELECT = f"SELECT rowid, {_NAMES} FROM jobs"  # the rowid names a row whose id cannot be read
NEWEST_FIRST = f"ORDER BY {CREATED_COLUMN} DESC, rowid DESC"
OLDEST_FIRST = f"ORDER BY {CREATED_COLUMN} ASC, rowid ASC"


def encode(field: str, value: Any) -> list[tuple[Column, Any]]:
    """The column values of one field's value (a nested record's parts, JSON for dicts and lists)."""
    pairs = []
    for c in _BY_FIELD[field]:
        if c.part is not None:
            part = None if value is None else getattr(value, c.part)
            pairs.append((c, part))
        elif c.json:
            pairs.append((c, None if value is None else json.dumps(value)))
        else:
            pairs.append((c, value))
    return pairs


class ValueRefused(ValueError):
    """A record's value the store cannot hold (PostgreSQL's text and the NUL character): `field`, the VideoJob field
    (a request's parameter of the same name, for the API's 400), its `column`, and `why`. Nothing was written."""

    def __init__(self, field: str, column: str, why: str):
        self.field, self.column, self.why = field, column, why
        super().__init__(f"{column}: {why}")


class NotText(bytes):
    """A TEXT value that is not UTF-8. The connection's text factory returns it instead of raising, so that one such
    value is its row's damage (`decode_row` refuses it) rather than the failure of the whole query."""


def decode_text(raw: bytes) -> str | NotText:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return NotText(raw)


def decode_row(row: tuple) -> VideoJob:
    """The record of one row; ValueError saying which column or field is wrong and how (never the value itself)."""
    values: dict[str, Any] = {}
    for c, raw in zip(COLUMNS, row, strict=True):
        if raw is None:
            continue  # NULL: the field's default (a column an older store gained is NULL in its old rows)
        if isinstance(raw, NotText):
            raise ValueError(f"{c.name}: not UTF-8 text")
        if c.part is not None:
            values.setdefault(c.field, {})[c.part] = raw
        elif c.json:
            try:
                values[c.field] = json.loads(raw)
            except (ValueError, TypeError) as err:
                raise ValueError(f"{c.name}: not JSON ({err})") from err
        else:
            values[c.field] = raw
    try:
        job = VideoJob(**values)
    except ValidationError as err:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors(include_input=False)]
        raise ValueError("; ".join(problems)) from err
    if (problem := file_problem(job)) is not None:
        raise ValueError(problem)
    return job


# An id a row may hold: one plain file name's worth (the server's ids are JOB_ID; tests and older stores hold other
# plain names). Never a separator, a leading dot or an empty name: the id names `videos/<id>.mp4` and
# `previews/<id>.png`, so a row written by hand (or a restored store) must not name a path outside them.
PLAIN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


def file_problem(job: VideoJob) -> str | None:
    """What is wrong with a record's id or `file_name` (None: nothing): the id is a plain name (PLAIN_ID), the file
    `<id>.mp4`, the name the server gives a job's MP4, or absent. Anything else (a path, `../x`, another job's MP4)
    would become a file served and deleted."""
    if not PLAIN_ID.fullmatch(job.id):
        return "id: not a plain name (letters, digits, '_', '-', '.'; no leading '.'), so never a path here"
    if job.file_name is None or job.file_name == f"{job.id}{MP4}":
        return None
    return f"file_name: not this job's MP4 (<its id>{MP4}), so never a path here"


def row_id(rowid: int, raw: Any) -> str:
    return raw if isinstance(raw, str) else f"<row {rowid}>"  # the key itself unreadable: the row's number


def assignments(changes: dict[str, Any], mark: str = "?") -> tuple[str, list[Any]]:
    """`col=?, ...` and its values for changes named by VideoJob field; an unknown name is refused, never written.
    `mark`: the driver's placeholder (SQLite's `?`, psycopg's `%s`)."""
    unknown = sorted(set(changes) - set(FIELDS))
    if unknown or KEY in changes:
        raise ValueError(f"cannot set {', '.join(unknown) or KEY} of a job record (fields: {', '.join(FIELDS)})")
    pairs = [pair for field, value in changes.items() for pair in encode(field, value)]
    return ", ".join(f"{c.name}={mark}" for c, _ in pairs), [v for _, v in pairs]


def new_job_id() -> str:
    return f"video_gen_{uuid.uuid4().hex}"
