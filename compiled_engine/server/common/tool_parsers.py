"""How each family writes tool calls in its reply (`serve --tool-call-parser`, vLLM's names), for
`tool_choice: "auto"`:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after any text
  (Qwen2.5, Qwen3, Hermes, and our fallback prompt for templates without tools);
- `llama3_json`: the reply is JSON, `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several calls separated by `;` (Llama 3.1-3.3 with their templates' tools);
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` after any text;
- `pythonic`: the reply is a Python list of calls, `[get_weather(city="Paris"), ...]` (Llama 3.2
  and Llama 4), read with `ast`: keyword arguments whose values are literals.

Each parser gives the reply's text before its calls and the calls (a reply without a call of a
known function is all text), and, while a reply streams, how much of it can be shown: nothing
from where a call could be starting.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def new_call(name: str, arguments: dict[str, Any]) -> ToolCall:
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments))


def call_of(value: Any, names: list[str]) -> ToolCall | None:
    """A decoded `{"name", "arguments"}` (or `"parameters"`) object as a call of a known function."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return new_call(value["name"], arguments) if isinstance(arguments, dict) else None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class ToolCallParser(Protocol):
    @property
    def name(self) -> str: ...

    def parse(self, text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
        """The text before the calls (None when empty) and the calls; no calls: (text, [])."""
        ...

    def shown(self, text: str) -> int:
        """How much of a streaming reply's text can be shown now."""
        ...


def shown_before(text: str, marker: str) -> int:
    """How much of a streaming `text` can be shown: everything before `marker`, or before an
    ending that could still become it (the reasoning split holds back `</think>` the same way)."""
    if marker in text:
        return text.index(marker)
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


def _text_before(text: str, start: int) -> str | None:
    return text[:start].strip() or None


@dataclass(frozen=True)
class HermesParser:
    name: str = "hermes"
    OPEN = "<tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
        calls = [call for block in self.BLOCK.findall(text) if (call := call_of(_json(block), names)) is not None]
        return (_text_before(text, text.index(self.OPEN)), calls) if calls else (text, [])

    def shown(self, text: str) -> int:
        return shown_before(text, self.OPEN)


@dataclass(frozen=True)
class MistralParser:
    name: str = "mistral"
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
        if self.MARKER not in text:
            return text, []
        start = text.index(self.MARKER)
        value = _json(text[start + len(self.MARKER) :].strip())
        values = value if isinstance(value, list) else [value]
        calls = [call for v in values if (call := call_of(v, names)) is not None]
        return (_text_before(text, start), calls) if calls else (text, [])

    def shown(self, text: str) -> int:
        return shown_before(text, self.MARKER)


@dataclass(frozen=True)
class Llama3JsonParser:
    name: str = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):  # objects separated by ";"
            try:
                value, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = call_of(value, names)
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return None, calls

    def shown(self, text: str) -> int:
        body = text.lstrip()
        could_be_call = body.startswith(("{", self.TAG)) or (body and self.TAG.startswith(body))
        return 0 if could_be_call or not body else len(text)


@dataclass(frozen=True)
class PythonicParser:
    name: str = "pythonic"

    def parse(self, text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            if node.func.id not in names:
                return text, []
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except ValueError:
                return text, []
            if len(arguments) != len(node.keywords):
                return text, []
            calls.append(new_call(node.func.id, arguments))
        return None, calls

    def shown(self, text: str) -> int:
        body = text.lstrip()
        return 0 if body.startswith("[") or not body else len(text)


PARSERS: dict[str, ToolCallParser] = {
    "hermes": HermesParser(),
    "llama3_json": Llama3JsonParser(),
    "mistral": MistralParser(),
    "pythonic": PythonicParser(),
}


def tool_call_parser(name: str | None, family_default: str, template_takes_tools: bool) -> ToolCallParser:
    """The parser `--tool-call-parser` names; by default, the family's (its record's
    `tool_call_parser`) when its chat template renders the tools itself, else `hermes` (the format
    our fallback prompt asks for)."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}: choose one of {', '.join(TOOL_CALL_PARSERS)}")
        return PARSERS[name]
    return PARSERS[family_default if template_takes_tools else "hermes"]
