"""An Anthropic Messages request, checked, as what chat completions already take: the turns a
chat template renders (with tool calls and tool results as OpenAI's), and the tool plan."""

from __future__ import annotations

import json
from typing import Any

from compiled_engine.server.anthropic.protocol import (
    DocumentBlock,
    ImageBlock,
    InputMessage,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.common.tool_parsers import ToolCallParser
from compiled_engine.server.common.tools import ToolPlan, tool_plan

ROLES = ("user", "assistant")


def message_turns(system: str | list[TextBlock] | None, messages: list[InputMessage]) -> list[dict[str, Any]]:
    """The system prompt and the messages as chat-template turns: a user message's tool_result
    blocks become `tool` turns before its text, an assistant message's tool_use blocks its
    `tool_calls`; thinking blocks are left out."""
    if not messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    turns: list[dict[str, Any]] = []
    if system is not None:
        text = system if isinstance(system, str) else "\n".join(block.text for block in system)
        turns.append({"role": "system", "content": text})
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise ApiError(400, f"messages.{i}.role must be 'user' or 'assistant', got '{message.role}'")
        if isinstance(message.content, str):
            turns.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            turns += _user_turns(i, message.content)
        else:
            turns.append(_assistant_turn(i, message.content))
    return turns


def _user_turns(i: int, blocks: list[Any]) -> list[dict[str, Any]]:
    turns, text = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            turns.append({"role": "tool", "content": tool_result_text(block), "tool_call_id": block.tool_use_id})
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            _refuse(i, j, block, "user")
    if text or not turns:
        turns.append({"role": "user", "content": "".join(text)})
    return turns


ERROR_PREFIX = "Error: "


def tool_result_text(block: ToolResultBlock) -> str:
    """A tool result as its tool turn's content: its text, or with `is_error` the text after
    `ERROR_PREFIX` (chat templates have no field for a failed call, so the model reads it)."""
    text = block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)
    return f"{ERROR_PREFIX}{text}" if block.is_error else text


def _assistant_turn(i: int, blocks: list[Any]) -> dict[str, Any]:
    text, calls = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif not isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            _refuse(i, j, block, "assistant")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _refuse(i: int, j: int, block: Any, role: str) -> None:
    if isinstance(block, ImageBlock | DocumentBlock):
        kind = "image" if isinstance(block, ImageBlock) else "document"
        raise ApiError(400, f"messages.{i}.content.{j}: {kind} blocks are not supported (this server takes text only)")
    kind = type(block).__name__
    raise ApiError(400, f"messages.{i}.content.{j}: a {kind} is not allowed in a {role} message")


def message_tool_plan(
    tools: list[dict[str, Any]] | None, tool_choice: dict[str, Any] | None, parser: ToolCallParser
) -> ToolPlan | None:
    """Anthropic's tools (`name`, `description`, `input_schema`) and tool_choice (`auto`, `any`,
    `tool` with a name, `none`) as chat completions' tool plan."""
    functions = None
    if tools is not None:
        functions = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise ApiError(400, f"tools.{i}: only custom tools are supported, not {kind!r}", param="tools")
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                raise ApiError(400, f"tools.{i}.input_schema: a JSON schema object is required", param="tools")
            unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
            if unknown:
                raise ApiError(400, f"tools.{i}: unknown fields {sorted(unknown)}", param="tools")
            if not isinstance(tool.get("name"), str):
                raise ApiError(400, f"tools.{i}.name: a tool needs its name (a string)", param="tools")
            function = {"name": tool["name"], "parameters": schema}
            if "description" in tool:
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
    parallel = not (tool_choice or {}).get("disable_parallel_tool_use", False)
    return tool_plan(functions, _openai_choice(tool_choice, functions is not None), parser, parallel)


def _openai_choice(choice: dict[str, Any] | None, has_tools: bool) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    unknown = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if unknown:
        raise ApiError(400, f"tool_choice: unknown fields {sorted(unknown)}", param="tool_choice")
    if kind == "auto":
        return "auto" if has_tools else "none"
    if kind == "none":
        return "none"
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(
        400,
        'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or {"type": "tool", "name": ...}',
        param="tool_choice",
    )
