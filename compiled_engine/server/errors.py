"""Every failure the server reports, as OpenAI's error body with the right status code."""

from __future__ import annotations

import logging
from collections.abc import Callable
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
from compiled_engine.server.messages_protocol import MessagesError, MessagesErrorBody
from compiled_engine.server.protocol import ErrorBody, ErrorResponse

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


def handle_exception(request: Request, exc: Exception) -> Response[ErrorResponse]:
    if isinstance(exc, ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)
    if isinstance(exc, ValidationException):
        extra = exc.extra if isinstance(exc.extra, list) else []
        details = "; ".join(str(e.get("message", e)) if isinstance(e, dict) else str(e) for e in extra)
        return error_response(400, f"invalid request body: {details or exc.detail}", "invalid_request_error")
    if isinstance(exc, HTTPException):
        status = exc.status_code
        message = exc.detail or "error"
        if status == 413:
            message = f"request body too large: {message}"
        return error_response(
            status, message, _HTTP_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        )
    if isinstance(exc, EngineOverloadedError):
        return error_response(429, f"the server is overloaded: {exc}; retry later", "rate_limit_error")
    if isinstance(exc, EngineShuttingDownError | EngineDeadError):
        return error_response(503, str(exc), "service_unavailable")
    if isinstance(exc, RequestError | TokenizerError | CompiledEngineError):
        return error_response(400, str(exc), "invalid_request_error")
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}", "server_error")


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


# Anthropic's error types by status (its 529 "overloaded" is our 503 and 429).
_MESSAGES_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def messages_error_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[MessagesError]:
    """The Messages routes' errors: the same statuses and messages as every other route, in
    Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`."""
    openai_shaped = request_error_handler()(request, exc)
    status = openai_shaped.status_code or 500
    assert isinstance(openai_shaped.content, ErrorResponse)
    kind = _MESSAGES_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = MessagesError(MessagesErrorBody(kind, openai_shaped.content.error.message))
    return Response(body, status_code=status, headers=openai_shaped.headers)
