"""OpenAI's Responses API (`/v1/responses`) on a real server, driven by the official `openai`
client, and by raw HTTP for the event stream and the error cases; and the bounded store behind
`previous_response_id`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest

from compiled_engine.server.openai.chat_messages import chat_turns
from compiled_engine.server.openai.protocol import ChatMessage
from compiled_engine.server.responses.protocol import ResponseObject
from compiled_engine.server.responses.store import ResponseStore
from compiled_engine.server.responses.turns import input_turns
from tests.admission import KEY as IN_PROCESS_KEY
from tests.admission import REFUSALS, in_process_app
from tests.conftest import API_KEY, API_MODEL, OTHER_API_KEY
from tests.server_process import ServerProcess, named_events

INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(api_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEY, max_retries=0)


def _chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, Any]:
    chat = client.chat.completions.create(model=API_MODEL, messages=messages, max_tokens=max_tokens, temperature=0)  # type: ignore[arg-type]
    text = chat.choices[0].message.content
    assert text
    return text, chat.usage


def test_a_response_gives_the_chat_completions_greedy_text(client: openai.OpenAI) -> None:
    expected, usage = _chat_text(
        client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 24
    )
    whole = client.responses.create(
        model=API_MODEL, input=QUESTION, instructions=INSTRUCTIONS, temperature=0, max_output_tokens=24
    )
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == API_MODEL
    assert whole.output_text == expected
    assert [item.type for item in whole.output] == ["message"]
    assert whole.status in ("completed", "incomplete") and whole.instructions == INSTRUCTIONS
    assert whole.usage is not None
    assert whole.usage.input_tokens == usage.prompt_tokens and whole.usage.output_tokens == usage.completion_tokens
    # The same conversation as a list of items, streamed.
    items: Any = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    with client.responses.stream(model=API_MODEL, input=items, temperature=0, max_output_tokens=24) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) > 1 and "".join(deltas) == expected and final.output_text == expected


def test_previous_response_id_continues_the_stored_conversation(
    client: openai.OpenAI, api_server: ServerProcess
) -> None:
    first = client.responses.create(model=API_MODEL, input=QUESTION, temperature=0, max_output_tokens=16)
    second = client.responses.create(
        model=API_MODEL, input="And of Germany?", previous_response_id=first.id, temperature=0, max_output_tokens=16
    )
    expected, _ = _chat_text(
        client,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Germany?"},
        ],
        16,
    )
    assert second.output_text == expected and second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0  # the first's pages
    # Stored: retrievable by its key, not by another's, until deleted.
    assert client.responses.retrieve(first.id).output_text == first.output_text
    other = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=OTHER_API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=API_MODEL, input="Hi", previous_response_id=first.id, max_output_tokens=2)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=API_MODEL, input="Hi", previous_response_id=first.id, max_output_tokens=2)
    unstored = client.responses.create(model=API_MODEL, input=QUESTION, store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_function_call_round_trip(client: openai.OpenAI) -> None:
    tools: Any = [WEATHER]
    called = client.responses.create(
        model=API_MODEL, input="What is the weather in Paris?", tools=tools, tool_choice="required", temperature=0
    )
    assert [item.type for item in called.output] == ["function_call"]
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments).get("city"), str)
    answered = client.responses.create(
        model=API_MODEL,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}],
        tools=tools,
        temperature=0,
        max_output_tokens=12,
    )
    assert answered.output and answered.output[0].type == "message"
    # The same turns sent whole, without the store, give the same reply.
    again = client.responses.create(
        model=API_MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
        ],
        tools=tools,
        temperature=0,
        max_output_tokens=12,
        store=False,
    )
    assert again.output_text == answered.output_text
    with client.responses.stream(
        model=API_MODEL,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert final.output[0].type == "function_call" and final.output[0].arguments == call.arguments


def test_text_format_json_schema_constrains_the_output(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model=API_MODEL,
        input="Describe a person as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
        temperature=0,
        max_output_tokens=60,
    )
    jsonschema.validate(json.loads(reply.output_text), PERSON)


def test_the_event_stream_is_numbered_and_ends_incomplete_at_max_output_tokens(api_server: ServerProcess) -> None:
    body = {"model": API_MODEL, "input": QUESTION, "max_output_tokens": 4, "temperature": 0, "stream": True}
    response = httpx.post(f"{api_server.url}/v1/responses", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = named_events(response)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == text == events[-4][1]["text"]
    assert final["usage"]["output_tokens"] == 4
    stored = httpx.get(f"{api_server.url}/v1/responses/{final['id']}", headers={"x-api-key": API_KEY})
    assert stored.status_code == 200 and stored.json()["output"][0]["content"][0]["text"] == text


ASK = {"role": "user", "content": "What is the weather in Paris?"}
ARGUMENTS = '{"city": "Paris"}'
# A call sent back and its output, as Responses items and as chat completions' messages.
TOOL_ROUND_ITEMS = [
    ASK,
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGUMENTS},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 C"},
]
TOOL_ROUND_CHAT = [
    ASK,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
]


@pytest.mark.parametrize(
    "output", ["Sunny, 24 C", [{"type": "input_text", "text": "Sunny, "}, {"type": "output_text", "text": "24 C"}]]
)
def test_a_function_call_output_becomes_the_tool_turn_chat_completions_would_render(output: Any) -> None:
    items = [*TOOL_ROUND_ITEMS[:2], {**TOOL_ROUND_ITEMS[2], "output": output}]
    assert input_turns(items) == chat_turns(msgspec.convert(TOOL_ROUND_CHAT, list[ChatMessage]))


def test_function_call_outputs_reach_the_prompt_as_chat_completions_renders_them(api_server: ServerProcess) -> None:
    """Through the wire: the prompt a response runs is the one /tokenize renders for the chat
    conversation, and it holds the function's output."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chat = {"model": API_MODEL, "messages": TOOL_ROUND_CHAT}
    tokenized = httpx.post(f"{api_server.url}/tokenize", json=chat, headers=headers, timeout=60).json()
    tokens = {"model": API_MODEL, "tokens": tokenized["tokens"]}
    assert "Sunny, 24 C" in httpx.post(f"{api_server.url}/detokenize", json=tokens, headers=headers).json()["prompt"]
    body = {"model": API_MODEL, "input": TOOL_ROUND_ITEMS, "max_output_tokens": 1, "temperature": 0, "store": False}
    response = httpx.post(f"{api_server.url}/v1/responses", json=body, headers=headers, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["input_tokens"] == tokenized["count"]


GOOD = {"model": API_MODEL, "input": "Hi", "max_output_tokens": 2}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
}


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "message"),
    [
        ("POST", "/v1/responses", {**GOOD, "colour": "red"}, AUTH, 400, "unknown field"),
        ("POST", "/v1/responses", {**GOOD, "input": 7}, AUTH, 400, "Expected `str | array`"),
        ("POST", "/v1/responses", {**GOOD, "input": []}, AUTH, 400, "input must not be empty"),
        ("POST", "/v1/responses", {**GOOD, "input": [{"role": "robot", "content": "x"}]}, AUTH, 400, "role must be one of"),
        ("POST", "/v1/responses", {**GOOD, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, AUTH, 400, "only text is supported"),
        ("POST", "/v1/responses", {**GOOD, "input": [{"type": "item_reference", "id": "x"}]}, AUTH, 400, "'item_reference'"),
        ("POST", "/v1/responses", {**GOOD, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}]}, AUTH, 400, "JSON object"),
        ("POST", "/v1/responses", {**GOOD, "tools": [{"type": "web_search"}]}, AUTH, 400, "only function tools"),
        ("POST", "/v1/responses", {**GOOD, "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, AUTH, 400, "tool_choice must be"),
        ("POST", "/v1/responses", {**GOOD, "tool_choice": "required"}, AUTH, 400, "needs tools"),
        ("POST", "/v1/responses", {**GOOD, "text": {"format": {"type": "yaml"}}}, AUTH, 400, "text.format.type"),
        ("POST", "/v1/responses", {**GOOD, "text": {"format": {"type": "json_schema", "name": "x"}}}, AUTH, 400, "needs its \"schema\""),
        ("POST", "/v1/responses", {**GOOD, "background": True}, AUTH, 400, "background"),
        ("POST", "/v1/responses", {**GOOD, "include": ["message.output_text.logprobs"]}, AUTH, 400, "include"),
        ("POST", "/v1/responses", {**GOOD, "truncation": "auto"}, AUTH, 400, "truncation"),
        ("POST", "/v1/responses", {**GOOD, "temperature": -1}, AUTH, 400, "temperature"),
        ("POST", "/v1/responses", {**GOOD, "max_output_tokens": 10**6}, AUTH, 400, "context"),
        ("POST", "/v1/responses", {**GOOD, "tools": [{**WEATHER, "colour": "red"}]}, AUTH, 400, "tools[0]: unknown fields ['colour']"),
        ("POST", "/v1/responses", {**GOOD, "tools": [{"type": "function", "parameters": WEATHER["parameters"]}]}, AUTH, 400, "tools[0].name"),
        ("POST", "/v1/responses", {**GOOD, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, AUTH, 400, "'get_time', which is not among the tools"),
        ("POST", "/v1/responses", {**GOOD, "input": [{"type": "function_call", "name": "get_weather", "arguments": "{}"}]}, AUTH, 400, "a function_call needs its call_id"),
        ("POST", "/v1/responses", {**GOOD, "input": [{"type": "function_call_output", "output": "Sunny"}]}, AUTH, 400, "needs call_id and output"),
        ("POST", "/v1/responses", GOOD, {}, 401, "API key"),
        ("POST", "/v1/responses", GOOD, {"Authorization": "Bearer wrong"}, 401, "API key"),
        ("GET", "/v1/responses/resp_nope", None, {}, 401, "API key"),
        ("POST", "/v1/responses", {**GOOD, "instructions": "x" * (1 << 20)}, AUTH, 413, "too large"),
        ("POST", "/v1/responses", {**GOOD, "previous_response_id": "resp_nope"}, AUTH, 404, "was not found"),
        ("POST", "/v1/responses", {**GOOD, "model": "gpt-5"}, AUTH, 404, "does not exist"),
        ("GET", "/v1/responses/resp_nope", None, AUTH, 404, "no stored response"),
        ("DELETE", "/v1/responses/resp_nope", None, AUTH, 404, "no stored response"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_shaped_errors_and_the_server_keeps_serving(
    api_server: ServerProcess,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
    status: int,
    message: str,
) -> None:
    response = httpx.request(method, f"{api_server.url}{path}", json=body, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["type"] == ERROR_TYPES[status]
    good = httpx.post(f"{api_server.url}/v1/responses", json=GOOD, headers=AUTH, timeout=60)
    assert good.status_code == 200 and good.json()["status"] in ("completed", "incomplete")


def test_a_full_or_draining_server_refuses_in_openais_shape(default_model_dir: Path) -> None:
    """429 (no room to wait) and 503 (draining), each with Retry-After, for whole and streamed
    responses alike: a streamed request is refused before its stream starts."""
    with in_process_app(API_MODEL) as (engine, client):
        for status, provoke in REFUSALS:
            provoke(engine)
            for stream in (False, True):
                body = {**GOOD, "stream": stream}
                response = client.post(
                    "/v1/responses", json=body, headers={"Authorization": f"Bearer {IN_PROCESS_KEY}"}
                )
                assert response.status_code == status and response.headers["Retry-After"] == "1", response.text
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == {429: "rate_limit_error", 503: "service_unavailable"}[status]
                assert ("overloaded" if status == 429 else "shutting down") in error["message"]


def _response(response_id: str) -> ResponseObject:
    return ResponseObject(
        response_id, 0, "m", "completed", [], None, None, None, 1.0, 1.0, [], "auto", True, None, True, {}, {}, None
    )


def test_the_store_is_bounded_in_count_and_age_and_keeps_keys_apart() -> None:
    now = [0.0]
    store = ResponseStore(max_responses=3, max_age_s=60.0, clock=lambda: now[0])
    for i in range(5):
        store.put(_response(f"r{i}"), [{"role": "user", "content": str(i)}], salt="a")
        now[0] += 1.0
    assert len(store) == 3 and store.get("r0", "a") is None and store.get("r1", "a") is None
    kept = store.get("r4", "a")
    assert kept is not None and kept.turns == [{"role": "user", "content": "4"}]
    assert store.get("r4", "b") is None and store.get("r4", None) is None  # another key sees nothing
    assert not store.delete("r4", "b") and store.get("r4", "a") is not None
    now[0] = 63.5  # r2 (stored at 2.0) and r3 (3.0) are 60 s old or more; r4 (4.0) is not
    assert store.get("r2", "a") is None and store.get("r3", "a") is None and store.get("r4", "a") is not None
    assert len(store) == 1
    assert store.delete("r4", "a") and len(store) == 0
    with pytest.raises(ValueError, match="max_age_s > 0"):
        ResponseStore(max_age_s=0)
