"""The app in this process over a real engine of the default model, for the refusals a shared
server cannot give on demand: 429 (no room to wait: `max_waiting_requests` of 0) and 503 (the
server drains: `stop_accepting`, what SIGTERM calls)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.server.app import ServerSettings, create_app
from compiled_engine.serving.client import EngineClient
from compiled_engine.serving.handle import ThreadHandle

KEY = "in-process-key"


def overloaded(engine: EngineClient) -> None:
    engine.max_waiting_requests = 0


def draining(engine: EngineClient) -> None:
    engine.stop_accepting()


# In this order: a draining engine never takes requests again.
REFUSALS: list[tuple[int, Callable[[EngineClient], None]]] = [(429, overloaded), (503, draining)]


@contextmanager
def in_process_app(model: str) -> Iterator[tuple[EngineClient, Any]]:
    """The engine and a test client of the app over it (`model`: the served name; key: KEY)."""
    from litestar.testing import TestClient

    engine = EngineClient(
        [ThreadHandle(lambda: LLMEngine(EngineConfig(enforce_eager=True, kv_cache_memory_gib=0.05)))], 8
    )
    engine.start()
    try:
        with TestClient(create_app(engine, ServerSettings(model, api_keys=(KEY,)))) as client:
            yield engine, client
    finally:
        engine.shutdown(grace_s=5)
