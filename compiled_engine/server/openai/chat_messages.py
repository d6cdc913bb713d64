"""A chat request's messages, checked, as the turns a chat template renders (tools.render_turns
then adapts tool turns to the template)."""

from __future__ import annotations

from typing import Any

from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.common.tools import checked_tool_calls
from compiled_engine.server.openai.protocol import ChatMessage

CHAT_ROLES = ("system", "user", "assistant", "tool")


def chat_turns(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    return [_turn(i, message) for i, message in enumerate(messages)]


def _turn(i: int, message: ChatMessage) -> dict[str, Any]:
    if message.role not in CHAT_ROLES:
        raise ApiError(
            400,
            f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got '{message.role}'",
            param="messages",
        )
    content = message.content
    if isinstance(content, list):
        kinds = {part.type for part in content}
        if kinds - {"text"}:
            raise ApiError(
                400,
                f"messages[{i}] has content parts of type {sorted(kinds - {'text'})}: only text is supported (no images or audio)",
                param="messages",
                code="unsupported_parameter",
            )
        content = "".join(part.text for part in content if isinstance(part.text, str))
    turn: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise ApiError(400, f"messages[{i}]: only assistant turns carry tool_calls", param="messages")
        turn["tool_calls"] = checked_tool_calls(message.tool_calls, f"messages[{i}]")
    if message.role == "tool":
        turn["tool_call_id"] = message.tool_call_id or ""
    return turn
