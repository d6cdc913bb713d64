"""Tool calling in OpenAI's terms (the other APIs map theirs to it): `tools`, `tool_choice`, the
prompt, and the calls in the reply.

The tools reach the model through its chat template when the template takes `tools` (Qwen3's
does); otherwise through a system prompt of our own (`FALLBACK_PROMPT`), in the Hermes style that
such templates use: the definitions inside `<tools>`, and each call written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Assistant turns with `tool_calls` and
`role: "tool"` turns are rendered the same way when the template does not know them.

- `none`: the tools are left out and the reply is text;
- `auto`: the model writes text or calls; the server's tool-call parser (tool_parsers.py: hermes,
  llama3_json, mistral, pythonic) turns the calls of the finished text into calls;
- `required` or a named function: the output is constrained (structured/) to the JSON of one call,
  of any tool or of that one, so the arguments always parse and follow the parameters' schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from compiled_engine.engine.sampling_params import StructuredOutputs
from compiled_engine.errors import RequestError
from compiled_engine.server.common.deltas import ChoiceDelta
from compiled_engine.server.common.tool_parsers import PARSERS, ToolCall, ToolCallParser, call_of
from compiled_engine.tokenizer import Tokenizer

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # the fallback prompt's (hermes) format
FALLBACK_PROMPT = (
    "You can call functions to help with the user's request. The functions are described by "
    "these JSON schemas:\n<tools>\n{tools}\n</tools>\nTo call a function, reply with one block "
    'per call, and nothing else: <tool_call>{{"name": <function name>, "arguments": <arguments as '
    "a JSON object>}}</tool_call>"
)


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # the functions' definitions: {"name", "description"?, "parameters"?}
    choice: str  # "auto", "required" or "named" ("none" makes no plan)
    name: str | None = None  # the named function
    parser: ToolCallParser = PARSERS["hermes"]  # how the model writes calls under "auto"
    parallel: bool = True  # False (parallel_tool_calls): at most the first call is kept

    @property
    def names(self) -> list[str]:
        return [tool["name"] for tool in self.tools]

    def constraint(self) -> StructuredOutputs | None:
        """The output's constraint for `required` and a named function; None for `auto`."""
        if self.choice == "auto":
            return None
        calls = [_call_schema(tool) for tool in self.tools if self.choice == "required" or tool["name"] == self.name]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return StructuredOutputs(json=json.dumps(schema, sort_keys=True), param="tool_choice")

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's text before any call, and its calls (none: the whole text)."""
        if self.choice != "auto":
            value = _decoded(text)
            call = call_of(value, self.names)
            return (None, [call]) if call is not None else (text, [])
        content, calls = self.parser.parse(text, self.names)
        return content, calls if self.parallel else calls[:1]


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": tool["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _decoded(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def tool_finish_reason(reason: str | None) -> str | None:
    """A reply that ends in calls finishes with `tool_calls` where it would have said `stop`."""
    return "tool_calls" if reason == "stop" else reason


@dataclass(frozen=True)
class ToolStep:
    """What a streamed choice shows at one step under tools: text, or at its end its calls."""

    text: str | None
    calls: list[ToolCall]
    finish_reason: str | None


@dataclass
class ToolCallStream:
    """The mapper of a streamed reply's choice deltas under tools: a choice's text shows only up to
    where a call could begin (none of it for `required` or a named function); when the choice
    ends come its calls, or, when there are none, the rest of its text."""

    plan: ToolPlan
    shown: dict[int, int] = field(default_factory=dict)  # by choice: how much of its text was shown

    def step(self, choice: ChoiceDelta) -> ToolStep | None:
        text, shown = choice.text_so_far, self.shown.get(choice.index, 0)
        if choice.finish_reason is None:
            end = self.plan.parser.shown(text) if self.plan.choice == "auto" else 0
            if end <= shown:
                return None
            self.shown[choice.index] = end
            return ToolStep(text[shown:end], [], None)
        self.shown[choice.index] = len(text)
        _, calls = self.plan.calls(text)
        if not calls:
            return ToolStep(text[shown:], [], choice.finish_reason)
        return ToolStep(None, calls, tool_finish_reason(choice.finish_reason))


def tool_plan(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parser: ToolCallParser = PARSERS["hermes"],
    parallel: bool = True,
) -> ToolPlan | None:
    """The request's tools and choice, checked; None when no tool may be called. `parser`: the
    server's (`--tool-call-parser`); `parallel`: the request's `parallel_tool_calls`."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tools is None:
        if tool_choice != "none":
            raise RequestError(f"tool_choice {_show(tool_choice)} needs tools", param="tool_choice")
        return None
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise RequestError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise RequestError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        functions.append({key: function[key] for key in ("name", "description", "parameters") if key in function})
    if len({f["name"] for f in functions}) != len(functions):
        raise RequestError("tools must have distinct function names", param="tools")
    if tool_choice == "none":
        return None
    if tool_choice in ("auto", "required"):
        return ToolPlan(functions, tool_choice, parser=parser, parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in [f["name"] for f in functions]:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return ToolPlan(functions, "named", name, parser=parser, parallel=parallel)
    raise RequestError(
        f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}, '
        f"got {_show(tool_choice)}",
        param="tool_choice",
    )


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def render_turns(
    messages: list[dict[str, Any]], plan: ToolPlan | None, template_takes_tools: bool
) -> list[dict[str, Any]]:
    """Messages for a chat template: tool turns as the template knows them, or in the fallback
    style, with the fallback system prompt when tools are offered and the template takes none."""
    turns = []
    for message in messages:
        calls = message.get("tool_calls")
        if message["role"] == "tool" and not template_takes_tools:
            turns.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        elif calls and not template_takes_tools:
            blocks = [
                f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': json.loads(c['function']['arguments'])})}\n{CLOSE}"
                for c in calls
            ]
            turns.append({"role": "assistant", "content": "\n".join([message["content"], *blocks]).strip()})
        else:
            turns.append(message)
    if plan is not None and not template_takes_tools:
        prompt = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(tool) for tool in plan.tools))
        if turns and turns[0]["role"] == "system":
            turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{prompt}"}
        else:
            turns.insert(0, {"role": "system", "content": prompt})
    return turns


def chat_prompt(
    tokenizer: Tokenizer,
    turns: list[dict[str, Any]],
    plan: ToolPlan | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The turns (every API's, e.g. openai/chat_messages.chat_turns) and tools rendered by the chat
    template, as token ids; `template_kwargs` (`chat_template_kwargs`, e.g.
    `{"enable_thinking": false}`) are the template's extra variables."""
    takes_tools = tokenizer.template_takes_tools
    turns = render_turns(turns, plan, takes_tools)
    template_tools = [{"type": "function", "function": t} for t in plan.tools] if plan and takes_tools else None
    return tokenizer.encode_chat(turns, tools=template_tools, template_kwargs=template_kwargs)


def checked_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's `tool_calls` as OpenAI sends them back, checked: each with a function
    name and its arguments as JSON text of an object."""
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", param="messages")
    checked = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(name, str) or not isinstance(parsed, dict):
            raise RequestError(
                f"{where}.tool_calls[{i}] needs function.name and function.arguments (a JSON object as text)",
                param="messages",
            )
        checked.append(
            {"id": call.get("id", ""), "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    return checked
