"""The Messages and Responses stream event mappers (anthropic/replies.py, responses/replies.py),
driven directly, without a server: a reply that thinks, then writes text, then calls a tool, fed
to them piece by piece as the engine's outputs and ended at every piece. Each stream must be
well-formed however far it got, close every block or item it opened once the reply ends, type-check
against the official SDK's event types, and read back through the SDK's own stream helper
(`client.messages.stream`, `client.responses.stream`, over an HTTP transport that serves it) as
the reply the route gives unstreamed."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import httpx2
import msgspec
import openai
import pydantic
import pytest
from anthropic.types import RawMessageStreamEvent
from openai.types.responses import ResponseStreamEvent

from compiled_engine.engine.outputs import CompletionOutput, RequestOutput
from compiled_engine.server.anthropic.replies import message_events, message_reply
from compiled_engine.server.common.deltas import choice_deltas
from compiled_engine.server.common.reasoning import ReasoningParser
from compiled_engine.server.common.tool_parsers import PARSERS
from compiled_engine.server.common.tools import tool_plan
from compiled_engine.server.responses.replies import ResponseFrame, response_events, response_reply

MODEL = "smol"
THINKING = "\nI should check the weather.\n"
TEXT = "\n\nLet me look that up.\n"
REPLY = f'<think>{THINKING}</think>{TEXT}<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call>'
# Token-like pieces; the tags arrive cut in two ("<" then "think>"), as tokenizers may cut them.
PIECES = re.findall(r"<|/?\w+>|\w+|\s+|[^\w\s<]+", REPLY)
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PLAN = tool_plan(
    [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}], "auto", PARSERS["hermes"]
)
REASONING = ReasoningParser("qwen3")
PROMPT = [1, 2, 3]
CUTS = range(1, len(PIECES) + 1)
# Ids the mappers draw at random (tool calls, Responses' items), for comparing two streams.
RANDOM_ID = re.compile(r'"(toolu|call|msg|rs|fc)_[0-9a-f]{24,}"')


def test_the_pieces_make_the_reply() -> None:
    assert "".join(PIECES) == REPLY and len(PIECES) > 40
    assert "<" in PIECES and "think>" in PIECES and "/think>" in PIECES


def _outputs(cut: int, finish: str | None) -> list[RequestOutput]:
    """The engine's outputs for the first `cut` pieces; the last one finishes with `finish`."""
    outputs = []
    for i in range(cut):
        last = i == cut - 1 and finish is not None
        choice = CompletionOutput(0, "".join(PIECES[: i + 1]), list(range(i + 1)), finish if last else None)
        outputs.append(RequestOutput("r", None, PROMPT, [choice], last))
    return outputs


def _events(mapper: Callable[[Any], AsyncIterator[bytes]], outputs: list[RequestOutput]) -> list[bytes]:
    async def sent() -> AsyncIterator[RequestOutput]:
        for output in outputs:
            yield output

    async def run() -> list[bytes]:
        return [event async for event in mapper(choice_deltas(None, sent()))]

    return asyncio.run(run())


def _parsed(events: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    parsed = []
    for event in events:
        assert event.endswith(b"\n\n") and event.count(b"\n\n") == 1, event
        name, data = event.decode().removesuffix("\n\n").split("\n")
        parsed.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return parsed


def _without_random_ids(value: Any) -> str:
    return RANDOM_ID.sub(r'"\1_"', json.dumps(value, sort_keys=True))


def _served(body: bytes) -> httpx2.Client:
    """An HTTP client (of the SDKs' HTTP package) whose every request is answered with `body` as
    an event stream."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return httpx2.Client(transport=httpx2.MockTransport(answer))


# -- Anthropic Messages ---------------------------------------------------------------------------

MESSAGE_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
BLOCK_DELTAS = {"thinking": "thinking_delta", "text": "text_delta", "tool_use": "input_json_delta"}


def _message_events(outputs: list[RequestOutput]) -> list[bytes]:
    return _events(lambda steps: message_events("msg_test", MODEL, steps, PLAN, [], REASONING), outputs)


def _check_message_events(events: list[tuple[str, dict[str, Any]]], finished: bool) -> None:
    """Anthropic's order: message_start, ping, then blocks one at a time (start, deltas of the
    block's own kind, stop; indexes from 0), then message_delta and message_stop once finished."""
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and all(name == data["type"] for name, data in events)
    for name, data in events:
        if name != "ping":
            MESSAGE_EVENT.validate_python(data, strict=True)
    open_block: tuple[int, str] | None = None
    blocks = 0
    for i, (name, data) in enumerate(events[2:], 2):
        if name.startswith("content_block"):
            assert "message_delta" not in names[:i], events
        if name == "content_block_start":
            assert open_block is None and data["index"] == blocks, events
            open_block, blocks = (blocks, data["content_block"]["type"]), blocks + 1
        elif name == "content_block_delta":
            assert open_block is not None and data["index"] == open_block[0], events
            assert data["delta"]["type"] == BLOCK_DELTAS[open_block[1]]
        elif name == "content_block_stop":
            assert open_block is not None and data["index"] == open_block[0], events
            open_block = None
        else:
            assert name in ("message_delta", "message_stop") and open_block is None, events
    if finished:
        assert names[-2:] == ["message_delta", "message_stop"] and names.count("message_stop") == 1
        assert open_block is None
    else:
        assert "message_delta" not in names and "message_stop" not in names


def _read_message(body: bytes) -> tuple[list[str], Any]:
    """The stream as the anthropic client reads it: its events' types, and the message it accumulates."""
    client = anthropic.Anthropic(api_key="k", base_url="http://test", http_client=_served(body), max_retries=0)
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.messages.stream(model=MODEL, max_tokens=64, messages=ask) as stream:
        kinds: list[str] = [event.type for event in stream]
        return kinds, stream.get_final_message()


def _blocks(content: list[Any]) -> list[dict[str, Any]]:
    """Content blocks as plain dicts; a text block's surrounding whitespace is dropped, and with it
    a block of whitespace only (the whole reply trims the text before a call; a stream has shown
    it by the time the call comes)."""
    blocks = []
    for block in content:
        value = block if isinstance(block, dict) else block.model_dump(exclude_none=True)
        value = {k: v for k, v in value.items() if k not in ("id", "parsed_output", "citations")}
        if value["type"] == "text":
            value["text"] = value["text"].strip()
            if not value["text"]:
                continue
        blocks.append(value)
    return blocks


def test_a_streamed_message_thinks_writes_and_calls_and_reads_back_whole() -> None:
    outputs = _outputs(len(PIECES), "stop")
    events = _message_events(outputs)
    _check_message_events(_parsed(events), finished=True)
    kinds, message = _read_message(b"".join(events))
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "input_json" in kinds
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, call = message.content
    assert thinking.type == "thinking" and thinking.thinking == THINKING
    assert text.type == "text" and text.text == TEXT
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    assert call.id.startswith("toolu_")
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert message.usage.input_tokens == len(PROMPT) and message.usage.output_tokens == len(PIECES)
    whole = message_reply("msg_test", MODEL, outputs[-1], PLAN, [], REASONING)
    assert [block["type"] for block in msgspec.to_builtins(whole.content)] == ["thinking", "text", "tool_use"]
    assert _blocks(message.content) == _blocks(msgspec.to_builtins(whole.content))


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_message_stream_ended_anywhere_closes_its_blocks_and_reads_back_as_the_whole_reply(finish: str) -> None:
    whole_stream = _parsed(_message_events(_outputs(len(PIECES), finish)))
    for cut in CUTS:
        running = _parsed(_message_events(_outputs(cut, None)))
        _check_message_events(running, finished=False)
        # What a running stream has sent is never taken back: the whole stream starts with it.
        assert _without_random_ids(running) == _without_random_ids(whole_stream[: len(running)]), cut
        outputs = _outputs(cut, finish)
        events = _message_events(outputs)
        _check_message_events(_parsed(events), finished=True)
        _, message = _read_message(b"".join(events))
        whole = message_reply("msg_test", MODEL, outputs[-1], PLAN, [], REASONING)
        assert _blocks(message.content) == _blocks(msgspec.to_builtins(whole.content)), cut
        assert (message.stop_reason, message.stop_sequence) == (whole.stop_reason, whole.stop_sequence), cut
        assert message.usage.output_tokens == whole.usage.output_tokens == cut


# -- OpenAI Responses -----------------------------------------------------------------------------

RESPONSE_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "parameters": PARAMETERS, "strict": False}
FRAME = ResponseFrame(
    "resp_test",
    MODEL,
    {
        "instructions": None,
        "max_output_tokens": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "tools": [WEATHER],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "store": True,
        "text": {"format": {"type": "text"}},
        "metadata": {},
        "user": None,
    },
)
# Each item's events between its `output_item.added` and its `output_item.done`.
ITEM_EVENTS = {
    "reasoning": ("response.reasoning_text.delta", "response.reasoning_text.done"),
    "message": (
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
    ),
    "function_call": ("response.function_call_arguments.delta", "response.function_call_arguments.done"),
}
FINAL_EVENTS = ("response.completed", "response.incomplete")


def _response_events(outputs: list[RequestOutput], stored: list[Any] | None = None) -> list[bytes]:
    keep = stored.append if stored is not None else lambda response: None
    return _events(lambda steps: response_events(FRAME, steps, PLAN, keep, REASONING), outputs)


def _item_text(item: dict[str, Any]) -> str:
    if item["type"] == "function_call":
        return str(item["arguments"])
    return "".join(part["text"] for part in item["content"])


def _check_response_events(events: list[tuple[str, dict[str, Any]]], finished: bool) -> None:
    """Numbered from 0; response.created and .in_progress first; items one at a time, each opened
    at the next output index and closed with what its deltas added up to; once finished, the
    final response holds exactly the closed items."""
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    for _, data in events:
        RESPONSE_EVENT.validate_python(data, strict=True)
    assert names[:2] == ["response.created", "response.in_progress"]
    assert all(data["response"]["status"] == "in_progress" and not data["response"]["output"] for _, data in events[:2])
    done: list[dict[str, Any]] = []
    item: dict[str, Any] | None = None  # the open one
    added = ""  # what its deltas added up to
    for name, data in events[2:]:
        if name == "response.output_item.added":
            assert item is None and data["output_index"] == len(done), events
            item, added = data["item"], ""
            assert item["status"] == "in_progress" and not _item_text(item), item
        elif name == "response.output_item.done":
            assert item is not None and data["output_index"] == len(done), events
            closed = data["item"]
            assert closed["id"] == item["id"] and closed["type"] == item["type"] and closed["status"] == "completed"
            assert _item_text(closed) == added, (closed, added)
            done.append(closed)
            item = None
        elif name in FINAL_EVENTS:
            assert item is None and data is events[-1][1], events  # nothing after it
            assert data["response"]["output"] == done
        else:
            assert item is not None and name in ITEM_EVENTS[item["type"]], (name, item)
            assert data["item_id"] == item["id"] and data["output_index"] == len(done)
            if name.endswith(".delta"):
                added += data["delta"]
            elif name.endswith(".done") and "part" not in data:
                assert data.get("text", data.get("arguments")) == added
            elif "part" in data:
                assert data["content_index"] == 0 and data["part"]["text"] == ("" if name.endswith("added") else added)
    if finished:
        assert names[-1] in FINAL_EVENTS and item is None
    else:
        assert not any(final in names for final in FINAL_EVENTS)


def _read_response(body: bytes) -> tuple[list[Any], Any]:
    """The stream as the openai client reads it: its events, and the final response (the
    response.completed one the client assembles, or the response.incomplete event's)."""
    client = openai.OpenAI(api_key="k", base_url="http://test/v1", http_client=_served(body), max_retries=0)
    tools: Any = [WEATHER]
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=tools) as stream:
        events = list(stream)
        if events[-1].type == "response.incomplete":
            return events, events[-1].response
        return events, stream.get_final_response()


def _items(output: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Output items by what they say (ids aside); a message's surrounding whitespace dropped, and
    with it a message of whitespace only (see _blocks)."""
    items: list[tuple[Any, ...]] = []
    for item in output:
        if item["type"] == "function_call":
            items.append(("function_call", item["name"], json.loads(item["arguments"]), item["status"]))
        elif item["type"] != "message" or _item_text(item).strip():
            items.append((item["type"], _item_text(item).strip(), item["status"]))
    return items


def test_a_streamed_response_thinks_writes_and_calls_and_reads_back_whole() -> None:
    outputs = _outputs(len(PIECES), "stop")
    stored: list[Any] = []
    events = _response_events(outputs, stored)
    parsed = _parsed(events)
    _check_response_events(parsed, finished=True)
    seen, response = _read_response(b"".join(events))
    assert [event.type for event in seen] == [name for name, _ in parsed]
    text_deltas = [event for event in seen if event.type == "response.output_text.delta"]
    assert text_deltas[-1].snapshot == TEXT  # the client's own accumulation of the deltas
    arguments = [event for event in seen if event.type == "response.function_call_arguments.delta"]
    assert json.loads(arguments[-1].snapshot) == {"city": "Paris"}
    assert response.status == "completed" and response.id == "resp_test"
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content and reasoning.content[0].text == THINKING
    assert message.type == "message" and response.output_text == TEXT
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert response.usage is not None and response.usage.output_tokens == len(PIECES)
    # What the route stores is the final event's response.
    assert [msgspec.to_builtins(response) for response in stored] == [parsed[-1][1]["response"]]
    whole = msgspec.to_builtins(response_reply(FRAME, outputs[-1], PLAN, REASONING))
    assert _items(whole["output"]) == _items(parsed[-1][1]["response"]["output"])


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_response_stream_ended_anywhere_closes_its_items_and_reads_back_as_the_whole_reply(finish: str) -> None:
    whole_stream = _parsed(_response_events(_outputs(len(PIECES), finish)))
    for cut in CUTS:
        running = _parsed(_response_events(_outputs(cut, None)))
        _check_response_events(running, finished=False)
        assert _without_random_ids(running) == _without_random_ids(whole_stream[: len(running)]), cut
        outputs = _outputs(cut, finish)
        events = _response_events(outputs)
        parsed = _parsed(events)
        _check_response_events(parsed, finished=True)
        _, response = _read_response(b"".join(events))
        whole = msgspec.to_builtins(response_reply(FRAME, outputs[-1], PLAN, REASONING))
        read_back = [item.model_dump() for item in response.output]
        assert _items(read_back) == _items(whole["output"]), cut
        assert response.status == whole["status"] == ("completed" if finish == "stop" else "incomplete"), cut
        assert response.usage is not None and response.usage.output_tokens == cut
