"""Anthropic Messages replies from the choice deltas: one `Message`, or the stream of events
(`message_start`, `ping`, each content block's start, deltas and stop, `message_delta` with the
stop reason and the output tokens, `message_stop`). With tools, the text goes through the
tool-call mapper (common/tools.ToolCallStream) first, and calls become `tool_use` blocks. Its
failures in Anthropic's shape: as the reply, or as the last event of a stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response

from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.server.anthropic.protocol import (
    Content,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJsonDelta,
    Message,
    MessageDeltaEvent,
    MessagesError,
    MessagesErrorBody,
    MessageStartEvent,
    MessageStopEvent,
    MessagesUsage,
    OutputUsage,
    PingEvent,
    StopDetails,
    StreamEvent,
    TextContent,
    TextDelta,
    ThinkingContent,
    ThinkingDelta,
    ToolUseContent,
)
from compiled_engine.server.common.deltas import StepDeltas, whole_choices
from compiled_engine.server.common.engine_streams import named_sse
from compiled_engine.server.common.errors import ServerError, request_error_handler
from compiled_engine.server.common.protocol import ErrorResponse, Usage
from compiled_engine.server.common.reasoning import ReasoningParser, ReasoningStream, whole_split
from compiled_engine.server.common.tools import ToolCall, ToolCallStream, ToolPlan


def messages_usage(usage: Usage) -> MessagesUsage:
    cached = usage.prompt_tokens_details.cached_tokens
    return MessagesUsage(usage.prompt_tokens - cached, usage.completion_tokens, cache_read_input_tokens=cached)


def stop_details(
    finish_reason: str | None, stop_reason: str | int | None, stop_sequences: list[str], calls: bool
) -> StopDetails:
    """Anthropic's stop reason: `tool_use`, `max_tokens`, `stop_sequence` (naming it) or `end_turn`."""
    if calls:
        return StopDetails("tool_use", None)
    if finish_reason == "length":
        return StopDetails("max_tokens", None)
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return StopDetails("stop_sequence", stop_reason)
    return StopDetails("end_turn", None)


def _tool_use(call: ToolCall) -> ToolUseContent:
    return ToolUseContent(f"toolu_{call.id.removeprefix('call_')}", call.name, json.loads(call.arguments))


def message_reply(
    message_id: str,
    model: str,
    final: RequestOutput,
    plan: ToolPlan | None,
    stop_sequences: list[str],
    reasoning: ReasoningParser | None = None,
) -> Message:
    whole = whole_choices(final)
    thought, choice = whole_split(reasoning, whole.choices[0])
    text, calls = plan.calls(choice.text) if plan is not None else (choice.text, [])
    content: list[Content] = [ThinkingContent(thought)] if thought else []
    content += [TextContent(text)] if text else []
    content += [_tool_use(call) for call in calls]
    stop = stop_details(choice.finish_reason, choice.stop_reason, stop_sequences, bool(calls))
    return Message(message_id, model, content, stop.stop_reason, stop.stop_sequence, messages_usage(whole.usage))


def _event(event: StreamEvent) -> bytes:
    return named_sse(str(type(event).__struct_config__.tag), event)


async def message_events(
    message_id: str,
    model: str,
    steps: AsyncIterator[StepDeltas],
    plan: ToolPlan | None,
    stop_sequences: list[str],
    reasoning: ReasoningParser | None = None,
) -> AsyncIterator[bytes]:
    """The blocks in order: thinking (with a reasoning parser), text, tool calls."""
    tool_calls = ToolCallStream(plan) if plan is not None else None
    thinking = ReasoningStream(reasoning) if reasoning is not None else None
    started, thinking_open, text_open, index = False, False, False, 0
    async for step in steps:
        if not started:
            usage = messages_usage(step.usage)
            usage.output_tokens = 0
            yield _event(MessageStartEvent(Message(message_id, model, [], None, None, usage)))
            yield _event(PingEvent())
            started = True
        choice = step.choices[0]
        if thinking is not None:
            thought, choice = thinking.step(choice)
            if thought:
                if not thinking_open:
                    yield _event(ContentBlockStartEvent(index, ThinkingContent("")))
                    thinking_open = True
                yield _event(ContentBlockDeltaEvent(index, ThinkingDelta(thought)))
        if tool_calls is not None:
            shown = tool_calls.step(choice)
            text, calls = (shown.text, shown.calls) if shown is not None else (None, [])
        else:
            text, calls = choice.text, []
        if thinking_open and (text or calls or choice.finish_reason is not None):
            yield _event(ContentBlockStopEvent(index))  # the answer begins: the thinking is over
            thinking_open, index = False, index + 1
        if text:
            if not text_open:
                yield _event(ContentBlockStartEvent(index, TextContent("")))
                text_open = True
            yield _event(ContentBlockDeltaEvent(index, TextDelta(text)))
        if choice.finish_reason is None:
            continue
        if text_open:
            yield _event(ContentBlockStopEvent(index))
            index += 1
        for call in calls:
            block = _tool_use(call)
            yield _event(ContentBlockStartEvent(index, ToolUseContent(block.id, block.name, {})))
            yield _event(ContentBlockDeltaEvent(index, InputJsonDelta(call.arguments)))
            yield _event(ContentBlockStopEvent(index))
            index += 1
        stop = stop_details(choice.finish_reason, choice.stop_reason, stop_sequences, bool(calls))
        yield _event(MessageDeltaEvent(stop, OutputUsage(step.usage.completion_tokens)))
        yield _event(MessageStopEvent())


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


def messages_error(status: int, message: str) -> MessagesError:
    kind = _MESSAGES_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return MessagesError(MessagesErrorBody(kind, message))


def messages_error_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[MessagesError]:
    """The Messages routes' errors: the same statuses and messages as every other route, in
    Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`."""
    openai_shaped = request_error_handler()(request, exc)
    status = openai_shaped.status_code or 500
    assert isinstance(openai_shaped.content, ErrorResponse)
    body = messages_error(status, openai_shaped.content.error.message)
    return Response(body, status_code=status, headers=openai_shaped.headers)


def messages_failure(error: ServerError, sent: int) -> bytes:
    """A stream's last event when it fails after its 200: `event: error` (docs/api.md)."""
    return named_sse("error", messages_error(error.status, error.message))
