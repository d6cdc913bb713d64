"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on a real server, driven
by the official `anthropic` client, and by raw HTTP for the event stream and the error cases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest

from compiled_engine.server.anthropic.protocol import InputMessage
from compiled_engine.server.anthropic.turns import message_turns
from compiled_engine.server.openai.chat_messages import chat_turns
from compiled_engine.server.openai.protocol import ChatMessage
from tests.admission import KEY as IN_PROCESS_KEY
from tests.admission import REFUSALS, in_process_app
from tests.conftest import API_KEY as KEY
from tests.conftest import API_MODEL as MODEL
from tests.server_process import ServerProcess, named_events

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}  # the anthropic client (2.x) sends sampling fields through extra_body only
WEATHER = {
    "name": "get_weather",
    "description": "The current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(api_server: ServerProcess) -> ServerProcess:
    return api_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_messages_give_the_chat_completions_greedy_text(server: ServerProcess, client: anthropic.Anthropic) -> None:
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    expected = chat.choices[0].message.content
    assert expected
    messages: Any = [{"role": "user", "content": QUESTION}]
    whole = client.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=messages, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_")
    assert [block.type for block in whole.content] == ["text"]
    assert whole.content[0].text == expected
    assert whole.stop_reason == ("end_turn" if chat.choices[0].finish_reason == "stop" else "max_tokens")
    # Anthropic counts cache reads apart from input_tokens.
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    system_blocks: Any = [{"type": "text", "text": SYSTEM}]
    with client.messages.stream(
        model=MODEL, max_tokens=24, system=system_blocks, messages=messages, extra_body=GREEDY
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == expected
    assert final.content[0].text == expected and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == chat.usage.completion_tokens
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_without_temperature_it_samples_at_anthropics_default(client: anthropic.Anthropic) -> None:
    messages: Any = [{"role": "user", "content": "Write a short poem about the sea."}]
    texts = {
        client.messages.create(model=MODEL, max_tokens=12, messages=messages).content[0].text  # type: ignore[union-attr]
        for _ in range(4)
    }
    assert len(texts) > 1  # temperature 1.0: four greedy runs would be one text
    greedy = {
        client.messages.create(model=MODEL, max_tokens=12, messages=messages, extra_body=GREEDY).content[0].text  # type: ignore[union-attr]
        for _ in range(2)
    }
    assert len(greedy) == 1


def test_stop_sequences_and_max_tokens_say_why_the_reply_stopped(client: anthropic.Anthropic) -> None:
    counting: Any = [{"role": "user", "content": "Count from 1 to 10, one number per line."}]
    full = client.messages.create(model=MODEL, max_tokens=40, messages=counting, extra_body=GREEDY)
    text = full.content[0].text  # type: ignore[union-attr]
    assert "5" in text
    stopped = client.messages.create(
        model=MODEL, max_tokens=40, messages=counting, stop_sequences=["5"], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "5"
    assert stopped.content[0].text == text[: text.index("5")]  # type: ignore[union-attr]
    short = client.messages.create(model=MODEL, max_tokens=3, messages=counting, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.stop_sequence is None and short.usage.output_tokens == 3


def test_a_tool_round_trip(client: anthropic.Anthropic) -> None:
    question: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools: Any = [WEATHER]
    call = client.messages.create(
        model=MODEL, max_tokens=40, messages=question, tools=tools, tool_choice={"type": "any"}, extra_body=GREEDY
    )
    assert call.stop_reason == "tool_use"
    assert [block.type for block in call.content] == ["tool_use"]
    use = call.content[0]
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert isinstance(use.input, dict) and isinstance(use.input.get("city"), str)
    # The call and its result go back; the reply is text about it.
    answer = client.messages.create(
        model=MODEL,
        max_tokens=16,
        tools=tools,
        messages=[
            *question,
            {"role": "assistant", "content": call.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}]},
        ],
        extra_body=GREEDY,
    )
    assert answer.content and answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    # Streamed, a named tool: the call arrives as a tool_use block and its input as JSON deltas.
    with client.messages.stream(
        model=MODEL,
        max_tokens=40,
        messages=question,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "input_json" in kinds
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    assert final.content[0].input == use.input


def test_the_event_stream_follows_anthropics_sequence(server: ServerProcess) -> None:
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": QUESTION}], "stream": True}
    response = httpx.post(f"{server.url}/v1/messages", json={**body, **GREEDY}, headers={"x-api-key": KEY}, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = named_events(response)
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert all(data["index"] == 0 for name, data in events if name.startswith("content_block"))
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5 and text


ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


def _tool_round(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A question, the assistant's call, and `result` (a tool_result block) in a user turn."""
    return [ASK, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": [result]}]


def _chat_tool_round(content: str) -> list[dict[str, Any]]:
    """The same conversation as chat completions takes it: a tool call, then a `tool` message."""
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [
        ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": content},
    ]


def _as_chat(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return chat_turns(msgspec.convert(messages, list[ChatMessage]))


def _as_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return message_turns(None, msgspec.convert(messages, list[InputMessage]))


@pytest.mark.parametrize(
    ("result", "chat_content"),
    [
        ({"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 24 C"}, "Sunny, 24 C"),
        (
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "24 C"}]},
            "Sunny, 24 C",
        ),
        ({"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 24 C", "is_error": False}, "Sunny, 24 C"),
        # An error result is the tool's text after "Error: " (docs/api.md).
        ({"type": "tool_result", "tool_use_id": "toolu_1", "content": "city not found", "is_error": True}, "Error: city not found"),
        ({"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "timeout"}], "is_error": True}, "Error: timeout"),
        ({"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True}, "Error: "),
    ],
)  # fmt: skip
def test_a_tool_result_becomes_the_tool_turn_chat_completions_would_render(
    result: dict[str, Any], chat_content: str
) -> None:
    assert _as_messages(_tool_round(result)) == _as_chat(_chat_tool_round(chat_content))


def test_tool_results_reach_the_prompt_as_chat_completions_renders_them(server: ServerProcess) -> None:
    """Through the wire: the prompt /v1/messages counts is the one /tokenize renders for the chat
    conversation, and it holds the tool's answer (an error result with its prefix)."""
    headers = {"x-api-key": KEY}
    results: list[tuple[dict[str, Any], str]] = [
        ({"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 24 C"}, "Sunny, 24 C"),
        ({"type": "tool_result", "tool_use_id": "toolu_1", "content": "city not found", "is_error": True}, "Error: city not found"),
    ]  # fmt: skip
    for result, content in results:
        chat = {"model": MODEL, "messages": _chat_tool_round(content)}
        tokenized = httpx.post(f"{server.url}/tokenize", json=chat, headers=headers, timeout=60).json()
        prompt = httpx.post(
            f"{server.url}/detokenize", json={"model": MODEL, "tokens": tokenized["tokens"]}, headers=headers
        )
        assert content in prompt.json()["prompt"]
        body = {"model": MODEL, "messages": _tool_round(result)}
        counted = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, headers=headers, timeout=60)
        assert counted.status_code == 200 and counted.json() == {"input_tokens": tokenized["count"]}
        run = httpx.post(
            f"{server.url}/v1/messages", json={**body, "max_tokens": 1, **GREEDY}, headers=headers, timeout=60
        )
        usage = run.json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == tokenized["count"]


GOOD = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "kind", "message"),
    [
        ("/v1/messages", {**GOOD, "colour": "red"}, None, 400, "invalid_request_error", "unknown field"),
        ("/v1/messages", {**GOOD, "max_tokens": "four"}, None, 400, "invalid_request_error", "Expected `int`"),
        ("/v1/messages", {k: v for k, v in GOOD.items() if k != "max_tokens"}, None, 400, "invalid_request_error", "max_tokens"),
        ("/v1/messages", {**GOOD, "max_tokens": 0}, None, 400, "invalid_request_error", "at least 1"),
        ("/v1/messages", {**GOOD, "max_tokens": 10**6}, None, 400, "invalid_request_error", "context"),
        ("/v1/messages", {**GOOD, "messages": []}, None, 400, "invalid_request_error", "at least one message"),
        ("/v1/messages", {**GOOD, "messages": [{"role": "bot", "content": "x"}]}, None, 400, "invalid_request_error", "'user' or 'assistant'"),
        (
            "/v1/messages",
            {**GOOD, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
            None, 400, "invalid_request_error", "image blocks are not supported",
        ),
        (
            "/v1/messages",
            {**GOOD, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            None, 400, "invalid_request_error", "not allowed in a user message",
        ),
        ("/v1/messages", {**GOOD, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, None, 400, "invalid_request_error", "video"),
        ("/v1/messages", {**GOOD, "tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, None, 400, "invalid_request_error", "tool_choice must be"),
        ("/v1/messages", {**GOOD, "tools": [{"name": "f"}]}, None, 400, "invalid_request_error", "input_schema"),
        ("/v1/messages", {**GOOD, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, None, 400, "invalid_request_error", "only custom tools"),
        ("/v1/messages", {**GOOD, "tool_choice": {"type": "any"}}, None, 400, "invalid_request_error", "needs tools"),
        ("/v1/messages", {**GOOD, "tools": [{**WEATHER, "colour": "red"}]}, None, 400, "invalid_request_error", "tools.0: unknown fields ['colour']"),
        ("/v1/messages", {**GOOD, "tools": [{"input_schema": WEATHER["input_schema"]}]}, None, 400, "invalid_request_error", "tools.0.name"),
        ("/v1/messages", {**GOOD, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}}, None, 400, "invalid_request_error", "'get_time', which is not among the tools"),
        ("/v1/messages", {**GOOD, "temperature": -1}, None, 400, "invalid_request_error", "temperature"),
        ("/v1/messages", {**GOOD, "model": "claude-opus"}, None, 404, "not_found_error", "does not exist"),
        ("/v1/messages", GOOD, {"x-api-key": "wrong"}, 401, "authentication_error", "API key"),
        ("/v1/messages", GOOD, {}, 401, "authentication_error", "API key"),
        ("/v1/messages/count_tokens", {"model": MODEL, "messages": GOOD["messages"]}, {}, 401, "authentication_error", "API key"),
        ("/v1/messages", {**GOOD, "system": "x" * (1 << 20)}, None, 413, "request_too_large", "too large"),
        ("/v1/messages/count_tokens", {"model": MODEL, "messages": GOOD["messages"], "system": "x" * (1 << 20)}, None, 413, "request_too_large", "too large"),
        ("/v1/messages/count_tokens", {"model": MODEL, "messages": "Hi"}, None, 400, "invalid_request_error", "Expected `array`"),
        ("/v1/messages/count_tokens", {"model": MODEL, "messages": [], "max_tokens": 4}, None, 400, "invalid_request_error", "unknown field"),
        ("/v1/messages/count_tokens", {"model": MODEL, "messages": []}, None, 400, "invalid_request_error", "at least one message"),
    ],
)  # fmt: skip
def test_bad_requests_get_anthropic_shaped_errors_and_the_server_keeps_serving(
    server: ServerProcess,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None,
    status: int,
    kind: str,
    message: str,
) -> None:
    response = httpx.post(
        f"{server.url}{path}", json=body, headers={"x-api-key": KEY} if headers is None else headers, timeout=60
    )
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert message in error["error"]["message"]
    good = httpx.post(f"{server.url}/v1/messages", json={**GOOD, **GREEDY}, headers={"x-api-key": KEY}, timeout=60)
    assert good.status_code == 200 and good.json()["content"][0]["type"] == "text"


def test_x_api_key_is_accepted_on_the_openai_routes_too(server: ServerProcess) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"x-api-key": KEY}).status_code == 200
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", GOOD),
        ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"model": MODEL, "max_tokens": 2, "prompt": "Hi"}),
    ],
)
def test_streams_are_served_as_event_streams(server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    response = httpx.post(f"{server.url}{path}", json={**body, "stream": True}, headers={"x-api-key": KEY}, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.rstrip().split("\n")[-1].startswith("data: ")


def test_a_full_or_draining_server_refuses_in_anthropics_shape(default_model_dir: Path) -> None:
    """429 (no room to wait) and 503 (draining), each with Retry-After, for whole and streamed
    messages alike: a streamed request is refused before its stream starts."""
    with in_process_app(MODEL) as (engine, client):
        for status, provoke in REFUSALS:
            provoke(engine)
            for stream in (False, True):
                body = {**GOOD, "stream": stream}
                response = client.post("/v1/messages", json=body, headers={"x-api-key": IN_PROCESS_KEY})
                assert response.status_code == status and response.headers["Retry-After"] == "1", response.text
                error = response.json()
                assert set(error) == {"type", "error"} and error["type"] == "error"
                assert error["error"]["type"] == {429: "rate_limit_error", 503: "overloaded_error"}[status]
                assert ("overloaded" if status == 429 else "shutting down") in error["error"]["message"]
