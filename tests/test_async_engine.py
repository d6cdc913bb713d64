"""AsyncEngine without HTTP: streams, early exit aborts, overload, a dead loop, shutdown."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from compiled_engine.config import EngineConfig
from compiled_engine.engine.async_engine import AsyncEngine
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import (
    CompiledEngineError,
    EngineDeadError,
    EngineOverloadedError,
    EngineShuttingDownError,
    RequestError,
)
from tests.waiting import wait_until


@pytest.fixture
def engine(tiny_model_factory: Callable[..., Path]) -> Iterator[AsyncEngine]:
    core = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), page_size=4, num_pages=64))
    async_engine = AsyncEngine(core, max_waiting_requests=4)
    async_engine.start()
    yield async_engine
    async_engine.shutdown(grace_s=1)


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    return [output async for output in engine.generate(prompt, params)]


def test_streams_to_the_end_and_matches_the_offline_engine(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = asyncio.run(collect(engine, [5, 6, 7], params))
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 6
    assert [len(o.token_ids) for o in outputs] == list(range(1, 7))


def test_leaving_early_aborts_and_frees_pages(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream's early exit is what aborts it: a spy on `abort` sees it, and the engine counts
    the request as aborted (the tiny model could otherwise finish its 100 tokens and free the
    pages anyway)."""
    aborted: list[str] = []
    abort = engine.abort
    monkeypatch.setattr(engine, "abort", lambda request_id: (aborted.append(request_id), abort(request_id)))

    async def leave_after_two() -> None:
        stream = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        count = 0
        async for _ in stream:
            count += 1
            if count == 2:
                break
        await stream.aclose()  # type: ignore[attr-defined]

    before = engine.stats().aborted_requests
    asyncio.run(leave_after_two())
    wait_until(lambda: engine.stats().aborted_requests > before, "the engine aborts the request", engine.stats)
    stats = engine.stats()  # the count comes once the pages are back
    assert stats.kv_pages_free == stats.kv_pages_total and stats.running_requests == 0
    assert len(aborted) == 1 and stats.aborted_requests == before + 1


def test_invalid_request_raises_the_engine_error(engine: AsyncEngine) -> None:
    with pytest.raises(RequestError, match="the prompt is empty"):
        asyncio.run(collect(engine, [], SamplingParams()))
    assert engine.is_alive


def test_overload_is_refused(engine: AsyncEngine) -> None:
    engine.max_waiting_requests = 0
    with pytest.raises(EngineOverloadedError, match="already waiting"):
        asyncio.run(collect(engine, [1, 2], SamplingParams(max_tokens=2)))


def test_a_dead_loop_fails_requests_instead_of_hanging(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_step() -> list[RequestOutput]:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.engine, "step", broken_step)
    with pytest.raises(EngineDeadError, match="device lost"):
        asyncio.run(asyncio.wait_for(collect(engine, [1, 2], SamplingParams(max_tokens=2)), timeout=30))
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, [1, 2], SamplingParams(max_tokens=2)))


def test_shutdown_stops_admission(engine: AsyncEngine) -> None:
    engine.shutdown(grace_s=1)
    with pytest.raises((EngineShuttingDownError, EngineDeadError)):
        asyncio.run(collect(engine, [1, 2], SamplingParams(max_tokens=2)))


def test_a_build_function_builds_the_engine_on_the_loop_thread(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = str(tiny_model_factory("llama"))
    built_on: list[str] = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLMEngine(EngineConfig(model=model_dir, page_size=4, num_pages=64))

    async_engine = AsyncEngine(build)
    async_engine.start()
    try:
        assert built_on == ["engine-loop"]
        assert isinstance(async_engine.engine, LLMEngine)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outputs = asyncio.run(collect(async_engine, [5, 6, 7], params))
        assert outputs[-1].finished and len(outputs[-1].token_ids) == 4
    finally:
        async_engine.shutdown(grace_s=1)


def test_a_failing_build_is_raised_by_start(tmp_path: Path) -> None:
    async_engine = AsyncEngine(lambda: LLMEngine(EngineConfig(model=str(tmp_path / "missing"))))
    with pytest.raises(CompiledEngineError, match="missing"):
        async_engine.start()
    assert not async_engine.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(async_engine, [5, 6], SamplingParams(max_tokens=2)))
