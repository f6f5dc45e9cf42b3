"""One error shape for every failure the API reports: `{"error": {"code", "message", "param"}}`."""

from __future__ import annotations

from h3serve.errors import ECHO_CHARS, escaped, shown  # noqa: F401 (the one echo rule, shared with the settings')

# A backstop, not the rule: each message echoes values through `shown` and names through `named`, which cap them at
# ECHO_CHARS; a message longer than this (the longest written here lists the accepted fields, ~600 characters)
# can only be one that echoes something unchecked, and is cut rather than sent whole.
MAX_MESSAGE_CHARS = 2000
MAX_PARAM_CHARS = ECHO_CHARS + 40  # a field's name, with its prefix (extra_params.) and index


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None, headers: dict | None = None):
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + f"... (cut at {MAX_MESSAGE_CHARS} characters)"
        if param is not None and len(param) > MAX_PARAM_CHARS:
            param = named(param, MAX_PARAM_CHARS)
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "param": self.param}}


def bad_request(param: str | None, message: str) -> ApiError:
    return ApiError(400, "invalid_request", message, param)


def internal_error(code: str, what: str, request_id: str) -> ApiError:
    """A 500 that says only where to look: the exception and its traceback go to the server log under `request_id`,
    never to the client (their text can hold paths, names and internals)."""
    message = f"{what} (internal error); see the server log, request id {request_id}"
    return ApiError(500, code, message, headers={"x-request-id": request_id})


def named(name: str, limit: int = ECHO_CHARS) -> str:
    """A client-chosen name (an unknown field or key, a part or file name) as a message or `param` may echo it, bare:
    lone surrogates escaped, cut at `limit` characters with its length said."""
    text = escaped(name)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(name)} characters)"
