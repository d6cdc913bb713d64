"""The last event of a stream that fails after its 200 (a lost replica, a dead engine loop), in
each API's own convention (docs/api.md, "Failures mid-stream"):
- OpenAI chat and completions: a `data:` event with an `error` object, then `[DONE]`;
- Anthropic Messages: `event: error` with `overloaded_error` (the engine cannot serve now) or
  `api_error`;
- OpenAI Responses: `response.failed`, its response `failed` with an `error` object."""

from __future__ import annotations

import msgspec

from compiled_engine.server.errors import ServerError, messages_error_type
from compiled_engine.server.messages_protocol import MessagesError, MessagesErrorBody
from compiled_engine.server.protocol import ErrorBody, ErrorResponse
from compiled_engine.server.replies.responses import ResponseFrame
from compiled_engine.server.replies.sse import DONE, sse
from compiled_engine.server.responses_protocol import ResponseError, ResponseEvent


def openai_failure(error: ServerError, sent: int) -> bytes:
    return sse(ErrorResponse(ErrorBody(error.message, error.type, error.param, error.code))) + sse(DONE)


def messages_failure(error: ServerError, sent: int) -> bytes:
    body = MessagesError(MessagesErrorBody(messages_error_type(error.status), error.message))
    return b"event: error\ndata: " + msgspec.json.encode(body) + b"\n\n"


def responses_failure(frame: ResponseFrame, error: ServerError, sent: int) -> bytes:
    """`sent`: the events before this one (its sequence number). The failed response lists no
    output: the items streamed before the failure are not repeated."""
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    response = msgspec.structs.replace(frame.response("failed", [], None), error=ResponseError(code, error.message))
    event = ResponseEvent("response.failed", sent, response)
    return b"event: response.failed\ndata: " + msgspec.json.encode(event) + b"\n\n"
