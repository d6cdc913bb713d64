"""Start a real `compiled_engine serve` process on a free loopback port, for the server tests, and
read its /metrics."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.waiting import wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.process = process
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


BIND_ATTEMPTS = 3


@contextmanager
def running_server(tmp_dir: Path, *args: str, startup_timeout_s: float = 120.0) -> Iterator[ServerProcess]:
    """`free_port` gives the port back before the server binds it, so another process may take it
    first: a server that then fails to bind is started again on another port."""
    for _ in range(BIND_ATTEMPTS):
        server = _start(tmp_dir, args, startup_timeout_s)
        if server is not None:
            break
    else:
        raise RuntimeError(f"no free port could be bound in {BIND_ATTEMPTS} attempts")
    process = server.process
    try:
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _start(tmp_dir: Path, args: tuple[str, ...], startup_timeout_s: float) -> ServerProcess | None:
    """A ready server, or None when its port was taken before it could bind."""
    port = free_port()
    log = tmp_dir / f"server-{port}.log"
    command = [sys.executable, "-m", "compiled_engine", "serve", "--port", str(port), *args]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    server = ServerProcess(process, port, log)
    deadline = time.monotonic() + startup_timeout_s
    try:
        while True:
            if process.poll() is not None:
                if "address already in use" in server.log_text().lower():
                    return None
                raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log_text()}")
            try:
                # Ours once it has logged its own start: another process on the port is not.
                ready = httpx.get(f"{server.url}/ready", timeout=1.0).status_code == 200
                if ready and "Uvicorn running on" in server.log_text():
                    return server
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready in {startup_timeout_s} s:\n{server.log_text()}")
            time.sleep(0.2)
    except BaseException:
        if process.poll() is None:
            process.kill()
            process.wait()
        raise


def metric(server: ServerProcess, name: str, text: str | None = None) -> float:
    """`name`'s value in `text`, or in a fresh scrape of /metrics."""
    text = httpx.get(f"{server.url}/metrics").text if text is None else text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


ABORTED = "compiled_engine_aborted_requests_total"


def wait_until_aborted_and_idle(server: ServerProcess, before: float) -> None:
    """Wait until the engine has counted one abort more than `before` (it ended the request before
    it finished) and nothing runs or holds a KV page. A request that was never aborted never gets
    counted, however long it runs: the wait then fails at its hang guard."""

    def state() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics").text
        names = (ABORTED, "compiled_engine_running_requests", "compiled_engine_kv_pages_used")
        return {name: metric(server, name, text) for name in names}

    def done() -> bool:
        now = state()
        return (
            now[ABORTED] > before
            and now["compiled_engine_running_requests"] == now["compiled_engine_kv_pages_used"] == 0
        )

    wait_until(done, "the request aborted and the server idle", state)
    assert metric(server, ABORTED) == before + 1


def named_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """A stream of `event: <name>` / `data: <json>` pairs (Anthropic's and Responses' SSE), parsed."""
    events = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events
