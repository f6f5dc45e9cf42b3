"""One process at a time uses an output folder: a server's store and `rebuild_store` hold an exclusive lock on
`h3serve.lock` in it (`FolderLock`), so a rebuild never runs beside a server, nor two servers on one folder."""

from __future__ import annotations

import fcntl
import os
import re
import stat
from pathlib import Path

LOCK_FILE = "h3serve.lock"
SERVER, REBUILD, START_CHECK = "server", "store rebuild", "start check"  # who holds the lock, as its file says
_HOLDER = re.compile(rf"([0-9]{{1,10}}) ({SERVER}|{REBUILD}|{START_CHECK})\n")


class FolderBusy(ValueError):
    """The output folder's lock cannot be had: `path` is the lock file, `reason` why (without the path, which the
    text puts first), `holder` who holds it as it wrote itself there ("h3serve server, pid 12"), None when unknown or
    when the lock file itself is the problem."""

    def __init__(self, path: Path, reason: str, holder: str | None = None):
        self.path, self.reason, self.holder = path, reason, holder
        super().__init__(f"{path}: {reason}")


class FolderLock:
    """An exclusive `flock` on `output_dir/h3serve.lock`, held until `release` (or the end of a `with`): a server's
    store holds it for the server's life, `rebuild_store` for its run, the start's check for an instant (to see that
    no one holds it). So a rebuild never runs beside a server, `--force` or not, and a second server on one folder is
    refused at its check, before any weight loads. FolderBusy when another process (or another open in this one)
    holds it.

    flock, not SQLite's own locks: those last one transaction, and a rebuild replaces the very file they are taken
    on. The kernel drops a flock with its process (a crash, kill -9), so the file left behind means nothing and is
    never removed (removing it while another process waits on the old one would let two hold "the" lock). The holder
    writes `<pid> <role>` into it, for the refusal's text only. The file is opened without following a link."""

    def __init__(self, output_dir: Path, role: str):
        self.path = output_dir / LOCK_FILE
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as err:
            raise FolderBusy(self.path, f"the output folder's lock file cannot be opened ({os_reason(err)})") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FolderBusy(self.path, "is not a regular file; h3serve's lock file is: remove what is there")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                found = _HOLDER.fullmatch(os.pread(fd, 64, 0).decode("ascii", "replace"))
                holder = f"h3serve {found[2]}, pid {found[1]}" if found else None
                raise FolderBusy(
                    self.path,
                    f"the output folder is in use by {holder or 'another h3serve process'}, which holds this lock "
                    "while it runs: one process uses an output folder at a time; stop that one first, or use another "
                    "output folder",
                    holder,
                ) from None
            except OSError as err:
                raise FolderBusy(self.path, f"the output folder's lock cannot be taken ({os_reason(err)})") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {role}\n".encode("ascii"), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # the lock goes with the file's last descriptor

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def os_reason(err: OSError) -> str:
    """The OS's words for a failure, for a message that names the file itself."""
    return err.strerror or type(err).__name__
