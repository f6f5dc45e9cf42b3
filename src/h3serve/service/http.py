"""The HTTP/1.1 connection: uvicorn's h11 protocol with a deadline for each request's head.

uvicorn times out an idle keep-alive connection (`timeout_keep_alive`), but it cancels that timer on the first byte
received and has none for a connection that never sends a byte or sends its head slowly: a client sending one header
line a second held a connection (and its file descriptor) for as long as it liked. Here a connection's request head
(request line and headers) must be complete within `head_timeout` seconds of the connection opening, or of the
first byte of a later request on a kept-alive connection; else the connection is closed, as nginx's
`client_header_timeout` does. The body has its own deadline, the same number of seconds (`bodies.read_body`).

uvicorn takes a protocol class as its `http` setting; `head_deadline_protocol` makes one with the deadline set.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


class HeadDeadlineProtocol(H11Protocol):
    head_timeout: float = 120.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """Armed while h11 waits for a complete request head (their state IDLE), stopped once it has one."""
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.head_timeout, self._head_too_slow)
        else:
            self._stop_head_timer()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            client = "{}:{}".format(*self.client) if self.client else "a client"
            log.info("%s sent no complete request head within %g s; connection closed", client, self.head_timeout)
            self.transport.close()


def head_deadline_protocol(seconds: float) -> type[HeadDeadlineProtocol]:
    """uvicorn's `http` setting: the h11 protocol with a request head deadline of `seconds`."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout": float(seconds)})
