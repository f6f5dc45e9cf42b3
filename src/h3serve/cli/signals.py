"""How `h3serve` commands meet signals: SIGTERM during `render` unwinds like Ctrl-C (so the same cleanup removes a
partial output), and signals are held while a command's heavy native modules import."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Terminated(BaseException):
    """SIGTERM, raised in the main thread while `render` runs (`sigterm_raises`), so that it unwinds as Ctrl-C's
    KeyboardInterrupt does and the same cleanup removes the partial output. A BaseException like KeyboardInterrupt:
    no `except Exception` on the way may take it for a failure."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """For the duration of a command, SIGTERM raises Terminated; then the previous handler is back. It raises once:
    a repeat while unwinding is ignored, so it cannot cut the cleanup short. Left alone where the process ignores
    SIGTERM (as Python leaves an ignored SIGINT) and off the main thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        yield
        return

    def on_sigterm(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:  # None: a handler not set from Python, which cannot be put back; the default is the closest
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held for the body (noted, not acted on), then delivered to their own handlers as it ends.
    For the import of a native module that calls back into Python while it initialises: Triton's does, and a
    KeyboardInterrupt raised inside that callback aborts the process (exit -6, a C++ terminate) instead of
    unwinding. A signal mask would not do: torch's threads, which do not share it, take the signal. Off the main
    thread, where no handler can be set, the body runs as it is; a signal ignored or not handled from Python is left
    alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) not in (signal.SIG_IGN, None)]
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):  # Ctrl-C raises KeyboardInterrupt here, on the way out
            signal.raise_signal(sig)


def import_held(*modules: str) -> None:
    """Import `modules` with signals held (`signals_held`): a command's heavy imports (torch, Triton, transformers,
    PyAV) in one go, so that a Ctrl-C in their seconds ends the command after them, as one line. Landing inside
    third-party import code, a KeyboardInterrupt can abort the process (Triton's native init) or be swallowed
    and leave a half-imported module that fails later (transformers' lazy import of accelerate)."""
    import importlib

    with signals_held():
        for name in modules:
            importlib.import_module(name)
