"""Bearer-key authentication: every route but /health requires `Authorization: Bearer <key>` when a key is set."""

from __future__ import annotations

import hmac

from fastapi import Request

from h3serve.service.errors import ApiError


class BearerKey:
    """The bearer key in effect (None: no key, every request passes), read once when the app is built."""

    def __init__(self, key: str | None):
        self._expected = key.encode() if key else None

    def check(self, header: str) -> None:
        """ApiError 401 unless `header` (the Authorization header) carries the key; constant time."""
        if self._expected is None:
            return
        scheme, _, given = header.partition(" ")
        # compare_digest on bytes of any length: the time does not depend on where the first difference is.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._expected):
            raise ApiError(
                401,
                "unauthorized",
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                "authorization",
                headers={"WWW-Authenticate": "Bearer"},
            )


async def require_key(request: Request) -> None:
    """The FastAPI dependency: the app's `BearerKey` (`app.state.auth`) checks the request."""
    request.app.state.auth.check(request.headers.get("authorization", ""))
