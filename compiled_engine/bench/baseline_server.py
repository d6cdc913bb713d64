"""What the serving bench's server baselines share: a free loopback port, the end of a server's
log, and waiting for a started server to answer `/health`."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx

from compiled_engine.bench.hf_baseline import BaselineUnavailable


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def log_tail(log: Path, limit: int = 1500) -> str:
    text = log.read_text(errors="replace").strip()
    return text[-limit:] if text else "(no output)"


def wait_until_healthy(process: subprocess.Popen[bytes], base_url: str, log: Path, name: str, timeout_s: float) -> None:
    """Return once `base_url/health` answers 200; a server that exits first, or is still not
    healthy after `timeout_s`, raises BaselineUnavailable with the end of its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise BaselineUnavailable(
                f"{name} exited with status {process.returncode} before it served: {log_tail(log)}"
            )
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet, or still loading the model
        if time.monotonic() > deadline:
            raise BaselineUnavailable(f"{name} was not healthy after {timeout_s:.0f} s: {log_tail(log)}")
        time.sleep(0.2)
