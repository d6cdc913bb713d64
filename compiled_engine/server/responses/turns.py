"""An OpenAI Responses request, checked, as what chat completions already take: the input items
as chat-template turns (function calls and their outputs as OpenAI chat's tool calls and tool
turns), the tool plan, and the output constraint of `text.format`."""

from __future__ import annotations

from typing import Any

from compiled_engine.engine.sampling_params import StructuredOutputs
from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.common.tool_parsers import ToolCallParser
from compiled_engine.server.common.tools import ToolPlan, checked_tool_calls, tool_plan
from compiled_engine.server.responses.protocol import FunctionCallItem, OutputMessage, ResponseObject

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def input_turns(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as turns: a string is one user turn; a list holds messages (`role` and `content`),
    `function_call` items (merged into the assistant turn before them) and `function_call_output`
    items (tool turns). Reasoning items sent back are left out."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise ApiError(400, "input must not be empty", param="input")
    turns: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ApiError(400, f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            turns.append(_message_turn(i, item))
        elif kind == "function_call":
            call = _function_call(i, item)
            if turns and turns[-1]["role"] == "assistant":
                turns[-1].setdefault("tool_calls", []).append(call)
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str | list):
                raise ApiError(400, f"input[{i}]: a function_call_output needs call_id and output", param="input")
            text = output if isinstance(output, str) else _text(i, output)
            turns.append({"role": "tool", "content": text, "tool_call_id": call_id})
        elif kind != "reasoning":
            raise ApiError(
                400,
                f"input[{i}] has type {kind!r}: only messages, function_call and function_call_output items are supported",
                param="input",
                code="unsupported_parameter",
            )
    return turns


def _message_turn(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = ROLES.get(item.get("role", ""))
    if role is None:
        raise ApiError(
            400, f"input[{i}].role must be one of {', '.join(ROLES)}, got {item.get('role')!r}", param="input"
        )
    content = item.get("content")
    if isinstance(content, list):
        content = _text(i, content)
    if not isinstance(content, str):
        raise ApiError(400, f"input[{i}].content must be a string or a list of text parts", param="input")
    unknown = set(item) - {"type", "role", "content", "id", "status"}
    if unknown:
        raise ApiError(400, f"input[{i}]: unknown fields {sorted(unknown)}", param="input")
    return {"role": role, "content": content}


def _text(i: int, parts: list[Any]) -> str:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f"input[{i}] has a content part of type {kind!r}: only text is supported (no images or files)",
                param="input",
                code="unsupported_parameter",
            )
        texts.append(part["text"])
    return "".join(texts)


def _function_call(i: int, item: dict[str, Any]) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise ApiError(400, f"input[{i}]: a function_call needs its call_id", param="input")
    sent = {"id": call_id, "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
    return checked_tool_calls([sent], f"input[{i}]")[0]


def responses_tool_plan(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parser: ToolCallParser, parallel: bool = True
) -> ToolPlan | None:
    """Responses' function tools (`{"type": "function", "name", "description", "parameters",
    "strict"}`) and tool_choice (`auto`, `none`, `required`, `{"type": "function", "name"}`) as
    chat completions' tool plan."""
    functions = None
    if tools is not None:
        functions = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise ApiError(400, f"tools[{i}]: only function tools are supported, not {kind!r}", param="tools")
            unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
            if unknown:
                raise ApiError(400, f"tools[{i}]: unknown fields {sorted(unknown)}", param="tools")
            if not isinstance(tool.get("name"), str):
                raise ApiError(400, f"tools[{i}].name: a function tool needs its name (a string)", param="tools")
            function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
            functions.append({"type": "function", "function": function})
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
            raise ApiError(
                400,
                'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                param="tool_choice",
            )
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    return tool_plan(functions, tool_choice, parser, parallel)


def text_format(text: dict[str, Any] | None) -> StructuredOutputs | None:
    """`text.format`: `text` (no constraint), `json_object`, or `json_schema` with its `schema`."""
    if text is None:
        return None
    fmt = text.get("format", {"type": "text"})
    unknown = set(text) - {"format", "verbosity"}
    if unknown or not isinstance(fmt, dict):
        raise ApiError(400, 'text must be {"format": {"type": ...}}', param="text")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param="text.format")
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, 'text.format of type "json_schema" needs its "schema"', param="text.format")
        return StructuredOutputs.of({"json": fmt["schema"]}, param="text.format")
    raise ApiError(
        400, f'text.format.type must be "text", "json_object" or "json_schema", got {kind!r}', param="text.format"
    )


def output_turn(response: ResponseObject) -> dict[str, Any]:
    """A response's output as the assistant turn a later request (previous_response_id) continues."""
    text = "".join(part.text for item in response.output if isinstance(item, OutputMessage) for part in item.content)
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        for item in response.output
        if isinstance(item, FunctionCallItem)
    ]
    if calls:
        turn["tool_calls"] = calls
    return turn
