"""Errors as OpenAI shapes them: ``{"error": {"message", "type", "param", "code"}}``, and on the
Anthropic Messages API's paths (``/v1/messages``, ``/v1/messages/count_tokens``) as Anthropic does:
``{"type": "error", "error": {"type", "message"}}``.

Service code raises :class:`APIError` (or lets the engine's ``InvalidRequest`` /
``EngineOverloaded`` through); :func:`install_handlers` turns every error into the body of the
request's path with the right status, so no route builds error responses itself.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.types import EngineOverloaded, InvalidRequest

log = logging.getLogger("agentrt.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}

# Anthropic's error types by status; other statuses: invalid_request_error below 500, api_error from 500.
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                    529: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"


def anthropic_path(path: str) -> bool:
    """Whether ``path`` is on the Anthropic Messages API, whose errors are Anthropic-shaped."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error as a response to a request for ``path`` (Anthropic-shaped on its API's paths)."""
        body = self.anthropic_body() if anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param=param, code=code)


def overloaded(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, code="server_overloaded", headers={"Retry-After": str(retry_after_s)})


def draining(retry_after_s: int) -> APIError:
    """503 ``worker_draining``: this worker is shutting down; a router (or the client, after
    ``Retry-After``) sends the request elsewhere."""
    return APIError(503, "the worker is draining (shutting down); send this request to another worker",
                    type="server_error", code="worker_draining", headers={"Retry-After": str(retry_after_s)})


def from_exception(exc: BaseException, retry_after_s: int = 1) -> APIError:
    """Map any exception from the engine or the service to an :class:`APIError`."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return bad_request(str(exc))
    if isinstance(exc, EngineOverloaded):
        return overloaded(f"the server is overloaded ({exc}); retry later",
                          max(retry_after_s, math.ceil(exc.retry_after_s)))
    log.exception("internal error", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", type="server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    if first.get("type") == "extra_forbidden":   # as OpenAI words it (agentrt/core/request_fields.py)
        return f"Unrecognized request argument supplied: {param}", param
    where = f"'{param}'" if param else "request body"
    return f"{where}: {first.get('msg', 'invalid value')}", param


def install_handlers(app: FastAPI, retry_after_s: int = 1) -> None:
    """Register handlers so every error leaves as an error body (OpenAI's, or Anthropic's on its paths)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(400, message, param=param, code="invalid_value").response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
        return error.response(request.url.path)

    @app.exception_handler(InvalidRequest)
    @app.exception_handler(EngineOverloaded)
    async def _engine(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc, retry_after_s).response(request.url.path)

    @app.exception_handler(Exception)
    async def _other(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc, retry_after_s).response(request.url.path)
