"""The names bench/load.py imports, until it moves with the checkpoint package: everything else imports `lib`."""

from lib.host import StatusPeaks, evict, proc_status
from lib.timing import run_header

__all__ = ["StatusPeaks", "evict", "proc_status", "run_header"]
