"""How errors become answers, and how many requests may be in flight (what a request passes before any route is
guard.py's).

The Gate counts requests in flight. The error handlers
answer every error a client can cause with a 4xx in the OpenAI error shape
``{"error": {"message", "type", "param", "code"}}``, and anything else with a 500 whose details go to the
server log only.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from qatune.serve.schemas import ApiError, error_body

log = logging.getLogger("qatune")


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Any, exc: ApiError) -> JSONResponse:
        # a client told to retry (429) is told when: OpenAI's clients read Retry-After
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Any, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error(exc.errors()).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Any, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; the API is under /v1 (GET /v1/models)"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(message, code="not_found" if exc.status_code == 404 else None),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_request: Any, exc: Exception) -> JSONResponse:
        log.error("internal error: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        return JSONResponse(error_body("internal error in qatune serve (the server log has the details)",
                                       "server_error"), status_code=500)


JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
              dict: "an object", type(None): "null"}


def validation_error(errors: list[dict[str, Any]] | Any) -> ApiError:
    """The first problem pydantic found, as an OpenAI-shaped 400 naming the field."""
    first = dict(next(iter(errors), {}))
    kind = first.get("type", "")
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"the body is not valid JSON ({detail})", code="invalid_json")
    param = ".".join(location) or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if kind == "missing":
        message = f"'{param}' is required" if param else "the body is missing; send a JSON object"
    elif kind in ("model_type", "model_attributes_type", "dict_type") and not location:
        message = "the body must be a JSON object, sent with the header 'Content-Type: application/json'"
    elif param:
        message = f"{param}: {message}"
        if "input" in first and kind.endswith("_type"):
            message += f" (got {JSON_TYPES.get(type(first['input']), 'a value of another type')})"
    return ApiError(400, message, param=param, code=kind or None)


class Gate:
    """Counts requests in flight; beyond the limit a request is refused with 429 rather than queued."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active = 0

    def enter(self) -> Slot:
        if self.active >= self.limit:
            raise ApiError(429, f"the server is busy ({self.active} requests in flight, the limit is {self.limit}); "
                           "retry shortly", code="too_many_requests", kind="rate_limit_error")
        self.active += 1
        return Slot(self)


class Slot:
    def __init__(self, gate: Gate):
        self.gate: Gate | None = gate

    def release(self) -> None:
        if self.gate is not None:
            self.gate.active -= 1
            self.gate = None
