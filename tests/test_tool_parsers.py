"""The tool-call formats of `--tool-call-parser` (server/common/tool_parsers.py): each parses its own
format, leaves anything else as text, and while a reply streams shows nothing from where a call
could begin; the stream mapper over each; the default by family."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from compiled_engine.model.registry import FAMILIES
from compiled_engine.server.common.deltas import ChoiceDelta
from compiled_engine.server.common.tool_parsers import PARSERS, ToolCallParser, tool_call_parser
from compiled_engine.server.common.tools import ToolCallStream, ToolPlan

NAMES = ["get_weather", "add"]
WEATHER = {"city": "Paris", "days": 2}
ADD = {"a": 1, "b": [2.5, True, None], "c": {"d": "e"}}


def _calls(parser: ToolCallParser, text: str) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
    content, calls = parser.parse(text, NAMES)
    return content, [(call.name, json.loads(call.arguments)) for call in calls]


TWO_CALLS = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": [2.5, true, null], "c": {"d": "e"}}}</tool_call>',
    "mistral": 'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
    '{"name": "add", "arguments": {"a": 1, "b": [2.5, true, null], "c": {"d": "e"}}}]',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
    '{"name": "add", "parameters": {"a": 1, "b": [2.5, true, null], "c": {"d": "e"}}}',
    "pythonic": '[get_weather(city="Paris", days=2), add(a=1, b=[2.5, True, None], c={"d": "e"})]',
}
TEXT_FIRST = {"hermes": "Let me check.", "mistral": "Let me check.", "llama3_json": None, "pythonic": None}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_parser_reads_several_calls_of_its_format(name: str) -> None:
    content, calls = _calls(PARSERS[name], TWO_CALLS[name])
    assert content == TEXT_FIRST[name]
    assert calls == [("get_weather", WEATHER), ("add", ADD)]


NOT_CALLS = {
    "hermes": ["The weather is nice.", "<tool_call>not json</tool_call>", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'],
    "mistral": ["Plain text.", "[TOOL_CALLS]not json", '[TOOL_CALLS][{"name": "rm", "arguments": {}}]'],
    "llama3_json": ["Plain text.", '{"name": "rm", "parameters": {}}', '{"name": "add", "parameters": {"a": 1}} trailing', '{"a": 1}'],
    "pythonic": ["Plain text.", "[1, 2]", "[rm(x=1)]", "[add(1, 2)]", "[add(a=open('f'))]", "[add(a=1)", "[]"],
}  # fmt: skip


@pytest.mark.parametrize(("name", "text"), [(name, text) for name, texts in NOT_CALLS.items() for text in texts])
def test_anything_else_is_text(name: str, text: str) -> None:
    assert PARSERS[name].parse(text, NAMES) == (text, [])


@pytest.mark.parametrize(
    ("name", "text", "shown"),
    [
        ("hermes", "Hello <tool", len("Hello ")),
        ("hermes", "Hello <tool_call>{", len("Hello ")),
        ("hermes", "a < b", len("a < b")),
        ("mistral", "Sure [TOOL_", len("Sure ")),
        ("mistral", "x [1]", len("x [1]")),
        ("llama3_json", "  {", 0),
        ("llama3_json", "<|python", 0),
        ("llama3_json", "The answer", len("The answer")),
        ("pythonic", "[get_wea", 0),
        ("pythonic", "Sure, here", len("Sure, here")),
        ("pythonic", "", 0),
    ],
)
def test_a_stream_shows_nothing_from_where_a_call_could_begin(name: str, text: str, shown: int) -> None:
    assert PARSERS[name].shown(text) == shown


def _choice(text: str, finished: bool) -> ChoiceDelta:
    return ChoiceDelta(0, "", 0, text, [], None, "stop" if finished else None, None)


PLAN_TOOLS = [{"name": name, "parameters": {"type": "object"}} for name in NAMES]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_streamed_calls_come_whole_at_the_end_with_finish_reason_tool_calls(name: str) -> None:
    text = TWO_CALLS[name]
    stream = ToolCallStream(ToolPlan(PLAN_TOOLS, "auto", parser=PARSERS[name]))
    shown, calls, reasons = "", [], []
    for end in range(1, len(text) + 1):
        step = stream.step(_choice(text[:end], end == len(text)))
        if step is not None:
            shown += step.text or ""
            calls += step.calls
            reasons.append(step.finish_reason)
    assert shown == (TEXT_FIRST[name] or "") + (" " if name == "mistral" else "\n" if name == "hermes" else "")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("add", ADD)]
    assert reasons[-1] == "tool_calls" and all(r is None for r in reasons[:-1])


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    plan = ToolPlan(PLAN_TOOLS, "auto", parser=PARSERS["pythonic"], parallel=False)
    content, calls = plan.calls(TWO_CALLS["pythonic"])
    assert content is None and [c.name for c in calls] == ["get_weather"]


def test_the_default_follows_the_family_when_its_template_renders_tools() -> None:
    def default(family: str) -> str:  # what the server passes: the family record's default
        return FAMILIES[family].tool_call_parser

    assert tool_call_parser(None, default("llama"), True).name == "llama3_json"
    assert tool_call_parser(None, default("llama"), False).name == "hermes"  # our fallback prompt asks for hermes
    assert tool_call_parser(None, default("mistral"), True).name == "mistral"
    assert tool_call_parser(None, default("qwen3"), True).name == "hermes"
    assert tool_call_parser("pythonic", default("qwen3"), False).name == "pythonic"
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'"):
        tool_call_parser("xml", default("llama"), True)


def test_serve_refuses_an_unknown_parser_before_loading_anything() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "compiled_engine", "serve", "--tool-call-parser", "xml"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "--tool-call-parser: invalid choice: 'xml'" in done.stderr
