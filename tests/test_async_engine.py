"""The engine client over a thread handle, without HTTP: streams, early exit aborts, overload, a
dead loop, shutdown, stats read from other threads."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine.sequence import Sequence
from compiled_engine.engine.stats import EngineStats
from compiled_engine.errors import (
    CompiledEngineError,
    EngineDeadError,
    EngineOverloadedError,
    EngineShuttingDownError,
    RequestError,
)
from compiled_engine.serving.client import EngineClient
from compiled_engine.serving.handle import ThreadHandle
from tests.waiting import wait_until


@pytest.fixture
def engine(tiny_model_factory: Callable[..., Path]) -> Iterator[EngineClient]:
    core = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), page_size=4, num_pages=64))
    async_engine = EngineClient([ThreadHandle(core)], max_waiting_requests=4)
    async_engine.start()
    yield async_engine
    async_engine.shutdown(grace_s=1)


async def collect(engine: EngineClient, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    return [output async for output in engine.generate(prompt, params)]


def test_streams_to_the_end_and_matches_the_offline_engine(engine: EngineClient) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = asyncio.run(collect(engine, [5, 6, 7], params))
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 6
    assert [len(o.token_ids) for o in outputs] == list(range(1, 7))


def test_leaving_early_aborts_and_frees_pages(engine: EngineClient, monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_invalid_request_raises_the_engine_error(engine: EngineClient) -> None:
    with pytest.raises(RequestError, match="the prompt is empty"):
        asyncio.run(collect(engine, [], SamplingParams()))
    assert engine.is_alive


def test_overload_is_refused(engine: EngineClient) -> None:
    engine.max_waiting_requests = 0
    with pytest.raises(EngineOverloadedError, match="already waiting"):
        asyncio.run(collect(engine, [1, 2], SamplingParams(max_tokens=2)))


def test_a_dead_loop_fails_requests_instead_of_hanging(engine: EngineClient, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_step() -> list[RequestOutput]:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.engine, "step", broken_step)
    with pytest.raises(EngineDeadError, match="device lost"):
        asyncio.run(asyncio.wait_for(collect(engine, [1, 2], SamplingParams(max_tokens=2)), timeout=30))
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, [1, 2], SamplingParams(max_tokens=2)))


def test_shutdown_stops_admission(engine: EngineClient) -> None:
    engine.shutdown(grace_s=1)
    with pytest.raises((EngineShuttingDownError, EngineDeadError)):
        asyncio.run(collect(engine, [1, 2], SamplingParams(max_tokens=2)))


def test_a_build_function_builds_the_engine_on_the_loop_thread(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = str(tiny_model_factory("llama"))
    built_on: list[str] = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLMEngine(EngineConfig(model=model_dir, page_size=4, num_pages=64))

    async_engine = EngineClient([ThreadHandle(build)])
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
    async_engine = EngineClient([ThreadHandle(lambda: LLMEngine(EngineConfig(model=str(tmp_path / "missing"))))])
    with pytest.raises(CompiledEngineError, match="missing"):
        async_engine.start()
    assert not async_engine.is_alive
    with pytest.raises(EngineDeadError, match="published no stats"):
        async_engine.stats()
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(async_engine, [5, 6], SamplingParams(max_tokens=2)))


class LoopOnlyReads:
    """Records every read of the scheduler's queue or running list from a thread other than the
    engine loop: the containers below call `check` on iteration, len, truth and indexing."""

    def __init__(self) -> None:
        self.off_loop: list[str] = []

    def check(self, what: str) -> None:
        thread = threading.current_thread().name
        if thread != "engine-loop":
            self.off_loop.append(f"{what} read on thread {thread!r}")

    def install(self, core: LLMEngine) -> None:
        guard = self

        class GuardedDeque(deque[Sequence]):
            def __iter__(self) -> Any:
                guard.check("scheduler.waiting")
                return super().__iter__()

            def __len__(self) -> int:
                guard.check("scheduler.waiting")
                return super().__len__()

            def __getitem__(self, index: Any) -> Any:
                guard.check("scheduler.waiting")
                return super().__getitem__(index)

        class GuardedList(list[Sequence]):
            def __iter__(self) -> Any:
                guard.check("scheduler.running")
                return super().__iter__()

            def __len__(self) -> int:
                guard.check("scheduler.running")
                return super().__len__()

            def __getitem__(self, index: Any) -> Any:
                guard.check("scheduler.running")
                return super().__getitem__(index)

        core.scheduler.waiting = GuardedDeque(core.scheduler.waiting)
        core.scheduler.running = GuardedList(core.scheduler.running)


def test_stats_from_other_threads_never_read_the_live_scheduler(tiny_model_factory: Callable[..., Path]) -> None:
    """A thread reads `stats()` and `num_waiting()` over and over while requests start, finish
    and leave early: every read succeeds and none touches the scheduler's queue or running list
    (the loop mutates them; iterating them from another thread can fail with "deque mutated
    during iteration")."""
    core = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), page_size=4, num_pages=64))
    guard = LoopOnlyReads()
    guard.install(core)
    engine = EngineClient([ThreadHandle(core)], max_waiting_requests=64)
    engine.start()
    stop, reads, errors = threading.Event(), [0], []

    def read() -> None:
        while not stop.is_set():
            try:
                stats = engine.stats()
                assert 0 <= stats.kv_pages_free <= stats.kv_pages_total and engine.num_waiting() >= 0
            except Exception as exc:
                errors.append(exc)
            reads[0] += 1

    async def one(max_tokens: int, leave_after: int | None) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        stream = engine.generate([5, 6, 7, 8, 9], params)
        count = 0
        async for _ in stream:
            count += 1
            if count == leave_after:
                break
        await stream.aclose()  # type: ignore[attr-defined]

    async def rounds() -> int:
        done = 0
        while (reads[0] < 500 or done < 3) and done < 200:  # 200: only a cap, should reads stall
            await asyncio.gather(*[one(6, None) for _ in range(3)], *[one(50, 2) for _ in range(3)])
            done += 1
        return done

    reader = threading.Thread(target=read)
    reader.start()
    try:
        done = asyncio.run(rounds())
    finally:
        stop.set()
        reader.join()
    try:
        assert not errors, errors[:3]
        assert not guard.off_loop, guard.off_loop[:3]
        assert reads[0] >= 500, f"the reader made {reads[0]} reads in {done} rounds"
        with pytest.raises(dataclasses.FrozenInstanceError):
            engine.stats().running_requests = 1  # type: ignore[misc]
    finally:
        engine.shutdown(grace_s=1)


def test_stats_are_current_when_a_request_ends_and_count_requests_not_yet_taken_in(
    engine: EngineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop publishes before it delivers: when a request's last output is handed over,
    `stats()` already shows it gone and its pages free. Requests sent while the loop is busy (here
    held in a `call`) count as waiting at once, so admission refuses the one over the limit."""
    at_delivery: list[EngineStats] = []
    deliver = engine._deliver

    def spy(request_id: str, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput) and item.finished:
            at_delivery.append(engine.stats())
        deliver(request_id, item)

    monkeypatch.setattr(engine, "_deliver", spy)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = asyncio.run(collect(engine, [5, 6, 7], params))
    assert outputs[-1].finished
    [stats] = at_delivery
    assert (stats.running_requests, stats.waiting_requests) == (0, 0)
    assert stats.kv_pages_free == stats.kv_pages_total

    held, release = threading.Event(), threading.Event()

    def hold(_: LLMEngine) -> None:
        held.set()
        assert release.wait(timeout=60), "the test never released the loop"

    async def while_held() -> tuple[list[int], BaseException | None, list[list[RequestOutput]]]:
        call = asyncio.ensure_future(engine.call(hold))
        try:
            assert await asyncio.to_thread(held.wait, 60), "the loop never ran the call"
            streams = [engine.generate([5, 6, 7], params) for _ in range(engine.max_waiting_requests)]
            firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
            for _ in range(200):  # each generate() counts itself before it first awaits the loop
                if engine.num_waiting() == len(streams):
                    break
                await asyncio.sleep(0)
            waiting = [engine.num_waiting(), engine.stats().waiting_requests]
            extra = asyncio.ensure_future(engine.generate([5, 6, 7], params).__anext__())
            for _ in range(200):  # refused, if at all, before its first await
                if extra.done():
                    break
                await asyncio.sleep(0)
            if not extra.done():
                extra.cancel()  # admitted: it would wait for the held loop
            refused = None if extra.cancelled() or not extra.done() else extra.exception()
        finally:
            release.set()
            await call
        results = [[await first, *[o async for o in s]] for first, s in zip(firsts, streams, strict=True)]
        return waiting, refused, results

    waiting, refused, results = asyncio.run(while_held())
    assert waiting == [engine.max_waiting_requests] * 2
    assert refused is not None and "already waiting" in str(refused)
    assert all(r[-1].finished and len(r[-1].token_ids) == 4 for r in results)
    stats = engine.stats()
    assert (stats.running_requests, stats.waiting_requests, engine.num_waiting()) == (0, 0, 0)
    assert stats.kv_pages_free == stats.kv_pages_total
