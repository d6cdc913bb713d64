"""Two `serve` processes behind vLLM's router (`vllm-router`, from PyPI), started the way
docs/parallel.md tells users to: completions, chat and a stream succeed through the router, and
both servers take requests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_process import ServerProcess, free_port, running_server
from tests.waiting import wait_until

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[list[ServerProcess]]:
    with ExitStack() as stack:
        servers = [
            stack.enter_context(
                running_server(
                    tmp_path_factory.mktemp(f"routed-{i}"),
                    "--cpu-threads",
                    "1",
                    "--kv-cache-memory-gib",
                    "0.05",
                    "--served-model-name",
                    "smol",
                )
            )
            for i in range(2)
        ]
        yield servers


@pytest.fixture(scope="module")
def router_url(two_servers: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not Path(ROUTER).exists():
        pytest.fail("vllm-router is not installed (it is in the dev extras: pip install -e '.[dev]')")
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    command = [
        ROUTER,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *(server.url for server in two_servers),
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(free_port()),
        "--worker-startup-check-interval",
        "1",
    ]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"vllm-router exited with {process.returncode}:\n{log.read_text()}")
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, "vllm-router answering", lambda: log.read_text()[-2000:])
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _served(server: ServerProcess) -> float:
    """Requests the server finished, by vLLM's counter."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total{")
    )


def test_requests_through_vllm_router_succeed_and_reach_both_servers(
    router_url: str, two_servers: list[ServerProcess]
) -> None:
    before = [_served(server) for server in two_servers]
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)
    texts = []
    for i in range(4):
        completion = client.completions.create(model="smol", prompt=f"{i} plus {i} is", max_tokens=4, temperature=0)
        texts.append(completion.choices[0].text)
        chat = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": f"Say {i}."}], max_tokens=4, temperature=0
        )
        assert chat.choices[0].message.content
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Count to three."}], max_tokens=6, stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces)
    direct = openai.OpenAI(base_url=f"{two_servers[0].url}/v1", api_key="unused", max_retries=0)
    assert (
        texts[0]
        == direct.completions.create(model="smol", prompt="0 plus 0 is", max_tokens=4, temperature=0).choices[0].text
    )
    gained = [_served(server) - b for server, b in zip(two_servers, before, strict=True)]
    assert all(count >= 3 for count in gained), f"requests per server: {gained}"
    assert sum(gained) >= 9
