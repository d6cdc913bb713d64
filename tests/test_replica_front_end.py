"""The data-parallel front end in this process over two replicas of a tiny model: requests and
their errors cross the pipes whole, an adapter's repeated prompt goes back to the replica that
cached it, a call reaches every replica, the stats add up, and a replica that cannot start stops
the start with its own reason."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import EngineDeadError, PromptError, PromptProblem
from compiled_engine.lora.adapter import LoRAError
from compiled_engine.lora.manager import LoRARequest
from compiled_engine.serving.client import EngineClient
from compiled_engine.serving.messages import AbortRequest
from compiled_engine.serving.replica import replica_handles
from tests.test_lora import _peft_adapter
from tests.waiting import wait_until


def _pages_plus(extra: int, engine: LLMEngine) -> int:
    """A call for every replica (module-level: it is pickled to them)."""
    return engine.block_manager.num_pages + extra


def _refuse(engine: LLMEngine) -> None:
    raise ValueError("refused on purpose")


@pytest.fixture(scope="module")
def front_end(tiny_model_factory: Callable[..., Path]) -> Iterator[EngineClient]:
    config = EngineConfig(
        model=str(tiny_model_factory("llama")),
        enforce_eager=True,
        page_size=4,
        num_pages=32,
        data_parallel_size=2,
        enable_lora=True,
    )
    engine = EngineClient(replica_handles(config))
    engine.start()
    yield engine
    engine.shutdown(grace_s=5)


def _one_engines_ids(config: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt's ids from one engine in this process, one request at a time."""
    engine = LLMEngine(config)
    try:
        found = []
        for prompt in prompts:
            engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                found += [o.outputs[0].token_ids for o in engine.step() if o.finished]
        return found
    finally:
        engine.shutdown()


async def _last(
    engine: EngineClient, prompt: list[int], params: SamplingParams, adapter: LoRARequest | None = None
) -> RequestOutput:
    final = None
    async for output in engine.generate(prompt, params, lora_request=adapter):
        final = output
    assert final is not None and final.finished
    return final


def test_requests_spread_and_match_one_engine(front_end: EngineClient) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 7 + i] for i in range(6)]

    async def run() -> list[RequestOutput]:
        return await asyncio.gather(*(_last(front_end, prompt, params) for prompt in prompts))

    outputs = asyncio.run(run())
    assert {output.engine_index for output in outputs} == {0, 1}
    one = msgspec.structs.replace(front_end._replicas[0].config, data_parallel_size=1)
    assert [output.outputs[0].token_ids for output in outputs] == _one_engines_ids(one, prompts, params)
    stats = front_end.engine_stats()
    assert set(stats) == {0, 1}
    assert front_end.stats().kv_pages_total == 64 == sum(s.kv_pages_total for s in stats.values())
    assert [replica.alive for replica in front_end.health()] == [True, True]


def test_an_adapters_repeated_prompt_goes_back_to_the_replica_that_cached_it(
    front_end: EngineClient, tmp_path: Path
) -> None:
    """The front end keys an adapter's pages as its replica does (name and a digest of the files),
    so the second run of a prompt finds its pages; an adapter it cannot read still runs, by load."""
    adapter = LoRARequest(
        "tiny", str(_peft_adapter(Path(front_end._replicas[0].config.model), tmp_path / "tiny", seed=1))
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = [(7 * i) % 200 + 3 for i in range(24)]  # 6 pages of 4

    async def twice(source: LoRARequest) -> list[RequestOutput]:
        first = await _last(front_end, prompt, params, source)
        return [first, await _last(front_end, prompt, params, source)]

    first, second = asyncio.run(twice(adapter))
    assert second.engine_index == first.engine_index and second.num_cached_tokens >= 20
    base = asyncio.run(_last(front_end, prompt, params))  # the base model's pages are others
    assert base.num_cached_tokens == 0 and base.outputs[0].token_ids != first.outputs[0].token_ids
    with pytest.raises(LoRAError, match="no such adapter directory"):
        asyncio.run(_last(front_end, prompt, params, LoRARequest("gone", str(tmp_path / "gone"))))


def _hold_until(release: str, pid: int, engine: LLMEngine) -> int:
    """On the replica in process `pid`: hold its loop (as a long step would) until `release`
    exists; `release` + ".held" says it is held."""
    if os.getpid() == pid:
        Path(release + ".held").touch()
        deadline = time.monotonic() + 120
        while not Path(release).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return 0


def test_a_message_to_a_replica_busy_in_a_step_is_queued_not_waited_for(
    front_end: EngineClient, tmp_path: Path
) -> None:
    """A message larger than the pipe holds waits for the replica to read it, which it does only
    between steps: the front end's send (on the server's event loop) must not wait with it."""
    release = tmp_path / "release"
    held = functools.partial(_hold_until, str(release), front_end._replicas[0].process.pid)
    call = threading.Thread(target=lambda: asyncio.run(front_end.call(held)))
    call.start()
    try:
        wait_until(Path(str(release) + ".held").exists, "replica 0 held")
        send = threading.Thread(target=front_end._replicas[0].send, args=(AbortRequest("x" * 4_000_000),))
        send.start()
        send.join(timeout=30)  # a guard: a send that waits for the replica never ends while it is held
        assert not send.is_alive(), "the send waited for the replica to read"
    finally:
        release.touch()
        call.join(timeout=60)
    assert asyncio.run(_last(front_end, [4, 5, 6], SamplingParams(max_tokens=2))).finished  # both serve on


def test_an_invalid_request_fails_with_the_replicas_error_whole(front_end: EngineClient) -> None:
    with pytest.raises(PromptError) as refused:
        asyncio.run(_last(front_end, [10**6], SamplingParams(max_tokens=2)))
    assert refused.value.problem is PromptProblem.OUT_OF_VOCABULARY and refused.value.param == "prompt"
    assert front_end.num_waiting() == 0  # nothing left queued


def test_a_call_runs_on_every_replica(front_end: EngineClient) -> None:
    assert asyncio.run(front_end.call(functools.partial(_pages_plus, 1))) == 33
    with pytest.raises(ValueError, match="refused on purpose"):
        asyncio.run(front_end.call(_refuse))


def test_a_replica_that_cannot_start_stops_the_start_with_its_reason(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    engine = EngineClient(replica_handles(EngineConfig(model=str(missing), enforce_eager=True, data_parallel_size=2)))
    with pytest.raises(EngineDeadError, match="replica 0 failed to start") as failed:
        engine.start()
    assert "no-such-model" in str(failed.value)


@pytest.mark.full
def test_replicas_of_two_tensor_parallel_ranks_each(tiny_model_factory: Callable[..., Path]) -> None:
    """DP = 2 x TP = 2: each replica starts its own ranks, and the text is one process's."""
    config = EngineConfig(
        model=str(tiny_model_factory("llama")),
        enforce_eager=True,
        page_size=4,
        num_pages=32,
        data_parallel_size=2,
        tensor_parallel_size=2,
    )
    engine = EngineClient(replica_handles(config))
    engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]]

        async def run() -> list[RequestOutput]:
            return await asyncio.gather(*(_last(engine, prompt, params) for prompt in prompts))

        outputs = asyncio.run(run())
    finally:
        engine.shutdown(grace_s=5)
    assert {output.engine_index for output in outputs} == {0, 1}
    one = msgspec.structs.replace(config, data_parallel_size=1, tensor_parallel_size=1)
    assert [output.outputs[0].token_ids for output in outputs] == _one_engines_ids(one, prompts, params)


def _fail_slowly(pid: int, engine: LLMEngine) -> int:
    """On the replica in process `pid`: its engine loop dies (not an Exception, which a call
    would return), and its engine's shutdown then takes two minutes."""
    if os.getpid() != pid:
        return 0
    engine.shutdown = lambda: time.sleep(120)  # type: ignore[method-assign]
    raise KeyboardInterrupt


@pytest.mark.full
def test_a_replica_whose_loop_fails_leaves_at_once_and_its_counters_stay_in_the_totals(
    tiny_model_factory: Callable[..., Path],
) -> None:
    config = EngineConfig(
        model=str(tiny_model_factory("llama")), enforce_eager=True, page_size=4, num_pages=16, data_parallel_size=2
    )
    engine = EngineClient(replica_handles(config))
    engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

        async def both() -> list[RequestOutput]:
            return await asyncio.gather(*(_last(engine, [9, 8, 7, 6, 5 + i, 4, 3, 2], params) for i in range(2)))

        assert {output.engine_index for output in asyncio.run(both())} == {0, 1}
        queried = engine.stats().prefix_queried_tokens
        assert queried >= 16
        with pytest.raises(EngineDeadError, match="engine loop died"):
            asyncio.run(engine.call(functools.partial(_fail_slowly, engine._replicas[0].process.pid)))
        # Seen dead on its report, while its shutdown still runs: routing and /health know it.
        assert engine._replicas[0].process.is_alive()
        assert [replica.alive for replica in engine.health()] == [False, True]
        assert asyncio.run(_last(engine, [1, 2, 3], params)).engine_index == 1
        assert engine.stats().prefix_queried_tokens >= queried + 3  # replica 0's count is not lost
    finally:
        engine.shutdown(grace_s=5)


def test_with_every_replica_lost_the_engine_is_dead_and_says_why(tiny_model_factory: Callable[..., Path]) -> None:
    config = EngineConfig(
        model=str(tiny_model_factory("llama")), enforce_eager=True, page_size=4, num_pages=16, data_parallel_size=2
    )
    engine = EngineClient(replica_handles(config))
    engine.start()
    try:
        engine.kill_replica(0)
        wait_until(lambda: [replica.alive for replica in engine.health()] == [False, True], "replica 0 seen dead")
        assert engine.is_alive and engine.error is None  # one left serves
        assert asyncio.run(_last(engine, [1, 2, 3], SamplingParams(max_tokens=2))).engine_index == 1
        engine.kill_replica(1)
        wait_until(lambda: not engine.is_alive, "every replica seen dead")
        assert isinstance(engine.error, EngineDeadError) and "every data-parallel replica has stopped" in str(
            engine.error
        )
        assert all("exited with code -9" in (replica.error or "") for replica in engine.health())
        with pytest.raises(EngineDeadError):
            asyncio.run(_last(engine, [1, 2, 3], SamplingParams(max_tokens=2)))
    finally:
        engine.shutdown(grace_s=0)


def test_a_stopped_replica_is_lost_after_its_heartbeat_timeout_and_the_other_serves_on(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """SIGSTOP: the process neither reports nor closes its pipe. Its request fails once it has
    been silent for the timeout, its process is killed, and routing and health leave it."""
    config = EngineConfig(
        model=str(tiny_model_factory("llama")),
        enforce_eager=True,
        page_size=4,
        num_pages=16,
        data_parallel_size=2,
        replica_heartbeat_timeout_s=3.0,
    )
    engine = EngineClient(replica_handles(config))
    engine.start()
    stopped = engine._replicas[1].process
    try:
        time.sleep(4.0)  # idle for longer than the timeout: the heartbeats keep both alive
        assert [replica.alive for replica in engine.health()] == [True, True]
        assert stopped.pid is not None
        os.kill(stopped.pid, signal.SIGSTOP)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

        async def one_on_each() -> list[RequestOutput | BaseException]:
            requests = [_last(engine, [9, 8, 7, 6, 5 + i], params) for i in range(2)]
            return await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), timeout=60)

        started = time.monotonic()
        served, lost = sorted(asyncio.run(one_on_each()), key=lambda result: isinstance(result, BaseException))
        assert isinstance(served, RequestOutput) and served.engine_index == 0
        assert isinstance(lost, EngineDeadError) and "replica 1 died: it reported nothing" in str(lost)
        # Not before the timeout: the last heartbeat came at most about 1.5 s before the stop
        # (an idle loop polls every 0.5 s and beats once a second has passed).
        assert time.monotonic() - started >= 3.0 - 1.5 - 0.25
        [_, health] = engine.health()
        assert not health.alive and "stopped or hung" in (health.error or "")
        stopped.join(timeout=10)
        assert stopped.exitcode == -signal.SIGKILL
        assert asyncio.run(_last(engine, [1, 2, 3], params)).engine_index == 0
    finally:
        if stopped.is_alive() and stopped.pid is not None:
            os.kill(stopped.pid, signal.SIGCONT)
        engine.shutdown(grace_s=1)
