"""OpenAI Responses wire types as msgspec Structs: what `POST /v1/responses` accepts, the
`response` object it answers (and `GET /v1/responses/{id}` gives back), and its stream events."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from compiled_engine.server.common.protocol import Request


class ResponsesRequest(Request, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]  # items are checked one by one (turns.py)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None  # None: 1.0
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None  # "disabled" only: a conversation that does not fit is a 400
    background: bool = False  # refused when true
    include: list[str] | None = None  # none are supported; an empty list is accepted
    reasoning: dict[str, Any] | None = None  # accepted; reasoning comes with --reasoning-parser
    service_tier: str | None = None  # accepted and ignored
    prompt_cache_key: str | None = None  # accepted; the prefix cache needs no key
    safety_identifier: str | None = None  # accepted and ignored
    stream_options: dict[str, Any] | None = None  # accepted and ignored (include_obfuscation)


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    status: str
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type"):
    """With `serve --reasoning-parser`: the reply's thinking."""

    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: str = "completed"


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int = 0  # OpenAI's field; pages this server caches are not counted apart


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    """Why a response failed (`status: failed`)."""

    code: str  # server_error, rate_limit_exceeded, ...
    message: str


class ResponseObject(msgspec.Struct):
    id: str
    created_at: int
    model: str
    status: str  # in_progress, completed, incomplete, failed
    output: list[OutputItem]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    text: dict[str, Any]
    metadata: dict[str, str]
    user: str | None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    truncation: str = "disabled"
    reasoning: dict[str, Any] = msgspec.field(default_factory=lambda: {"effort": None, "summary": None})
    object: Literal["response"] = "response"


class DeletedResponse(msgspec.Struct):
    id: str
    deleted: bool = True
    object: Literal["response"] = "response"


# -- stream events: `type` names the event, `sequence_number` counts from 0 ---------------------


class ResponseEvent(msgspec.Struct):
    """response.created, .in_progress, .completed and .incomplete."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(msgspec.Struct):
    """response.output_item.added and .done."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(msgspec.Struct):
    """response.content_part.added and .done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(msgspec.Struct):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)
    type: str = "response.output_text.delta"


class TextDoneEvent(msgspec.Struct):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)
    type: str = "response.output_text.done"


class ArgumentsDeltaEvent(msgspec.Struct):
    sequence_number: int
    item_id: str
    output_index: int
    delta: str
    type: str = "response.function_call_arguments.delta"


class ArgumentsDoneEvent(msgspec.Struct):
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str
    type: str = "response.function_call_arguments.done"


class ReasoningDeltaEvent(msgspec.Struct):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    type: str = "response.reasoning_text.delta"


class ReasoningDoneEvent(msgspec.Struct):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    type: str = "response.reasoning_text.done"
