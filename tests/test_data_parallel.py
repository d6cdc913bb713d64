"""`serve --data-parallel-size 2` on the default model, one core each: the same greedy text as one
engine, both replicas serving, a repeated prompt going back to the replica that cached it, each
replica's KV events on its own port, a killed replica failing its own requests only (its streams
with their API's error event), and SIGTERM draining the rest."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq

from tests.conftest import API_KEY
from tests.server_process import ServerProcess, free_port, running_server
from tests.test_kv_events import DECODER, BlockStored
from tests.test_stream_failures import sse_events
from tests.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"  # the served name by default
PROMPTS = [f"Question {i}: what is {i} plus {i + 3}? Answer:" for i in range(16)]
STREAMED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
LONG = [f"Story {k}. " + "The river ran past the old mill, and the miller counted the sacks. " * 8 for k in range(4)]


@pytest.fixture(scope="module")
def kv_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def dp_server(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path, kv_port: int
) -> Iterator[ServerProcess]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_port}", "topic": "kv"}
    with running_server(
        tmp_path_factory.mktemp("dp-server"),
        "--data-parallel-size",
        "2",
        "--kv-cache-memory-gib",
        "0.05",
        "--kv-events-config",
        json.dumps(events),
        startup_timeout_s=600.0,
    ) as process:
        yield process


def _complete(url: str, prompt: str, max_tokens: int = 12, **headers: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)


def _complete_all(url: str, prompt: str, max_tokens: int) -> httpx.Response:
    """Exactly `max_tokens` tokens (vLLM's ignore_eos): a request that runs for a while."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def _replica_pids(server: ServerProcess) -> dict[int, int]:
    found = re.findall(r"data-parallel replica (\d+) started \(pid (\d+)", server.log_text())
    return {int(index): int(pid) for index, pid in found}


def _samples(server: ServerProcess, name: str) -> dict[str, float]:
    """`name`'s value by engine label."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            engine = re.search(r'engine="(\d+)"', line)
            if engine is not None:
                found[engine.group(1)] = float(line.rsplit(" ", 1)[1])
    return found


def test_sixteen_concurrent_requests_give_one_engines_text_and_both_replicas_serve(
    dp_server: ServerProcess, api_server: ServerProcess
) -> None:
    before = _samples(dp_server, "vllm:generation_tokens_total")
    with ThreadPoolExecutor(16) as pool:
        ours = list(pool.map(lambda p: _complete(dp_server.url, p), PROMPTS))
    one = [_complete(api_server.url, p, Authorization=f"Bearer {API_KEY}") for p in PROMPTS]
    assert all(r.status_code == 200 for r in [*ours, *one]), [r.text for r in ours if r.status_code != 200]
    assert [r.json()["choices"][0]["text"] for r in ours] == [r.json()["choices"][0]["text"] for r in one]
    after = _samples(dp_server, "vllm:generation_tokens_total")
    served = {engine: after[engine] - before.get(engine, 0.0) for engine in after}
    assert set(served) == {"0", "1"} and all(tokens > 0 for tokens in served.values()), served
    assert sum(served.values()) == sum(r.json()["usage"]["completion_tokens"] for r in ours)
    log = dp_server.log_text()
    assert "INFO [engine 0] " in log and "INFO [engine 1] " in log  # each replica's own lines, named


def test_a_stream_through_a_replica_gives_the_whole_replys_text(dp_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{dp_server.url}/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len(pieces) > 2 and "".join(pieces) == whole.choices[0].message.content


def test_a_repeated_prompt_goes_back_to_the_replica_that_cached_it(dp_server: ServerProcess) -> None:
    """Four long prompts spread over the replicas, then each again in the reverse order: every
    repeat finds its prompt's pages cached (round robin would send each to the other replica)."""
    first = [_complete(dp_server.url, prompt, 4).json() for prompt in LONG]
    hits_before = _samples(dp_server, "vllm:prefix_cache_hits_total")
    again = [_complete(dp_server.url, prompt, 4).json() for prompt in reversed(LONG)][::-1]
    for a, b in zip(first, again, strict=True):
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        prompt_tokens = b["usage"]["prompt_tokens"]
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 16, b["usage"]
    hits_after = _samples(dp_server, "vllm:prefix_cache_hits_total")
    gained = {engine: hits_after[engine] - hits_before[engine] for engine in hits_after}
    assert all(tokens > 0 for tokens in gained.values()), f"the long prompts all went to one replica: {gained}"


def test_each_replica_publishes_its_kv_events_on_its_own_port(dp_server: ServerProcess, kv_port: int) -> None:
    context = zmq.Context.instance()
    subs = []
    for rank in (0, 1):
        sub = context.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{kv_port + rank}")
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
        subs.append(sub)
    time.sleep(0.5)
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda k: _complete(dp_server.url, f"{k} " + LONG[0] + f" and {k}", 2), range(4)))
        for rank, sub in enumerate(subs):
            assert sub.poll(10_000), f"replica {rank} published nothing"
            topic, _, payload = sub.recv_multipart()
            batch = DECODER.decode(payload)
            assert topic == b"kv" and batch.data_parallel_rank == rank
            assert any(isinstance(event, BlockStored) for event in batch.events)
    finally:
        for sub in subs:
            sub.close(linger=0)


def test_reset_prefix_cache_clears_every_replica_and_waits_for_idle(dp_server: ServerProcess) -> None:
    prompt = LONG[1] + " Reset."
    _complete(dp_server.url, prompt, 2)
    assert _complete(dp_server.url, prompt, 2).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_complete_all, dp_server.url, PROMPTS[0], 120)
        wait_until(lambda: sum(_samples(dp_server, "vllm:num_requests_running").values()) > 0, "a request running")
        busy = httpx.post(f"{dp_server.url}/reset_prefix_cache", timeout=30)
        assert busy.status_code == 409, busy.text
        assert busy.json()["error"]["code"] == "prefix_cache_in_use"
        assert running.result().status_code == 200
    reset = httpx.post(f"{dp_server.url}/reset_prefix_cache", timeout=30)
    assert reset.status_code == 200, reset.text
    after = _complete(dp_server.url, prompt, 2).json()
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


COUNTING = "Write the numbers from one to five hundred in words, separated by commas."


def _stream_body(route: str, k: int) -> dict[str, Any]:
    """A long streamed request on `route` whose first page is its own (a system prompt of its
    own), so that the router places it by load alone."""
    system = f"Stream {k} of the replica test. You count slowly and never stop early."
    turns = [{"role": "user", "content": COUNTING}]
    return {
        "/v1/chat/completions": {"messages": [{"role": "system", "content": system}, *turns], "ignore_eos": True},
        "/v1/completions": {"prompt": f"{system} {COUNTING}", "ignore_eos": True},
        "/v1/messages": {"model": MODEL, "system": system, "messages": turns},
        "/v1/responses": {"model": MODEL, "instructions": system, "input": COUNTING},
    }[route] | {
        "stream": True,
        "temperature": 0.0,
        "max_tokens" if route != "/v1/responses" else "max_output_tokens": 200,
    }


class _OpenStream(threading.Thread):
    """One streamed request, read to its end on a thread of its own; `started` is set once its
    200 has come (the request then runs on a replica)."""

    def __init__(self, url: str, route: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.route, self.body = url, route, body
        self.started = threading.Event()
        self.events: list[tuple[str | None, str]] = []
        self.status = 0

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + self.route, json=self.body, timeout=300) as reply:
                self.status = reply.status_code
                self.started.set()
                self.events = sse_events(reply.read().decode())
        finally:
            self.started.set()


def _stream_outcome(stream: _OpenStream) -> str:
    """ "finished" or "failed" (with the API's own error event), after checking the stream's end
    is one of the two the API defines."""
    assert stream.status == 200, (stream.route, stream.status)
    names = [name for name, _ in stream.events]
    data = [payload for _, payload in stream.events]
    if stream.route in ("/v1/chat/completions", "/v1/completions"):
        assert data[-1] == "[DONE]", data[-3:]
        last = json.loads(data[-2])
        if "error" in last:
            assert last["error"]["type"] == "service_unavailable"
            assert "data-parallel replica 1 died" in last["error"]["message"]
            return "failed"
        finish = [c.get("finish_reason") for d in data[:-1] for c in json.loads(d)["choices"]]
        assert "length" in finish, finish[-3:]
        return "finished"
    if stream.route == "/v1/messages":
        if names[-1] == "error":
            error = json.loads(data[-1])["error"]
            assert error["type"] == "overloaded_error" and "data-parallel replica 1 died" in error["message"]
            assert "message_stop" not in names
            return "failed"
        assert names[-1] == "message_stop", names[-3:]
        return "finished"
    last = json.loads(data[-1])
    assert [json.loads(d)["sequence_number"] for d in data] == list(range(len(data)))
    if names[-1] == "response.failed":
        assert last["response"]["status"] == "failed"
        assert "data-parallel replica 1 died" in last["response"]["error"]["message"]
        return "failed"
    assert names[-1] in ("response.completed", "response.incomplete"), names[-3:]
    return "finished"


def test_a_killed_replica_fails_its_own_requests_and_the_other_serves_on(dp_server: ServerProcess) -> None:
    """Whole replies on the killed replica get their 503; streams there (two on each streamed
    route, opened one after another so that each route has one on each replica) end with their
    API's error event, and those on the other replica finish."""
    pids = _replica_pids(dp_server)
    assert set(pids) == {0, 1}
    streams = []
    for k, route in enumerate(r for r in STREAMED_ROUTES for _ in range(2)):
        stream = _OpenStream(dp_server.url, route, _stream_body(route, k))
        stream.start()
        assert stream.started.wait(timeout=120), f"no 200 for {route}"
        streams.append(stream)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_complete_all, dp_server.url, p, 200) for p in PROMPTS[:6]]

        def both_running() -> bool:
            running = _samples(dp_server, "vllm:num_requests_running")
            return running.get("0", 0) > 0 and running.get("1", 0) > 0

        wait_until(both_running, "both replicas running requests")
        os.kill(pids[1], signal.SIGKILL)
        replies = [future.result() for future in futures]
    for stream in streams:
        stream.join(timeout=300)
    outcomes = {route: sorted(_stream_outcome(s) for s in streams if s.route == route) for route in STREAMED_ROUTES}
    assert outcomes == {route: ["failed", "finished"] for route in STREAMED_ROUTES}
    statuses = [reply.status_code for reply in replies]
    assert set(statuses) == {200, 503}, statuses
    failed = [reply.json() for reply in replies if reply.status_code == 503]
    for body in failed:
        assert body["error"]["type"] == "service_unavailable"
        assert "data-parallel replica 1 died" in body["error"]["message"]
    assert all(reply.json()["usage"]["completion_tokens"] == 200 for reply in replies if reply.status_code == 200)

    health = httpx.get(f"{dp_server.url}/health", timeout=30)
    assert health.status_code == 200
    state: Any = health.json()
    assert state["status"] == "degraded"
    assert [engine["alive"] for engine in state["engines"]] == [True, False]
    assert _samples(dp_server, "compiled_engine_engine_up") == {"0": 1.0, "1": 0.0}
    assert set(_samples(dp_server, "vllm:num_requests_running")) == {"0"}
    with ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda p: _complete(dp_server.url, p, 4), PROMPTS[:4]))
    assert [reply.status_code for reply in after] == [200] * 4


def test_sigterm_drains_the_requests_in_flight(dp_server: ServerProcess) -> None:
    """Last in this module: it stops the server."""
    pids = _replica_pids(dp_server)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_complete_all, dp_server.url, PROMPTS[0], 48)
        wait_until(lambda: sum(_samples(dp_server, "vllm:num_requests_running").values()) > 0, "a request running")
        dp_server.process.send_signal(signal.SIGTERM)
        reply = future.result()
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 48
    assert dp_server.process.wait(timeout=60) == 0
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_engine_label_is_vllms_on_one_engine_too(api_server: ServerProcess) -> None:
    text = httpx.get(f"{api_server.url}/metrics", timeout=30).text
    series = [line for line in text.splitlines() if line.startswith("vllm:")]
    assert series and all('engine="0"' in line for line in series)
    assert msgspec.json.decode(httpx.get(f"{api_server.url}/health").content) == {"status": "ok"}
