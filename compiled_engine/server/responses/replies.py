"""OpenAI Responses replies from the choice deltas: the `response` object, or its stream of
events (`response.created`, `response.in_progress`, each output item's `added`, its content
part and text deltas or its call's arguments, each `done`, then `response.completed` or
`response.incomplete`), every event numbered by `sequence_number`. With tools, the text goes
through the tool-call mapper (common/tools.ToolCallStream) first, and calls become `function_call`
items."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.server.common.deltas import StepDeltas, whole_choices
from compiled_engine.server.common.engine_streams import named_sse
from compiled_engine.server.common.errors import ServerError
from compiled_engine.server.common.protocol import Usage
from compiled_engine.server.common.reasoning import ReasoningParser, ReasoningStream, whole_split
from compiled_engine.server.common.tools import ToolCall, ToolCallStream, ToolPlan
from compiled_engine.server.responses.protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)


@dataclass(frozen=True)
class ResponseFrame:
    """What the response object repeats of its request, set before it runs."""

    id: str
    model: str
    request: dict[str, Any]  # the echoed fields: instructions, max_output_tokens, temperature, ...
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self, status: str, output: list[OutputItem], usage: Usage | None, finish_reason: str | None = None
    ) -> ResponseObject:
        incomplete = IncompleteDetails("max_output_tokens") if finish_reason == "length" else None
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            model=self.model,
            status="incomplete" if incomplete is not None else status,
            output=output,
            usage=_usage(usage) if usage is not None else None,
            incomplete_details=incomplete,
            **self.request,
        )


def _usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        usage.prompt_tokens,
        InputTokensDetails(usage.prompt_tokens_details.cached_tokens),
        usage.completion_tokens,
        OutputTokensDetails(),
        usage.total_tokens,
    )


def _call_item(call: ToolCall, status: str = "completed") -> FunctionCallItem:
    return FunctionCallItem(f"fc_{uuid.uuid4().hex}", call.id, call.name, call.arguments, status)


def _message_item(text: str, status: str = "completed") -> OutputMessage:
    return OutputMessage(f"msg_{uuid.uuid4().hex}", status, [OutputText(text)])


def _reasoning_item(text: str, status: str = "completed") -> ReasoningItem:
    return ReasoningItem(f"rs_{uuid.uuid4().hex}", [ReasoningText(text)], status=status)


def response_reply(
    frame: ResponseFrame, final: RequestOutput, plan: ToolPlan | None, reasoning: ReasoningParser | None = None
) -> ResponseObject:
    whole = whole_choices(final)
    thought, choice = whole_split(reasoning, whole.choices[0])
    text, calls = plan.calls(choice.text) if plan is not None else (choice.text, [])
    output: list[OutputItem] = [_reasoning_item(thought)] if thought else []
    output += [_message_item(text)] if text else []
    output += [_call_item(call) for call in calls]
    return frame.response("completed", output, whole.usage, choice.finish_reason)


Event = (
    ResponseEvent
    | OutputItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent
    | ReasoningDeltaEvent
    | ReasoningDoneEvent
)


@dataclass
class _Numbered:
    """Events as SSE, their `sequence_number` set in the order they are sent."""

    sent: int = 0

    def __call__(self, event: Event) -> bytes:
        event.sequence_number = self.sent
        self.sent += 1
        return named_sse(event.type, event)


async def response_events(
    frame: ResponseFrame,
    steps: AsyncIterator[StepDeltas],
    plan: ToolPlan | None,
    finished: Callable[[ResponseObject], None],
    reasoning: ReasoningParser | None = None,
) -> AsyncIterator[bytes]:
    """The stream; `finished` gets the final response object (to store it) before the last event.
    Items in order: the thinking (with a reasoning parser), the message, the calls."""
    event = _Numbered()
    tool_calls = ToolCallStream(plan) if plan is not None else None
    thinking = ReasoningStream(reasoning) if reasoning is not None else None
    thought_item: ReasoningItem | None = None
    message: OutputMessage | None = None
    output: list[OutputItem] = []
    started = False
    async for step in steps:
        if not started:
            pending = frame.response("in_progress", [], None)
            yield event(ResponseEvent("response.created", 0, pending))
            yield event(ResponseEvent("response.in_progress", 0, pending))
            started = True
        choice = step.choices[0]
        if thinking is not None:
            thought, choice = thinking.step(choice)
            if thought:
                if thought_item is None:
                    thought_item = _reasoning_item("", "in_progress")
                    opened = ReasoningItem(thought_item.id, [], status="in_progress")
                    yield event(OutputItemEvent("response.output_item.added", 0, len(output), opened))
                thought_item.content[0].text += thought
                yield event(ReasoningDeltaEvent(0, thought_item.id, len(output), 0, thought))
        if tool_calls is not None:
            shown = tool_calls.step(choice)
            text, calls = (shown.text, shown.calls) if shown is not None else (None, [])
        else:
            text, calls = choice.text, []
        answer_begins = bool(text or calls) or choice.finish_reason is not None
        if thought_item is not None and thought_item.status == "in_progress" and answer_begins:
            thought_item.status = "completed"  # the thinking is over
            whole_thought = thought_item.content[0].text
            yield event(ReasoningDoneEvent(0, thought_item.id, len(output), 0, whole_thought))
            done_thought = ReasoningItem(thought_item.id, [ReasoningText(whole_thought)])
            yield event(OutputItemEvent("response.output_item.done", 0, len(output), done_thought))
            output.append(done_thought)
        if text:
            if message is None:
                message = _message_item("", "in_progress")
                yield event(OutputItemEvent("response.output_item.added", 0, len(output), _message_item_like(message)))
                yield event(
                    ContentPartEvent("response.content_part.added", 0, message.id, len(output), 0, OutputText(""))
                )
            message.content[0].text += text
            yield event(TextDeltaEvent(0, message.id, len(output), 0, text))
        if choice.finish_reason is None:
            continue
        if message is not None:
            done = OutputMessage(message.id, "completed", [OutputText(message.content[0].text)])
            yield event(TextDoneEvent(0, done.id, len(output), 0, done.content[0].text))
            yield event(ContentPartEvent("response.content_part.done", 0, done.id, len(output), 0, done.content[0]))
            yield event(OutputItemEvent("response.output_item.done", 0, len(output), done))
            output.append(done)
        for call in calls:
            item = _call_item(call)
            index = len(output)
            added = FunctionCallItem(item.id, item.call_id, item.name, "", "in_progress")
            yield event(OutputItemEvent("response.output_item.added", 0, index, added))
            yield event(ArgumentsDeltaEvent(0, item.id, index, item.arguments))
            yield event(ArgumentsDoneEvent(0, item.id, index, item.name, item.arguments))
            yield event(OutputItemEvent("response.output_item.done", 0, index, item))
            output.append(item)
        final = frame.response("completed", output, step.usage, choice.finish_reason)
        finished(final)
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        yield event(ResponseEvent(kind, 0, final))


def _message_item_like(message: OutputMessage) -> OutputMessage:
    """A copy as the message is when added: in progress, no content yet."""
    return OutputMessage(message.id, "in_progress", [])


def responses_failure(frame: ResponseFrame, error: ServerError, sent: int) -> bytes:
    """A stream's last event when it fails after its 200: `response.failed` (docs/api.md). `sent`: the
    events before it; the failed response lists no output (the items streamed are not repeated)."""
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    response = msgspec.structs.replace(frame.response("failed", [], None), error=ResponseError(code, error.message))
    return named_sse("response.failed", ResponseEvent("response.failed", sent, response))
