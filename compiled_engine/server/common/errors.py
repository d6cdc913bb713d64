"""Every failure the server reports, as OpenAI's error body with the right status code."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from compiled_engine.errors import (
    CompiledEngineError,
    EngineDeadError,
    EngineOverloadedError,
    EngineShuttingDownError,
    PromptError,
    RequestError,
    TokenizerError,
)
from compiled_engine.server.common.protocol import ErrorBody, ErrorResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> Response[ErrorResponse]:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return Response(ErrorResponse(ErrorBody(message, type_, param, code)), status_code=status, headers=headers)


_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


@dataclass(frozen=True)
class ServerError:
    """A failure as every API reports it: the status it has (before a stream's 200), OpenAI's
    error type, the message."""

    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None


def server_error(exc: Exception) -> ServerError:
    """The status, type and message of a failure raised by a route or by an engine stream."""
    if isinstance(exc, ApiError):
        return ServerError(exc.status, exc.type, exc.message, exc.param, exc.code)
    if isinstance(exc, ValidationException):
        extra = exc.extra if isinstance(exc.extra, list) else []
        details = "; ".join(str(e.get("message", e)) if isinstance(e, dict) else str(e) for e in extra)
        return ServerError(400, "invalid_request_error", f"invalid request body: {details or exc.detail}")
    if isinstance(exc, HTTPException):
        status = exc.status_code
        message = exc.detail or "error"
        if status == 413:
            message = f"request body too large: {message}"
        kind = _HTTP_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return ServerError(status, kind, message)
    if isinstance(exc, EngineOverloadedError):
        return ServerError(429, "rate_limit_error", f"the server is overloaded: {exc}; retry later")
    if isinstance(exc, EngineShuttingDownError | EngineDeadError):
        return ServerError(503, "service_unavailable", str(exc))
    if isinstance(exc, RequestError | TokenizerError | CompiledEngineError):
        return ServerError(400, "invalid_request_error", str(exc))
    return ServerError(500, "server_error", f"internal error: {type(exc).__name__}")


def handle_exception(request: Request, exc: Exception) -> Response[ErrorResponse]:
    error = server_error(exc)
    if error.status == 500 and not isinstance(exc, ApiError | HTTPException):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(error.status, error.message, error.type, error.param, error.code)


RequestErrorHandler = Callable[[Request[Any, Any, Any], Exception], Response[ErrorResponse]]


def request_error_handler(field_names: dict[str, str] | None = None) -> RequestErrorHandler:
    """The handler of the engine's refusals of a request (engine/request_validation.py,
    SamplingParams): OpenAI's 400, naming the field at fault as the route's body calls it
    (`field_names`: the engine's name (RequestError.param) -> the body's, where they differ)."""
    names = field_names or {}

    def handle_request_error(request: Request[Any, Any, Any], exc: Exception) -> Response[ErrorResponse]:
        if not isinstance(exc, RequestError):
            return handle_exception(request, exc)
        param = exc.param if exc.param is None else names.get(exc.param, exc.param)
        code = "context_length_exceeded" if isinstance(exc, PromptError) and exc.problem.exceeds_context else None
        return error_response(400, str(exc), "invalid_request_error", param, code)

    return handle_request_error
