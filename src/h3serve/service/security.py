"""Bearer-key authentication: every route but /health requires `Authorization: Bearer <key>` when a key is set."""

from __future__ import annotations

import hmac

from fastapi import Request

from h3serve.service.errors import ApiError


def bearer_auth(key: str | None):
    """A FastAPI dependency that checks the bearer key in constant time (no-op when no key is set)."""
    expected = key.encode() if key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        # compare_digest on bytes of any length: the time does not depend on where the first difference is.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise ApiError(
                401,
                "unauthorized",
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                "authorization",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check
