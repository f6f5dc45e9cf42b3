"""One error shape for every failure the API reports: `{"error": {"code", "message", "param"}}`."""

from __future__ import annotations


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
