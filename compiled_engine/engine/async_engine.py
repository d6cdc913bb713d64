"""AsyncEngine: runs LLMEngine.step on its own thread and gives each request an asyncio stream.

The loop thread is the only one that touches the engine's state. Callers talk to it through a
thread-safe inbox (add, abort) and receive RequestOutputs on per-request asyncio queues. Leaving a
stream early (a client disconnect closes the async generator) aborts its request, whose pages the
loop returns at its next step.

Given a function that builds the engine instead of an engine, the loop thread builds it (loading,
compiling, warming up) before its first step, so every torch operation of the engine runs on that
one thread. That matters on CPU: once the main thread has run PyTorch's OpenMP-parallel kernels,
the same kernels called from another thread ran markedly slower (docs/benchmarks.md has the
measurement).

The loop is also the only thread that reads the engine's state: after every step (and after
starting, after an idle wake-up and after a `call`) it publishes an `EngineStats` snapshot, which
`stats()` and `num_waiting()` (the `/metrics` scrape, admission) read from any thread. Reading the
scheduler's queue and running list from another thread could meet them mid-change ("deque mutated
during iteration"). Outputs are delivered after the step's snapshot is published, so a caller that
has seen its request finish sees it finished in `stats()` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from compiled_engine.cache.events import CacheEvent
from compiled_engine.engine.adapters import AdapterRequest, AdapterStats
from compiled_engine.engine.drafting import DraftStats
from compiled_engine.engine.engine_client import ReplicaHealth, ServedModel
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import EngineDeadError, EngineOverloadedError, EngineShuttingDownError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequest:
    """A request on its way to the engine's loop (this process's inbox, or a data-parallel
    replica's pipe)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    lora_request: AdapterRequest | None = None
    pooling: bool = False  # a prompt to pool into an embedding (add_pooling_request)

    def add_to(self, engine: LLMEngine) -> None:
        """Queue it in `engine`; the engine's RequestError if it is invalid."""
        if self.pooling:
            engine.add_pooling_request(self.prompt, self.request_id, self.cache_salt, self.lora_request)
        else:
            engine.add_request(self.prompt, self.params, self.request_id, self.cache_salt, self.lora_request)


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    """Run `function(engine)` on the loop thread (what only the loop may touch: the adapters)."""

    function: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


@dataclass(frozen=True)
class EngineStats:
    """The engine's state at one moment, read on the loop thread (`read`) and published whole."""

    running_requests: int
    waiting_requests: int
    kv_pages_total: int
    kv_pages_free: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    lora_loaded: int = 0  # adapters the engine holds
    lora_resident: int = 0  # of those, in device slots
    speculative: DraftStats | None = None  # a copy of the engine's, when it speculates
    num_preemptions: int = 0
    aborted_requests: int = 0  # requests ended by an abort before they finished
    lora_max: int | None = None  # adapter slots (None: no adapters)
    lora_running: tuple[str, ...] = ()  # adapters of running requests
    lora_waiting: tuple[str, ...] = ()  # adapters of waiting ones
    weight_bytes: int = 0  # the models' tensors, each held once (packed on the compiled CPU path)
    kv_cache_bytes: int = 0  # the page pool (a draft model's included)
    kv_cache_tokens: int = 0  # the tokens the page pool holds (pages x page size)
    kv_cache_dtype: str = ""  # the pages' storage type (--kv-cache-dtype resolved), e.g. "float32"

    def counters_only(self) -> EngineStats:
        """This snapshot's counters (tokens looked up and hit in the prefix cache, drafts,
        preemptions, aborts) with every gauge at zero: what a lost engine still adds to the
        totals of several."""
        return EngineStats(
            running_requests=0,
            waiting_requests=0,
            kv_pages_total=0,
            kv_pages_free=0,
            prefix_queried_tokens=self.prefix_queried_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            speculative=self.speculative,
            num_preemptions=self.num_preemptions,
            aborted_requests=self.aborted_requests,
        )

    @classmethod
    def read(cls, engine: LLMEngine) -> EngineStats:
        """The snapshot of `engine`, only on the thread that steps it. `waiting_requests` counts
        the scheduler's queue only (AsyncEngine adds the requests still in its inbox)."""
        scheduler, manager = engine.scheduler, engine.block_manager
        return cls(
            running_requests=len(scheduler.running),
            waiting_requests=len(scheduler.waiting),
            kv_pages_total=manager.num_pages,
            kv_pages_free=manager.num_free_pages,
            prefix_queried_tokens=manager.stats.queried_tokens,
            prefix_hit_tokens=manager.stats.hit_tokens,
            speculative=engine.drafter.snapshot(),
            num_preemptions=scheduler.num_preemptions,
            aborted_requests=engine.num_aborted_requests,
            weight_bytes=engine.weight_bytes,
            kv_cache_bytes=engine.kv_cache_bytes,
            kv_cache_tokens=manager.num_pages * engine.runner.page_size,
            kv_cache_dtype=str(engine.runner.kv_spec.dtype).removeprefix("torch."),
            **_adapter_fields(engine.adapters.stats(scheduler.running, scheduler.waiting)),
        )


def _adapter_fields(found: AdapterStats | None) -> dict[str, Any]:
    if found is None:  # no adapters: the fields' defaults
        return {}
    return {
        "lora_loaded": found.loaded,
        "lora_resident": found.resident,
        "lora_max": found.max_slots,
        "lora_running": found.running,
        "lora_waiting": found.waiting,
    }


CacheEventSink = Callable[[list[CacheEvent]], None]


async def request_outputs(
    stream: asyncio.Queue[RequestOutput | BaseException], abort: Callable[[], None], forget: Callable[[], None]
) -> AsyncGenerator[RequestOutput, None]:
    """A request's outputs from the queue its engine delivers them to, up to the finished one. An
    error in the queue is raised (the engine has already forgotten the request); a caller that
    leaves first (the generator closed at a yield) aborts it. `forget` runs at the end either way."""
    finished = False
    try:
        while True:
            item = await stream.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished:
            abort()
        forget()


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        max_waiting_requests: int = 256,
        cache_events: CacheEventSink | None = None,
    ) -> None:
        """`engine`: an engine, or a function that builds one on the loop thread (see above).
        `cache_events`: called on the loop thread after each step with the prefix cache's events
        (an engine built with `record_cache_events`), e.g. a KV-event publisher."""
        self._cache_events = cache_events
        self._build: Callable[[], LLMEngine] | None = None
        if isinstance(engine, LLMEngine):
            self.engine = engine
        else:
            self._build = engine
        self._built = threading.Event()
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.SimpleQueue[AddRequest | _Abort | _Call] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0  # adds sent to the loop and not yet counted in a published snapshot
        self._taken_adds = 0  # adds the loop has taken from the inbox since it last published (loop only)
        self._published: EngineStats | None = None  # the loop's latest snapshot (under `_lock`)
        self._stop = threading.Event()
        self._accepting = True
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop; with a build function, return once the engine is built (`self.engine`)
        and raise what building it raised."""
        self._thread.start()
        self._built.wait()
        if self.error is not None:
            self._thread.join()
            raise self.error

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @functools.cached_property
    def served(self) -> ServedModel:
        """The model as the server sees it (once the engine is built)."""
        engine = self.engine
        return ServedModel(
            engine.tokenizer, engine.max_model_len, engine.runner.model_config, engine.pooling, engine.grammars
        )

    def health(self) -> list[ReplicaHealth]:
        return [ReplicaHealth(0, self.is_alive, None if self.error is None else repr(self.error))]

    def engine_stats(self) -> dict[int, EngineStats]:
        return {0: self.stats()}

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stop_accepting(self) -> None:
        """Admit no new request (each gets EngineShuttingDownError); in-flight ones go on."""
        self._accepting = False

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop admission, let in-flight requests finish for up to `grace_s`, abort the rest,
        then stop and join the loop."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self.is_alive and self._in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.abort_all()
        deadline = time.monotonic() + 5.0
        while self.is_alive and self._in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    def fail(self, error: BaseException) -> None:
        """Declare the engine dead from outside the loop (a lost tensor-parallel rank): not ready
        from now on, in-flight requests get the error, the loop stops."""
        self.error = error
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(request_id, EngineDeadError(str(error)))
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the loop thread has stopped (shut down, or died: see `error`)."""
        self._thread.join(timeout)

    def _in_flight(self) -> bool:
        with self._lock:
            return bool(self._streams)

    # -- requests -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: AdapterRequest | None = None,
        pooling: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as they come; the last one has `finished` set. Raises the
        engine's RequestError for an invalid request, and the overload / dead / shutdown errors.
        `pooling`: the prompt is pooled instead (runner pooling); its last output carries `embedding`."""
        if self.error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop is not running ({self.error!r})")
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down and admits no new requests")
        if self.num_waiting() >= self.max_waiting_requests:
            raise EngineOverloadedError(f"{self.max_waiting_requests} requests are already waiting")
        request_id = request_id or uuid.uuid4().hex
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
            self._pending_adds += 1
        self._inbox.put(AddRequest(request_id, prompt, params, cache_salt, lora_request, pooling))
        self._wake.set()
        outputs = request_outputs(
            stream, functools.partial(self.abort, request_id), functools.partial(self._forget, request_id)
        )
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                yield output

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every request in flight: each ends with finish reason `abort` at the next step."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id)

    def num_waiting(self) -> int:
        """Requests waiting: the scheduler's queue in the latest snapshot, plus those sent since."""
        return self.stats().waiting_requests

    def stats(self) -> EngineStats:
        """The loop's latest snapshot (safe from any thread: it never reads the live engine), its
        waiting count including the requests not yet taken in by the loop."""
        with self._lock:
            published, pending = self._published, self._pending_adds
        if published is None:
            raise EngineDeadError("the engine loop has published no stats: it was never started, or failed to build")
        return replace(published, waiting_requests=published.waiting_requests + pending) if pending else published

    # -- the loop thread ------------------------------------------------------------------------

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                self.engine.abort_request(request_id)

    async def call(self, function: Callable[[LLMEngine], Any]) -> Any:
        """`function(engine)`, run on the loop thread between steps; its result or its error."""
        if self.error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop is not running ({self.error!r})")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(_Call(function, loop, future))
        self._wake.set()
        return await future

    def _publish(self) -> None:
        """Publish the engine's snapshot (loop thread only); the adds taken in since the last one
        move from the pending count to its waiting count in the same instant."""
        snapshot = EngineStats.read(self.engine)
        with self._lock:
            self._published = snapshot
            self._pending_adds -= self._taken_adds
        self._taken_adds = 0

    def _answer(self, command: _Call) -> None:
        try:
            result, error = command.function(self.engine), None
        except Exception as exc:  # handed to the caller, the loop goes on
            result, error = None, exc
        if self._cache_events is not None:  # what the call changed in the cache (a reset)
            self._cache_events(self.engine.take_cache_events())
        self._publish()  # what the call changed (adapters) is in the stats before its caller resumes

        def settle() -> None:
            if command.future.done():  # the caller gave up
                return
            if error is not None:
                command.future.set_exception(error)
            else:
                command.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody waits
            command.loop.call_soon_threadsafe(settle)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
                continue
            if isinstance(command, _Call):
                self._answer(command)
                continue
            self._taken_adds += 1
            with self._lock:
                listening = command.request_id in self._streams
            if not listening:
                continue  # the caller left before the loop saw the request
            try:
                command.add_to(self.engine)
            except Exception as exc:  # invalid request: hand the error to its caller
                self._deliver(command.request_id, exc)

    def _run(self) -> None:
        try:
            if self._build is not None:
                self.engine = self._build()
            self._publish()
        except BaseException as exc:
            self.error = exc
            return
        finally:
            self._built.set()
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if self._cache_events is not None:
                        self._cache_events(self.engine.take_cache_events())
                    self._publish()
                    for output in outputs:
                        self._deliver(output.request_id, output)
                else:
                    self._publish()  # the inbox's aborts and refused adds
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as exc:
            self.error = exc
            logger.exception("the engine loop died")
            with self._lock:
                request_ids = list(self._streams)
            for request_id in request_ids:
                self._deliver(request_id, EngineDeadError(f"the engine loop died: {exc!r}"))
