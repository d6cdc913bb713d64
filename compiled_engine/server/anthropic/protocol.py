"""Anthropic Messages wire types as msgspec Structs: what `POST /v1/messages` and
`/v1/messages/count_tokens` accept and what they answer (docs/api.md lists what is refused)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from compiled_engine.server.common.protocol import Request

# -- request content blocks (the `type` field picks the block) ---------------------------------


class TextBlock(Request, tag="text", tag_field="type"):
    text: str
    cache_control: dict[str, Any] | None = None  # accepted; prefix caching is automatic here
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(Request, tag="tool_use", tag_field="type"):
    """An assistant turn's call, sent back."""

    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Request, tag="tool_result", tag_field="type"):
    """A user turn's answer to a call."""

    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(Request, tag="thinking", tag_field="type"):
    """An assistant turn's thinking, sent back: left out of the prompt, as Anthropic does."""

    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Request, tag="redacted_thinking", tag_field="type"):
    data: str


class ImageBlock(Request, tag="image", tag_field="type"):
    """Parsed so that the refusal can name it: this server takes text only."""

    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class DocumentBlock(Request, tag="document", tag_field="type"):
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


ContentBlock = (
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | ImageBlock | DocumentBlock
)


class InputMessage(Request):
    role: str
    content: str | list[ContentBlock]


class MessagesRequest(Request, kw_only=True):
    model: str
    max_tokens: int
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Anthropic's defaults; its SDK sends these only through extra_body.
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None  # accepted and ignored (user_id)
    thinking: dict[str, Any] | None = None  # accepted; thinking comes with --reasoning-parser
    service_tier: str | None = None  # accepted and ignored
    cache_control: dict[str, Any] | None = None  # accepted; prefix caching is automatic


class CountTokensRequest(Request, kw_only=True):
    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


# -- replies ------------------------------------------------------------------------------------


class TextContent(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ToolUseContent(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(msgspec.Struct, tag="thinking", tag_field="type"):
    """With `serve --reasoning-parser`: the reply's thinking (no signature: it is not Anthropic's)."""

    thinking: str
    signature: str = ""


Content = ThinkingContent | TextContent | ToolUseContent


class MessagesUsage(msgspec.Struct):
    """Anthropic counts cache reads apart: the prompt is input_tokens + cache_read_input_tokens."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class Message(msgspec.Struct):
    id: str
    model: str
    content: list[Content]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessagesUsage
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


class MessagesErrorBody(msgspec.Struct):
    type: str
    message: str


class MessagesError(msgspec.Struct):
    error: MessagesErrorBody
    type: Literal["error"] = "error"


# -- stream events ------------------------------------------------------------------------------


class MessageStartEvent(msgspec.Struct, tag="message_start", tag_field="type"):
    message: Message


class ContentBlockStartEvent(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: Content


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class ContentBlockDeltaEvent(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta


class ContentBlockStopEvent(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopDetails(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class OutputUsage(msgspec.Struct):
    output_tokens: int


class MessageDeltaEvent(msgspec.Struct, tag="message_delta", tag_field="type"):
    delta: StopDetails
    usage: OutputUsage


class MessageStopEvent(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass


class PingEvent(msgspec.Struct, tag="ping", tag_field="type"):
    pass


StreamEvent = (
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | PingEvent
)
