"""One error shape for every failure the API reports: `{"error": {"code", "message", "param"}}`."""

from __future__ import annotations

from h3serve.errors import escaped, shown  # noqa: F401 (the one echo rule, shared with the settings' refusals)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None, headers: dict | None = None):
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
