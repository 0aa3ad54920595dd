"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status."""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
          429: "rate_limit_exceeded", 431: "invalid_request_error", 504: "timeout",
          500: "internal_server_error", 502: "bad_gateway", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_json(status: int, message: str, param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def error_payload(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": None, "code": None}}


_FIELD = re.compile(r"^(?:prompt \(\d+ tokens\) \+ )?([a-z_]+)")


def from_value_error(e: ValueError) -> APIError:
    """Engine and SamplingParams errors start with the offending field's name."""
    msg = str(e)
    m = _FIELD.match(msg)
    param = None
    if "max_model_len" in msg or "too long" in msg:
        param = "prompt" if "max_tokens" not in msg else "max_tokens"
    elif m:
        param = m.group(1)
    return APIError(400, msg, param=param)
