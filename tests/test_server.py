"""The HTTP server as users meet it: a real process on a loopback port, driven by the official
openai client and by raw HTTP for the error cases."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from compiled_engine import LLM, SamplingParams
from tests.server_process import ABORTED, ServerProcess, metric, running_server, wait_until_aborted_and_idle
from tests.waiting import wait_until

KEY_A, KEY_B = "key-a", "key-b"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
MODEL = "smol"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("server"),
        "--api-key",
        KEY_A,
        "--api-key",
        KEY_B,
        "--served-model-name",
        MODEL,
        "--kv-cache-memory-gib",
        "0.05",
        "--max-body-bytes",
        "65536",
    ) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(server: ServerProcess) -> Samples:
    """Every sample of one /metrics scrape, by name and labels."""
    response = httpx.get(f"{server.url}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    samples: Samples = {}
    for line in response.text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE_LINE.match(line)
        assert match is not None, f"a /metrics line that is not a sample: {line!r}"
        name, labels, value = match.groups()
        samples[(name, frozenset(LABEL.findall(labels or "")))] = float(value)
    return samples


def sample(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    if key not in samples:
        same_name = sorted(str(dict(found)) for found_name, found in samples if found_name == name)
        raise AssertionError(f"/metrics has no {name} with labels {labels}; with that name: {same_name}")
    return samples[key]


def wait_for_sample(server: ServerProcess, name: str, value: float, **labels: str) -> Samples:
    """Scrape until `name{labels}` equals `value` (30 s only bound a failure); the last scrape."""
    deadline = time.monotonic() + 30.0
    while True:
        samples = scrape(server)
        if sample(samples, name, **labels) == value or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


IDLE = ("compiled_engine_kv_pages_used", "compiled_engine_running_requests", "compiled_engine_waiting_requests")


def wait_until_idle(server: ServerProcess) -> None:
    """Wait until no request waits or runs and no KV page is in use. (The gauges are the engine's
    state after its last step: a request sent during a long step counts as waiting.)"""
    wait_until(
        lambda: all(metric(server, name) == 0 for name in IDLE),
        "the server idle",
        lambda: {name: metric(server, name) for name in IDLE},
    )


def test_health_ready_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").json() == {"status": "ready"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_streamed_equals_plain_equals_offline(client: openai.OpenAI, default_model_dir: Path) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    text = plain.choices[0].message.content
    assert text is not None and "Paris" in text
    assert plain.choices[0].finish_reason == "stop"
    assert plain.usage is not None and plain.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == text and finish == "stop"
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt as just before
    offline = LLM(kv_cache_memory_gib=0.02).chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))  # type: ignore[arg-type]
    assert offline[0].text == text


def test_completions_streamed_equals_plain(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=12, temperature=0)
    chunks = client.completions.create(
        model=MODEL, prompt="The three primary colors are", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert (
        plain.choices[0].finish_reason == "length" and plain.usage is not None and plain.usage.completion_tokens == 12
    )
    ids = client.completions.create(
        model=MODEL, prompt=[504, 2365, 3903, 5063, 359], max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    choice = ids.choices[0]
    assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 3
    assert all(len(t) == 2 for t in choice.logprobs.top_logprobs or [])


def test_auth(server: ServerProcess) -> None:
    body = {"messages": QUESTION, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY_A}):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # liveness needs no key


def test_tenants_never_hit_each_others_cache(server: ServerProcess) -> None:
    body = {"prompt": "A long shared prefix for the cache isolation test: " * 4, "max_tokens": 1, "temperature": 0}

    def cached(key: str) -> int:
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(KEY_A) == 0
    assert cached(KEY_B) == 0  # same prompt, other tenant: no hit
    assert cached(KEY_A) > 0


BAD_INPUTS = [
    ("not json", None, 400, "malformed"),
    (None, {"messages": "hi"}, 400, "invalid request body"),
    (None, {"messages": QUESTION, "unknown_field": 1}, 400, "unknown field"),
    (None, {"messages": QUESTION, "max_tokens": -1}, 400, "max_tokens must be at least 1"),
    (None, {"messages": QUESTION, "max_tokens": 10**9}, 400, "exceeds the context length"),
    (None, {"messages": QUESTION, "temperature": -0.5}, 400, "temperature must be finite and >= 0"),
    (None, {"messages": QUESTION, "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    (None, {"messages": []}, 400, "messages must not be empty"),
    (None, {"messages": QUESTION, "continue_final_message": True}, 400, "continue_final_message: only false"),
    (None, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role must be one of"),
    (None, {"messages": QUESTION, "tools": [{"type": "function"}]}, 400, 'tools[0] must be {"type": "function"'),
    (
        None,
        {"messages": QUESTION, "response_format": {"type": "xml"}},
        400,
        "response_format type must be",
    ),
    (None, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "only text is supported"),
    (None, {"messages": QUESTION, "model": "gpt-4"}, 404, "does not exist"),
    (
        None,
        {"messages": [{"role": "user", "content": "word " * 9000}]},
        400,
        "tokens; this model's context length is 1152 tokens",
    ),
    (None, {"messages": [{"role": "user", "content": "x" * 70000}]}, 413, "too large"),
]


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}


def _refused(
    server: ServerProcess, route: str, raw: str | None, body: dict[str, object] | None, status: int, message: str
) -> dict[str, Any]:
    """The OpenAI error a bad body gets on `route`: its status, shape, type, message, and the
    context-length code where that is the problem."""
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    content = raw if raw is not None else json.dumps(body)
    response = httpx.post(f"{server.url}{route}", content=content, headers=headers)
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["type"] == ERROR_TYPES[status]
    if "context length" in message:
        assert error["code"] == "context_length_exceeded"
    return error


@pytest.mark.parametrize(("raw", "body", "status", "message"), BAD_INPUTS)
def test_bad_input_gets_its_status_and_an_openai_error(
    server: ServerProcess, raw: str | None, body: dict[str, object] | None, status: int, message: str
) -> None:
    _refused(server, "/v1/chat/completions", raw, body, status, message)
    assert httpx.get(f"{server.url}/ready").status_code == 200


COMPLETION_BAD_INPUTS = [
    ("not json", None, 400, "malformed", None),
    (None, {"prompt": "Hi", "unknown_field": 1}, 400, "unknown field", None),
    (None, {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens must be at least 1", "max_tokens"),
    (None, {"prompt": "Hi", "temperature": -0.5}, 400, "temperature must be finite and >= 0", "temperature"),
    (None, {"prompt": "word " * 2000}, 400, "context length", "prompt"),
    (None, {"prompt": [10**7]}, 400, "outside the vocabulary", "prompt"),
    (None, {"prompt": "Hi", "model": "gpt-4"}, 404, "does not exist", "model"),
    # A router's added fields are served at the value it sends, refused at any other.
    (None, {"prompt": "Hi", "no_stop_trim": True}, 400, "no_stop_trim: only false is supported", "no_stop_trim"),
    (None, {"prompt": "Hi", "skip_special_tokens": False}, 400, "only true is supported", "skip_special_tokens"),
]


@pytest.mark.parametrize(("raw", "body", "status", "message", "param"), COMPLETION_BAD_INPUTS)
def test_bad_completion_input_gets_its_status_type_code_and_param(
    server: ServerProcess, raw: str | None, body: dict[str, object] | None, status: int, message: str, param: str | None
) -> None:
    error = _refused(server, "/v1/completions", raw, body, status, message)
    assert error["param"] == param or param is None


def test_reset_prefix_cache_needs_the_key_and_clears_the_cache(server: ServerProcess) -> None:
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 401
    body = {"prompt": "A prompt long enough to fill a page or two of the cache. " * 4, "max_tokens": 1}
    headers = {"Authorization": f"Bearer {KEY_A}"}

    def cached() -> int:
        reply = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
        return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    cached()
    assert cached() > 0
    assert httpx.post(f"{server.url}/reset_prefix_cache", headers=headers, timeout=30).status_code == 200
    assert cached() == 0


def test_an_unknown_route_is_a_404_in_openai_shape(server: ServerProcess) -> None:
    response = httpx.get(f"{server.url}/v1/no-such-route")
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


DEEP = 5000
NESTED_BODIES = {
    "prompt": '{"prompt": ' + "[" * DEEP + "]" * DEEP + "}",
    "messages": '{"messages": ' + "[" * DEEP + "]" * DEEP + "}",
    "objects": '{"a":' * DEEP + "1" + "}" * DEEP,
    "arrays": "[" * DEEP + "]" * DEEP,
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body", list(NESTED_BODIES.values()), ids=list(NESTED_BODIES))
def test_a_body_too_deep_to_decode_is_a_400(server: ServerProcess, path: str, body: str) -> None:
    # The JSON decoder recurses once per level: 5,000 levels used to raise RecursionError, a 500.
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    response = httpx.post(f"{server.url}{path}", content=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert "nested too deeply" in error["message"]
    assert httpx.get(f"{server.url}/ready").status_code == 200


ENGINE_REFUSALS = [
    ("/v1/completions", {"prompt": []}, "the prompt is empty", "prompt", None),
    ("/v1/completions", {"prompt": ""}, "the prompt is empty", "prompt", None),
    ("/v1/completions", {"prompt": [5, 10**6]}, "token id 1000000 is outside the vocabulary", "prompt", None),
    (
        "/v1/completions",
        {"prompt": [5] * 1200},
        "the prompt has 1200 tokens; this model's context length is 1152 tokens",
        "prompt",
        "context_length_exceeded",
    ),
    (
        "/v1/completions",
        {"prompt": [5] * 1100, "max_tokens": 100},
        "the prompt has 1100 tokens and max_tokens is 100: 1200 exceeds the context length 1152",
        "max_tokens",
        "context_length_exceeded",
    ),
    ("/v1/completions", {"prompt": [5], "max_tokens": 0}, "max_tokens must be at least 1, got 0", "max_tokens", None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "word " * 1200}]},
        "tokens; this model's context length is 1152 tokens",
        "messages",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {"messages": QUESTION, "max_tokens": 10**9},
        "exceeds the context length 1152",
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {"messages": QUESTION, "logprobs": True, "top_logprobs": 21},
        "logprobs must be in [0, 20]",
        "top_logprobs",
        None,
    ),
]


@pytest.mark.parametrize(("path", "body", "message", "param", "code"), ENGINE_REFUSALS)
def test_the_engines_refusal_names_the_field(
    server: ServerProcess, path: str, body: dict[str, object], message: str, param: str, code: str | None
) -> None:
    response = httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY_A}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


def test_a_refused_prompt_in_a_batch_leaves_nothing_running(server: ServerProcess) -> None:
    body = {"prompt": [[5, 6, 7], [5, 10**6]], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    before = metric(server, ABORTED)
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"})
    assert response.status_code == 400, response.text
    assert "outside the vocabulary" in response.json()["error"]["message"]
    # The valid prompt reaches the engine before its sibling is refused (the engine takes them in
    # order): it must be aborted then, not left to run its 1000 tokens for nobody.
    wait_until_aborted_and_idle(server, before)


def test_closing_a_stream_frees_its_pages(server: ServerProcess, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=1000,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )
    before = metric(server, ABORTED)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert metric(server, "compiled_engine_kv_pages_used") > 0
    stream.close()
    wait_until_aborted_and_idle(server, before)


def test_openapi_schema_describes_every_route(server: ServerProcess) -> None:
    schema = httpx.get(f"{server.url}/docs/openapi.json").json()
    for path in ("/health", "/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"):
        assert path in schema["paths"]
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]


def test_a_flood_gets_429s_and_no_5xx(tmp_path: Path, default_model_dir: Path) -> None:
    import asyncio

    with running_server(
        tmp_path, "--max-waiting-requests", "2", "--max-num-seqs", "1", "--kv-cache-memory-gib", "0.05"
    ) as flooded:

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 16, "temperature": 0}
                return await asyncio.gather(*[http.post(f"{flooded.url}/v1/completions", json=body) for _ in range(16)])

        responses = asyncio.run(flood())
        statuses = [r.status_code for r in responses]
        assert 429 in statuses and 200 in statuses
        assert all(s in (200, 429) for s in statuses), statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        after = httpx.post(f"{flooded.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert after.status_code == 200
        assert httpx.get(f"{flooded.url}/ready").status_code == 200


def _stream_with_sigterm(
    server: ServerProcess, body: dict[str, Any], after_signal: Callable[[], None] | None = None
) -> list[str]:
    """Stream a completion, SIGTERM the server after its second event (then run `after_signal`),
    and return every event the stream sent."""
    events: list[str] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 2:
                server.process.terminate()  # SIGTERM mid-stream
                if after_signal is not None:
                    after_signal()
    return events


def test_sigterm_during_a_stream_drains_and_exits_0(tmp_path: Path, default_model_dir: Path) -> None:
    """The stream in flight finishes; a request whose body is still arriving when the signal comes
    (its connection is busy, so the server waits for it) is refused with 503 and Retry-After."""
    late_body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(late_body)
    )
    with running_server(tmp_path, "--kv-cache-memory-gib", "0.05") as server:
        held = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        held.sendall(head + late_body[:5])  # the request has begun; the rest of its body comes late
        late: list[http.client.HTTPResponse] = []

        def finish_the_late_request() -> None:
            held.sendall(late_body[5:])
            answer = http.client.HTTPResponse(held)
            answer.begin()
            late.append(answer)

        body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": True, "ignore_eos": True}
        events = _stream_with_sigterm(server, body, after_signal=finish_the_late_request)
        [answer] = late
        refusal = json.loads(answer.read())
        held.close()
        assert server.process.wait(timeout=60) == 0
    assert answer.status == 503 and answer.getheader("Retry-After") == "1", refusal
    assert refusal["error"]["type"] == "service_unavailable" and "shutting down" in refusal["error"]["message"]
    assert events[-1] == "data: [DONE]"
    finals = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e[6:])["choices"]]
    assert finals[-1] == "length"  # the in-flight request ran to completion


def test_a_grace_period_that_runs_out_ends_streams_with_abort_and_exits_0(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """SIGTERM with a 1 s grace period, mid-way through a 1000-token stream: the stream ends with
    finish reason `abort` and [DONE] (not a cut connection), long before its 1000 tokens, and the
    process exits 0."""
    with running_server(tmp_path, "--kv-cache-memory-gib", "0.05", "--shutdown-grace-s", "1") as server:
        body = {"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": True, "ignore_eos": True}
        events = _stream_with_sigterm(server, body)
        assert server.process.wait(timeout=60) == 0
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == "abort"
    assert len(chunks) < 1000


def test_metrics_count_requests_tokens_and_latency(server: ServerProcess, client: openai.OpenAI) -> None:
    """Self-contained: it makes the 401 it counts (it used to rely on earlier tests' requests)."""
    before = metric(server, "compiled_engine_generated_tokens_total")
    assert httpx.post(f"{server.url}/v1/chat/completions", json={"messages": QUESTION}).status_code == 401
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    shared = "The same long prompt, twice, so that its full pages come from the prefix cache. " * 3
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=shared, max_tokens=1, temperature=0)
    before += 2
    text = httpx.get(f"{server.url}/metrics").text
    assert 'compiled_engine_http_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'compiled_engine_http_requests_total{endpoint="/v1/chat/completions",status="401"}' in text
    assert metric(server, "compiled_engine_generated_tokens_total") == before + 3
    assert metric(server, "compiled_engine_time_to_first_token_seconds_count") > 0
    assert metric(server, "compiled_engine_e2e_request_latency_seconds_count") > 0
    assert (
        metric(server, "compiled_engine_prefix_cache_queried_tokens_total")
        >= metric(server, "compiled_engine_prefix_cache_hit_tokens_total")
        > 0
    )
    assert metric(server, "compiled_engine_kv_pages_free") > 0
    assert metric(server, "compiled_engine_weight_bytes") > 50e6  # the default model's 4-bit layers and head
    assert (
        0.9 * 0.05 * 2**30 < metric(server, "compiled_engine_kv_cache_bytes") <= 0.05 * 2**30
    )  # --kv-cache-memory-gib
    text = httpx.get(f"{server.url}/metrics").text
    pages = metric(server, "compiled_engine_kv_pages_used", text) + metric(
        server, "compiled_engine_kv_pages_free", text
    )
    assert metric(server, "compiled_engine_kv_cache_tokens", text) == 16 * pages  # the default page size
    assert 'compiled_engine_kv_cache_info{kv_cache_dtype="float32"} 1.0' in text  # auto: the activations'


def test_a_batch_of_prompts_gives_each_its_choices(client: openai.OpenAI) -> None:
    prompts = ["The three primary colors are", "def fibonacci(n):"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == alone.choices[0].text
    assert batch.usage is not None and batch.usage.completion_tokens == 24


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_gives_up_on_a_whole_reply_aborts_it(server: ServerProcess, route: str) -> None:
    """A non-streamed request whose client disconnects is aborted: the engine counts it as aborted
    (ended before its 1000 tokens), running requests and pages in use are back to 0, and no
    tokens are counted for it."""
    body: dict[str, Any] = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    body |= {"prompt": "Once upon a time"} if route == "/v1/completions" else {"messages": QUESTION}
    before = scrape(server)
    aborted = metric(server, ABORTED)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1.5 s
        httpx.post(f"{server.url}{route}", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=1.5))
    wait_until_aborted_and_idle(server, aborted)
    abort = {"finished_reason": "abort", "model_name": MODEL, "engine": "0"}
    after = wait_for_sample(
        server, "vllm:request_success_total", sample(before, "vllm:request_success_total", **abort) + 1, **abort
    )
    for name, labels in (
        ("vllm:request_success_total", abort),
        ("compiled_engine_finished_requests_total", {"finish_reason": "abort"}),
    ):
        assert sample(after, name, **labels) == sample(before, name, **labels) + 1, f"the abandoned reply in {name}"
    assert sample(after, "compiled_engine_generated_tokens_total") == sample(
        before, "compiled_engine_generated_tokens_total"
    )


def test_a_draining_or_dead_server_refuses_new_requests_with_503_and_is_not_ready(default_model_dir: Path) -> None:
    """In process: once draining starts (what SIGTERM calls), every new request and /ready
    answer 503 with Retry-After, and the error says why."""
    from litestar.testing import TestClient

    from compiled_engine.config import EngineConfig
    from compiled_engine.engine.llm_engine import LLMEngine
    from compiled_engine.server.app import ServerSettings, create_app
    from compiled_engine.serving.client import EngineClient
    from compiled_engine.serving.handle import ThreadHandle

    config = EngineConfig(enforce_eager=True, kv_cache_memory_gib=0.05)
    engine = EngineClient([ThreadHandle(lambda: LLMEngine(config))], 8)
    engine.start()
    try:
        with TestClient(create_app(engine, ServerSettings("tiny"))) as client:
            body = {"prompt": "Hello", "max_tokens": 2}
            assert client.post("/v1/completions", json=body).status_code == 200
            assert client.get("/ready").status_code == 200
            engine.stop_accepting()
            refused = client.post("/v1/completions", json=body)
            assert refused.status_code == 503 and refused.headers["Retry-After"]
            assert refused.json()["error"]["type"] == "service_unavailable" and "shutting down" in refused.text
            ready = client.get("/ready")
            assert ready.status_code == 503 and ready.headers["Retry-After"]
            engine.fail(RuntimeError("a rank was lost"))  # a dead engine: 503 too, saying so
            dead = client.post("/v1/completions", json=body)
            assert dead.status_code == 503 and dead.json()["error"]["type"] == "service_unavailable"
            assert "not running" in dead.text and "not running" in client.get("/ready").text
    finally:
        engine.shutdown(grace_s=5)


def test_no_page_the_server_serves_loads_anything_from_another_host(server: ServerProcess) -> None:
    """`/`, its files and `/docs`: every src and href, and any URL in the text, is on this server."""
    from html.parser import HTMLParser

    class Links(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.links: list[str] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            self.links += [value for name, value in attrs if name in ("src", "href") and value]

    for path in ("/", "/docs", "/chat/chat.js", "/chat/chat.css"):
        reply = httpx.get(f"{server.url}{path}", timeout=30)
        assert reply.status_code == 200, path
        assert "http://" not in reply.text and "https://" not in reply.text and "//cdn" not in reply.text, path
        if path in ("/", "/docs"):
            parser = Links()
            parser.feed(reply.text)
            assert parser.links, path
            for link in parser.links:
                assert "://" not in link and not link.startswith("//"), (path, link)
    docs = httpx.get(f"{server.url}/docs", timeout=30).text
    assert "/v1/chat/completions" in docs and "openapi.json" in docs
    assert httpx.get(f"{server.url}/docs/openapi.json", timeout=30).json()["paths"]


def test_each_finished_request_is_logged_once_without_its_prompt(server: ServerProcess, client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="A secret prompt", max_tokens=3, temperature=0)
    lines = [line for line in server.log_text().splitlines() if f"request_id={reply.id}-0 " in line]
    assert len(lines) == 1, server.log_text()[-2000:]
    assert f"model={MODEL}" in lines[0] and "completion_tokens=3" in lines[0] and "finish_reason=length" in lines[0]
    assert "ttft_s=" in lines[0] and "e2e_s=" in lines[0] and "secret" not in lines[0]


def test_json_logs_carry_the_request_and_its_prompt_when_asked(tmp_path: Path, default_model_dir: Path) -> None:
    args = ["--kv-cache-memory-gib", "0.05", "--enforce-eager", "--log-format", "json", "--log-prompts"]
    with running_server(tmp_path, *args) as server:
        body = {"prompt": "Tell me about lighthouses", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        stream = {**body, "max_tokens": 500, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=stream, timeout=60) as response:
            next(response.iter_lines())  # one event, then the client goes away
        wait_until_aborted_and_idle(server, before=0)

        def logged() -> list[dict[str, Any]]:
            text = server.log_text()
            whole = text[: text.rfind("\n") + 1]  # not a line still being written
            return [json.loads(line) for line in whole.splitlines() if line.startswith("{")]

        wait_until(lambda: sum("request" in entry for entry in logged()) == 2, "both requests logged", logged)
        entries = logged()
    assert entries and all({"time", "level", "logger", "message"} <= set(entry) for entry in entries)
    requests = [entry["request"] for entry in entries if "request" in entry]
    assert [r["finish_reason"] for r in requests] == ["length", "abort"]
    assert requests[0]["prompt"] == "Tell me about lighthouses" and requests[0]["completion_tokens"] == 2
    assert any(entry["logger"].startswith("uvicorn") for entry in entries)  # the server's own lines too


def test_vllm_named_metrics_match_a_known_workload(server: ServerProcess, client: openai.OpenAI) -> None:
    """Three requests that run to max_tokens, one ended by a stop string and one stream cut by its
    client, with token-id prompts of known lengths: every vLLM-named series (and ours beside it)
    moves by exactly what they did; the gauges show the open stream, and nothing once it is gone."""
    label = {"model_name": MODEL, "engine": "0"}
    reset = httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH, timeout=30)
    assert reset.status_code == 200, reset.text  # no page cached by earlier tests can give a hit
    before = scrape(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert sample(before, name, **label) == 0, f"{name} before the workload: the server should be idle"

    prompts = [[504, 2365, 3903, 5063], [504, 2365, 3903, 5063, 359], [1, 2, 3, 4, 5, 6]]
    lengths = [2, 3, 4]
    texts = []
    for prompt, max_tokens in zip(prompts, lengths, strict=True):
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
            len(prompt),
            max_tokens,
        )
        texts.append(reply.choices[0].text)
    assert texts[1], "the second prompt's 3 tokens decode to no text: it cannot be a stop string"
    stopped = client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=50, temperature=0, stop=[texts[1]], extra_body={"ignore_eos": True}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage is not None
    prompt_tokens = sum(len(p) for p in prompts) + len(prompts[1])
    generated = sum(lengths) + stopped.usage.completion_tokens

    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line)
        during = scrape(server)
    running = sample(during, "vllm:num_requests_running", **label)
    waiting = sample(during, "vllm:num_requests_waiting", **label)
    usage = sample(during, "vllm:kv_cache_usage_perc", **label)
    assert (running, waiting) == (1, 0) and 0 < usage <= 1, (running, waiting, usage)

    abort = {"finished_reason": "abort", **label}
    after = wait_for_sample(
        server, "vllm:request_success_total", sample(before, "vllm:request_success_total", **abort) + 1, **abort
    )

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    expected = {
        ("vllm:request_success_total", "length"): 3,
        ("vllm:request_success_total", "stop"): 1,
        ("vllm:request_success_total", "abort"): 1,
        ("compiled_engine_finished_requests_total", "length"): 3,
        ("compiled_engine_finished_requests_total", "stop"): 1,
        ("compiled_engine_finished_requests_total", "abort"): 1,
    }
    for (name, reason), count in expected.items():
        labels = {"finished_reason": reason, **label} if name.startswith("vllm:") else {"finish_reason": reason}
        assert delta(name, **labels) == count, f"{name}{{{reason}}}"
    # The cut stream counts as `abort` and in nothing else: its tokens and latencies are left out.
    finished = 4
    for name, value in (
        ("vllm:prompt_tokens_total", prompt_tokens),
        ("vllm:generation_tokens_total", generated),
        ("vllm:request_prompt_tokens_count", finished),
        ("vllm:request_prompt_tokens_sum", prompt_tokens),
        ("vllm:request_generation_tokens_count", finished),
        ("vllm:request_generation_tokens_sum", generated),
        ("vllm:inter_token_latency_seconds_count", finished - (stopped.usage.completion_tokens < 2)),
        ("vllm:num_preemptions_total", 0),
    ):
        assert delta(name, **label) == value, name
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time"):
        assert delta(f"vllm:{name}_seconds_count", **label) == finished, name
    assert delta("vllm:request_decode_time_seconds_count", **label) == finished
    assert delta("compiled_engine_prompt_tokens_total") == prompt_tokens
    assert delta("compiled_engine_generated_tokens_total") == generated
    assert delta("compiled_engine_e2e_request_latency_seconds_count") == finished
    # Every prompt token is looked up (the cut stream's three too). Hits, from an empty cache: the
    # second prompt and the stopped request each copy the first four tokens of the partial page
    # the one before left (a prompt's last token is always computed).
    assert delta("vllm:prefix_cache_queries_total", **label) == prompt_tokens + 3
    assert delta("vllm:prefix_cache_hits_total", **label) == 4 + 4

    wait_until_idle(server)
    idle = scrape(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert sample(idle, name, **label) == 0, f"{name} once the cut stream is gone"


def test_scrapes_never_fail_while_streams_start_finish_and_are_cut(tmp_path: Path, default_model_dir: Path) -> None:
    """Four threads scrape /metrics over and over while streamed requests queue, start, run to the
    end, or are cut by their clients: not one scrape fails, and each cut stream counts once as
    `abort`. The scrapes read the engine loop's published snapshot, never the scheduler it is
    changing. A server of its own, two sequences at a time, so that requests wait in the queue (the
    deque that a scrape iterating it would see mutated)."""
    args = ["--kv-cache-memory-gib", "0.05", "--max-num-seqs", "2", "--served-model-name", MODEL]
    with running_server(tmp_path, *args) as server:
        _scrape_while_streaming(server)


def _scrape_while_streaming(server: ServerProcess) -> None:
    label = {"model_name": MODEL, "engine": "0"}
    reset = httpx.post(f"{server.url}/reset_prefix_cache", headers=AUTH, timeout=30)
    assert reset.status_code == 200, reset.text  # no page cached by earlier tests can give a hit
    before = scrape(server)
    stop, queued = threading.Event(), threading.Event()  # queued: a scrape saw a request waiting
    scrapes, failures = [0] * 4, []

    def scraper(index: int) -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                try:
                    reply = http.get(f"{server.url}/metrics")
                    if reply.status_code != 200 or "vllm:num_requests_running{" not in reply.text:
                        failures.append(f"{reply.status_code}: {reply.text[:500]}")
                    waiting = re.search(r"^vllm:num_requests_waiting\{.*\} (\S+)$", reply.text, re.MULTILINE)
                    if waiting is not None and float(waiting.group(1)) > 0:
                        queued.set()
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                scrapes[index] += 1
                stop.wait(0.02)  # a breath between scrapes, so that they leave the engine CPU time

    def stream(max_tokens: int, cut_after: int | None) -> list[str]:
        """The stream's events; with `cut_after`, the client leaves after that many."""
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        events: list[str] = []
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "ignore_eos": True}, headers=AUTH, timeout=60
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line:
                    events.append(line)
                if len(events) == cut_after:
                    break  # leaving the block closes the connection mid-stream
        return events

    completed = cut = rounds = 0
    with ThreadPoolExecutor(10) as pool:
        scrapers = [pool.submit(scraper, i) for i in range(4)]
        try:
            while (rounds < 1 or min(scrapes) < 10 or not queued.is_set()) and rounds < 40:  # 40: only a cap
                full = [pool.submit(stream, 6, None) for _ in range(3)]
                cuts = [pool.submit(stream, 500, 2) for _ in range(3)]
                assert all(f.result()[-1] == "data: [DONE]" for f in full)
                assert all(len(f.result()) == 2 for f in cuts)
                completed, cut, rounds = completed + len(full), cut + len(cuts), rounds + 1
        finally:
            stop.set()
            for f in scrapers:
                f.result()
    assert not failures, f"{len(failures)} of {sum(scrapes)} scrapes failed; the first: {failures[:3]}"
    assert min(scrapes) >= 10, f"scrapes per thread: {scrapes} in {rounds} rounds"
    assert queued.is_set(), f"no scrape saw a request waiting in {rounds} rounds"

    abort = {"finished_reason": "abort", **label}
    want = sample(before, "vllm:request_success_total", **abort) + cut
    after = wait_for_sample(server, "vllm:request_success_total", want, **abort)
    for reason, count in (("abort", cut), ("length", completed)):
        for name, labels in (
            ("vllm:request_success_total", {"finished_reason": reason, **label}),
            ("compiled_engine_finished_requests_total", {"finish_reason": reason}),
        ):
            assert sample(after, name, **labels) - sample(before, name, **labels) == count, f"{name}{{{reason}}}"
    wait_until_idle(server)


@pytest.mark.full
def test_a_port_taken_before_the_server_binds_it_is_replaced(
    tmp_path: Path, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test servers' ports: one taken between `free_port` and the bind (here by a listener
    of our own) makes that server exit, and the next attempt takes another port."""
    import socket

    from tests import server_process

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([int(taken.getsockname()[1]), server_process.free_port()])
    monkeypatch.setattr(server_process, "free_port", lambda: next(ports))
    try:
        with running_server(tmp_path, "--kv-cache-memory-gib", "0.05", "--enforce-eager") as server:
            assert server.port != taken.getsockname()[1]
            assert httpx.get(f"{server.url}/v1/models").status_code == 200
    finally:
        taken.close()
