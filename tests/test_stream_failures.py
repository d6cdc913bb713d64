"""A failure after a stream's 200 ends it with the API's own last event, never a cut connection
(docs/api.md, "Failures mid-stream"): in process, the engine loop dies on a step's injected kernel
failure while a stream runs on each of the four streamed routes. The failed request is counted
as aborted and returns its pages. (A data-parallel replica killed mid-stream:
tests/test_data_parallel.py.)"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import uvicorn

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.stats import EngineStats
from compiled_engine.server.app import ServerSettings, create_app
from compiled_engine.serving.client import EngineClient
from compiled_engine.serving.handle import ThreadHandle
from tests.server_process import free_port

MODEL = "tiny"
QUESTION = "Count from one to fifty, one number a line."
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32, "ignore_eos": True},
    "/v1/completions": {"prompt": QUESTION, "max_tokens": 32, "ignore_eos": True},
    "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32},
    "/v1/responses": {"model": MODEL, "input": QUESTION, "max_output_tokens": 32},
}
FORWARDS_BEFORE_FAILING = 4  # the prefill and three decode steps: the 200 and some tokens are out


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    """One default-model engine, driven in turn by a loop per test (a failed step kills its loop)."""
    engine = LLMEngine(EngineConfig(enforce_eager=True, kv_cache_memory_gib=0.05))
    yield engine
    engine.shutdown()


class FailingForward:
    """The runner's forward, failing from its `after`-th call on (as a kernel error would)."""

    def __init__(self, forward: Callable[..., Any], after: int) -> None:
        self.forward, self.left = forward, after

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("injected kernel failure")
        return self.forward(*args, **kwargs)


class FailingServer:
    """The app over a loop whose forward fails, served by uvicorn on a thread (so that the
    official SDKs talk to it over HTTP)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.loop = EngineClient([ThreadHandle(engine)], 8)
        self.loop.start()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(create_app(self.loop, ServerSettings(MODEL)), port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.loop.shutdown(grace_s=1)


@pytest.fixture
def failing_app(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[FailingServer]:
    monkeypatch.setattr(engine.runner, "execute", FailingForward(engine.runner.execute, FORWARDS_BEFORE_FAILING))
    server = FailingServer(engine)
    yield server
    server.close()


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name or None, data) of each server-sent event."""
    events = []
    for block in text.strip().split("\n\n"):
        name = None
        data = []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
        events.append((name, "\n".join(data)))
    return events


def stream(server: FailingServer, route: str) -> list[tuple[str | None, str]]:
    reply = httpx.post(server.url + route, json={**BODIES[route], "stream": True, "temperature": 0}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream")
    return sse_events(reply.text)


def assert_pages_returned_and_abort_counted(engine: LLMEngine, aborted_before: int) -> None:
    stats = EngineStats.read(engine)
    assert stats.kv_pages_free == stats.kv_pages_total
    assert stats.running_requests == stats.waiting_requests == 0
    assert stats.aborted_requests == aborted_before + 1


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_an_openai_stream_ends_with_an_error_object_then_done(
    route: str, engine: LLMEngine, failing_app: FailingServer
) -> None:
    aborted = engine.num_aborted_requests
    events = stream(failing_app, route)
    *chunks, (_, error), (_, done) = events
    assert done == "[DONE]"
    body = json.loads(error)
    assert set(body) == {"error"}
    assert body["error"]["type"] == "service_unavailable"
    assert "injected kernel failure" in body["error"]["message"]
    decoded = [json.loads(data) for _, data in chunks]
    text = "".join(
        (choice.get("delta", {}).get("content") or choice.get("text") or "") for c in decoded for choice in c["choices"]
    )
    assert text, "some tokens came before the failure"
    assert all(choice.get("finish_reason") is None for c in decoded for choice in c["choices"])
    assert_pages_returned_and_abort_counted(engine, aborted)


def test_the_openai_sdk_raises_on_a_chat_stream_that_fails(failing_app: FailingServer) -> None:
    sdk = openai.OpenAI(base_url=f"{failing_app.url}/v1", api_key="unused", max_retries=0)
    body = BODIES["/v1/chat/completions"]
    chunks = sdk.chat.completions.create(
        model=MODEL, messages=body["messages"], max_tokens=32, stream=True, extra_body={"ignore_eos": True}
    )
    with pytest.raises(openai.APIError, match="injected kernel failure"):
        for _ in chunks:
            pass


def test_a_messages_stream_ends_with_an_error_event(engine: LLMEngine, failing_app: FailingServer) -> None:
    aborted = engine.num_aborted_requests
    events = stream(failing_app, "/v1/messages")
    names = [name for name, _ in events]
    assert names[0] == "message_start" and "content_block_delta" in names
    assert "message_stop" not in names and "message_delta" not in names
    name, data = events[-1]
    assert name == "error"
    body = json.loads(data)
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert "injected kernel failure" in body["error"]["message"]
    assert_pages_returned_and_abort_counted(engine, aborted)


def test_the_anthropic_sdk_raises_on_a_messages_stream_that_fails(
    failing_app: FailingServer,
) -> None:
    sdk = anthropic.Anthropic(base_url=failing_app.url, api_key="unused", max_retries=0)
    body = BODIES["/v1/messages"]
    with (
        pytest.raises(anthropic.APIStatusError, match="injected kernel failure"),
        sdk.messages.stream(model=MODEL, max_tokens=32, messages=body["messages"]) as events,
    ):
        for _ in events:
            pass


def test_a_responses_stream_ends_with_response_failed(engine: LLMEngine, failing_app: FailingServer) -> None:
    aborted = engine.num_aborted_requests
    events = stream(failing_app, "/v1/responses")
    payloads = [json.loads(data) for _, data in events]
    names = [name for name, _ in events]
    assert names[0] == "response.created" and "response.output_text.delta" in names
    assert "response.completed" not in names
    assert names[-1] == "response.failed" and payloads[-1]["type"] == "response.failed"
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    failed = payloads[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "injected kernel failure" in failed["error"]["message"]
    assert_pages_returned_and_abort_counted(engine, aborted)


def test_the_openai_sdk_reads_a_failed_responses_stream(failing_app: FailingServer) -> None:
    sdk = openai.OpenAI(base_url=f"{failing_app.url}/v1", api_key="unused", max_retries=0)
    with sdk.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=32) as events:
        kinds = [event.type for event in events]
    assert kinds[-1] == "response.failed"
    assert kinds.count("response.output_text.delta") >= 1


def test_a_failure_before_the_first_output_is_still_a_status(failing_app: FailingServer) -> None:
    """The contract's other half: a request that fails before its first output gets an HTTP
    status (here 503), not a stream."""
    failing_app.loop.engine.runner.execute.left = 0  # type: ignore[attr-defined]
    body = {**BODIES["/v1/chat/completions"], "stream": True}
    reply = httpx.post(f"{failing_app.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable"
