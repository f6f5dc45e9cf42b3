"""Files that settings name (the key file, the config file, the adapters), checked before they are read.

A setting's path is the operator's, but it may name anything: a FIFO (whose open waits for a writer forever), a
character device (/dev/zero reads until memory runs out), a folder, a file far larger than the setting can mean.
`open_regular` opens it only once it is known to be a regular file no larger than its cap, and never blocks: it
stats the path, opens it with O_NONBLOCK (a FIFO swapped in after the stat opens at once instead of waiting for a
writer) and O_NOCTTY, and checks with fstat that what it opened is still that regular file. `read_setting_file` reads
at most cap + 1 bytes of it, so a file that grew past the cap after the stat is refused too, never read whole.
`follow=False` (a file the server itself wrote, such as a job's record in videos/, never a link) also refuses a
symbolic link: the path is lstat'ed and opened with O_NOFOLLOW, so a link swapped in after the lstat fails to open.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from h3serve.errors import SettingError, shown_path

# What a path that is not a regular file is, by its stat mode's type bits.
KINDS = (
    (stat.S_ISLNK, "a symbolic link"),  # only seen by lstat (`follow=False`)
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class FileRefused(ValueError):
    """A path that cannot be read as the file it should be: `path` as given, `reason` what is wrong with it (the text
    is the path, capped as echoes are, then the reason)."""

    def __init__(self, path: Path, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{shown_path(path)} {reason}")


def size_text(size: int) -> str:
    """`4096` -> `4 KiB`; `209715200` -> `200 MiB`; small sizes in bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f}".removesuffix(".0") + f" {unit}"
    return f"{size} bytes"


def _kind(mode: int) -> str | None:
    return next((name for test, name in KINDS if test(mode)), None if stat.S_ISREG(mode) else "not a regular file")


def _check(path: Path, st: os.stat_result, cap: int | None) -> None:
    kind = _kind(st.st_mode)
    if kind is not None:
        raise FileRefused(path, f"is {kind}, not a regular file")
    if cap is not None and st.st_size > cap:
        raise FileRefused(path, f"is {size_text(st.st_size)} ({st.st_size} bytes), over the cap of {size_text(cap)}")


def _os_refusal(path: Path, err: OSError) -> FileRefused:
    """An OSError as a refusal naming the path; the error's own text is not used (it repeats the path, uncapped)."""
    if isinstance(err, FileNotFoundError):
        return FileRefused(path, "does not exist (no such file)")
    if isinstance(err, PermissionError):
        return FileRefused(path, f"is not readable by this user ({err.strerror or 'permission denied'})")
    return FileRefused(path, f"cannot be opened ({err.strerror or type(err).__name__})")


@contextmanager
def open_regular(path: Path, cap: int | None = None, *, follow: bool = True) -> Iterator[int]:
    """The file descriptor of `path` opened for reading, once it is a regular file of at most `cap` bytes (None: no
    cap); closed on leaving. FileRefused names the path and what it is. Never blocks on a FIFO or a device.
    `follow=False`: a symbolic link is refused too, rather than followed."""
    path = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    try:
        # Following links by default: a secret mounted as a link to a regular file is fine.
        _check(path, os.stat(path) if follow else os.lstat(path), cap)
        fd = os.open(path, flags if follow else flags | os.O_NOFOLLOW)
    except (OSError, ValueError) as err:  # ValueError: a path holding a NUL byte
        if isinstance(err, FileRefused):
            raise
        raise (_os_refusal(path, err) if isinstance(err, OSError) else FileRefused(path, "is not a path")) from None
    try:
        _check(path, os.fstat(fd), cap)  # what was opened, if the path changed after the stat
        yield fd
    finally:
        os.close(fd)


def read_regular(path: Path, cap: int, *, follow: bool = True) -> bytes:
    """The bytes of a regular file of at most `cap` bytes (FileRefused otherwise); at most cap + 1 bytes are read.
    `follow=False`: a symbolic link is refused (`open_regular`)."""
    with open_regular(path, cap, follow=follow) as fd:
        chunks: list[bytes] = []
        left = cap + 1
        try:
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        except OSError as err:
            raise FileRefused(path, f"cannot be read ({err.strerror or type(err).__name__})") from None
    data = b"".join(chunks)
    if len(data) > cap:
        raise FileRefused(path, f"grew past the cap of {size_text(cap)} while it was read")
    return data


def read_setting_file(setting: str, path: Path, cap: int) -> bytes:
    """The bytes of the file `setting` names, checked first (`read_regular`); SettingError(setting) naming the path
    and what is wrong with it otherwise."""
    try:
        return read_regular(path, cap)
    except FileRefused as err:
        raise SettingError(setting, str(err)) from None
