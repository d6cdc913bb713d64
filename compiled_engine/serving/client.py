"""What the server holds the engine by: one `EngineClient` over one engine handle (the engine on a
thread of this process) or N (`serve --data-parallel-size N`: replica processes, a request going
to the one `PrefixRouter` picks). The routes never ask which.

Each request gets an asyncio stream, fed from its engine's step reports (on the loop's thread, or
a replica's reader thread); leaving it early (a client disconnect closes the generator) aborts
the request. Stats are the loops' published snapshots, safe to read from any thread; requests sent
and not yet taken in by a loop count as waiting at once.

An engine that dies is seen at once (its loop's failure, a replica's pipe closing) or by the
watchdog (`EngineHandle.check`: a replica silent for `replica_heartbeat_timeout_s`, a lost
tensor-parallel rank). Its requests end with EngineDeadError (a 503 before a stream's 200, the
API's error event after it), it leaves the routing, `/health` and `/metrics` report it down, and
any others go on serving. Shutdown drains: no new requests, in-flight ones finish for the grace
period, the rest are aborted, then the engines stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from compiled_engine.cache.events import CacheEvent, prompt_page_keys, salt_key
from compiled_engine.engine.adapters import AdapterRequest
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine.stats import EngineStats, summed_stats
from compiled_engine.errors import EngineDeadError, EngineOverloadedError, EngineShuttingDownError
from compiled_engine.lora.adapter import LoRAError, adapter_dir, digest_of
from compiled_engine.serving.handle import EngineHandle, ServedModel
from compiled_engine.serving.messages import (
    AbortRequest,
    AddRequest,
    CallDone,
    CallEngine,
    Command,
    EngineFailed,
    Report,
    StepReport,
)
from compiled_engine.serving.routing import DEFAULT_BALANCE_SLACK, PrefixRouter

logger = logging.getLogger(__name__)

# Engine index, its cache events: what a KV-event publisher is handed (on the engine's loop or
# reader thread).
CacheEventSink = Callable[[int, list[CacheEvent]], None]


@dataclass(frozen=True)
class ReplicaHealth:
    """One engine's state as the server reports it (`/health`, `/metrics`)."""

    index: int
    alive: bool
    error: str | None = None  # why it stopped, once it has


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    replica: EngineHandle


@dataclass
class _PendingCall:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    replica: EngineHandle


class EngineClient:
    def __init__(
        self,
        handles: Sequence[EngineHandle],
        max_waiting_requests: int = 256,
        cache_events: CacheEventSink | None = None,
    ) -> None:
        """`handles`: the engines, not yet launched (index i at position i). `cache_events`:
        called with each engine's prefix-cache events (an engine built with
        `record_cache_events`), e.g. a KV-event publisher."""
        self._replicas = list(handles)
        self.max_waiting_requests = max_waiting_requests
        self._cache_events = cache_events
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, _PendingCall] = {}
        self._call_ids = itertools.count()
        self._accepting = True
        self._stopped = False
        self.router: PrefixRouter | None = None  # over several engines
        self._adapter_digests: dict[tuple[str, str], str] = {}  # by adapter name and path

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every engine and return once all are ready; if one fails to start, end the others
        and raise its error."""
        for replica in self._replicas:
            replica.launch(functools.partial(self._take, replica))
        try:
            ready = [replica.wait_ready() for replica in self._replicas]
        except BaseException:
            for replica in self._replicas:
                replica.kill()
                replica.close()
            raise
        with self._lock:
            for replica, message in zip(self._replicas, ready, strict=True):
                replica.stats, replica.alive, replica.last_heard = message.stats, True, time.monotonic()
        if len(self._replicas) > 1:
            self.router = PrefixRouter(len(self._replicas), ready[0].page_size, DEFAULT_BALANCE_SLACK)
        self.served: ServedModel = self._replicas[0].served()
        if self.watched:
            threading.Thread(target=self._watch, name="engine-liveness", daemon=True).start()

    @property
    def engine(self) -> LLMEngine:
        """The engine of a client over one thread handle: for logs and benches."""
        engine = self._replicas[0].engine
        assert engine is not None and len(self._replicas) == 1, "the engines run in replica processes"
        return engine

    @property
    def watched(self) -> bool:
        """Whether the watchdog can lose an engine (replicas, tensor-parallel ranks)."""
        return any(replica.watch_every_s is not None for replica in self._replicas)

    @property
    def is_alive(self) -> bool:
        """At least one engine runs and can take requests."""
        return not self._stopped and any(replica.alive for replica in self._replicas)

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def error(self) -> BaseException | None:
        """Why the whole engine stopped (None while any part of it runs)."""
        reasons = [replica.reason for replica in self._replicas if replica.reason is not None]
        if not reasons or len(reasons) < len(self._replicas):
            return None
        if len(reasons) == 1:
            return EngineDeadError(f"{self._replicas[0].name} is not running: {reasons[0]}")
        return EngineDeadError(f"every data-parallel replica has stopped: {'; '.join(reasons)}")

    def stop_accepting(self) -> None:
        """Admit no new request (each gets EngineShuttingDownError); in-flight ones go on."""
        self._accepting = False

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop admission, let in-flight requests finish for up to `grace_s`, abort the rest, then
        stop every engine."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self.is_alive and self._in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.abort_all()
        deadline = time.monotonic() + 5.0
        while self.is_alive and self._in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._stopped:
            return
        self._stopped = True
        for replica in self._replicas:
            replica.stop()
        for replica in self._replicas:
            replica.close()

    def fail(self, error: BaseException) -> None:
        """Declare every engine dead from outside its loop (a lost tensor-parallel rank): not
        ready from now on, in-flight requests get the error, the loops stop."""
        for replica in self._replicas:
            self._lose(replica, str(error))
            replica.kill()

    def kill_replica(self, index: int) -> None:
        """Kill one engine (as a crash would): for tests and drills."""
        self._replicas[index].kill()

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
        if not self.is_alive:
            raise self._dead()
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down and admits no new requests")
        if self.num_waiting() >= self.max_waiting_requests:
            raise EngineOverloadedError(f"{self.max_waiting_requests} requests are already waiting")
        request_id = request_id or uuid.uuid4().hex
        keys = await self._page_keys(prompt, cache_salt, lora_request)
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            replica = self._choose(keys)
            replica.adds_sent += 1
            self._streams[request_id] = _Stream(asyncio.get_running_loop(), stream, replica)
        finished = False
        try:
            self._send(replica, AddRequest(request_id, prompt, params, cache_salt, lora_request, pooling))
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):  # the engine has forgotten the request
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:  # a caller that leaves first (the generator closed at a yield) aborts it
            if not finished:
                self.abort(request_id)
            self._forget(request_id)

    async def _page_keys(
        self, prompt: str | list[int], cache_salt: str | None, lora_request: AdapterRequest | None
    ) -> list[int]:
        """The prompt's page keys as an engine's prefix cache keys them (Sequence.prefix_salt), for
        the router: with an adapter, under its name and a digest of its files, read once per name
        and path off the event loop. An adapter whose files cannot be read gets no digest here:
        its keys match nothing, it goes by load, and its engine gives the error."""
        if self.router is None or not isinstance(prompt, list):
            return []
        if lora_request is None:
            return prompt_page_keys(prompt, salt_key(cache_salt, None, None), self.router.page_size)
        source = (lora_request.name, lora_request.path)
        digest = self._adapter_digests.get(source)
        if digest is None:
            with contextlib.suppress(OSError, LoRAError):
                digest = await asyncio.to_thread(lambda: digest_of(adapter_dir(lora_request.path)))
                self._adapter_digests[source] = digest
        return prompt_page_keys(prompt, salt_key(cache_salt, lora_request.name, digest), self.router.page_size)

    def _choose(self, keys: list[int]) -> EngineHandle:
        """The engine for a request (under the lock)."""
        if self.router is None:
            return self._replicas[0]
        try:
            route = self.router.choose(keys)
        except LookupError:
            raise EngineDeadError("no data-parallel replica is alive") from None
        self.router.replicas[route.replica].in_flight += 1
        return self._replicas[route.replica]

    def _send(self, replica: EngineHandle, command: Command) -> None:
        if not replica.alive:
            raise EngineDeadError(f"{replica.name} is not running")
        replica.send(command)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None and self.router is not None:
                self.router.replicas[stream.replica.index].in_flight -= 1

    def abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            with contextlib.suppress(EngineDeadError):
                self._send(stream.replica, AbortRequest(request_id))

    def abort_all(self) -> None:
        """Abort every request in flight: each ends with finish reason `abort` at the next step."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id)

    async def call(self, function: Callable[[LLMEngine], Any]) -> Any:
        """`function(engine)` on every live engine's loop, between steps (to a replica it is
        pickled: a module-level function or a partial of one). The first error any of them
        raised, else the first one's result."""
        if not self.is_alive:
            raise self._dead()
        loop = asyncio.get_running_loop()
        futures = []
        for replica in self._replicas:
            future: asyncio.Future[Any] = loop.create_future()
            call_id = next(self._call_ids)
            with self._lock:
                self._calls[call_id] = _PendingCall(loop, future, replica)
            try:
                self._send(replica, CallEngine(call_id, function))
            except EngineDeadError:  # lost (or never started): the others still answer
                with self._lock:
                    self._calls.pop(call_id, None)
                continue
            futures.append(future)
        if not futures:
            raise self._dead()
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results[0]

    def _dead(self) -> EngineDeadError:
        return EngineDeadError(str(self.error or "the engine is not running"))

    # -- stats ----------------------------------------------------------------------------------

    def engine_stats(self) -> dict[int, EngineStats]:
        """Each live engine's latest snapshot by index (vLLM's `engine` label), counting the
        requests sent to it and not yet taken in as waiting."""
        with self._lock:
            return self._live_stats()

    def _live_stats(self) -> dict[int, EngineStats]:
        return {
            replica.index: replace(
                replica.stats,
                waiting_requests=replica.stats.waiting_requests + max(0, replica.adds_sent - replica.adds_taken),
            )
            for replica in self._replicas
            if replica.stats is not None and self._shown(replica)
        }

    def _shown(self, replica: EngineHandle) -> bool:
        # One engine's last snapshot stands after it stopped: there is no other to show.
        return replica.alive or len(self._replicas) == 1

    def stats(self) -> EngineStats:
        """The live engines' snapshots added up, and the counters of those lost (so that no total
        counted so far goes down when a replica dies)."""
        with self._lock:  # one reading: an engine lost meanwhile is counted once
            found = list(self._live_stats().values())
            lost = [r.stats.counters_only() for r in self._replicas if r.stats is not None and not self._shown(r)]
        if not found:
            raise EngineDeadError("the engine loop has published no stats: it was never started, or every one died")
        return summed_stats(found + lost)

    def num_waiting(self) -> int:
        """Requests waiting: the engines' queues in their latest snapshots, plus those sent since."""
        return sum(stats.waiting_requests for stats in self.engine_stats().values())

    def health(self) -> list[ReplicaHealth]:
        return [ReplicaHealth(replica.index, replica.alive, replica.reason) for replica in self._replicas]

    # -- the loops' reports ---------------------------------------------------------------------

    def _take(self, replica: EngineHandle, report: Report) -> None:
        """A report of `replica`'s loop: on its loop thread (in this process) or its reader thread."""
        replica.last_heard = time.monotonic()
        if isinstance(report, StepReport):
            with self._lock:
                replica.stats = report.stats
                replica.adds_taken = report.adds_taken
                if self.router is not None:
                    self.router.apply(replica.index, report.cache_events)
            if self._cache_events is not None and report.cache_events:
                self._cache_events(replica.index, report.cache_events)
            for request_id, error in report.refused:
                self._deliver(request_id, error)
            for output in report.outputs:
                output.engine_index = replica.index
                self._deliver(output.request_id, output)
        elif isinstance(report, CallDone):
            with self._lock:
                pending = self._calls.pop(report.call_id, None)
            if pending is not None:
                _settle(pending, report.result, report.error)
        elif isinstance(report, EngineFailed) and not self._stopped:
            # Lost now, not when a replica's pipe closes: its engine's shutdown may take a while
            # (a lost rank of its own), and no request may be routed to it meanwhile.
            self._lose(replica, report.reason)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                self.abort(request_id)

    def _watch(self) -> None:
        """Lose each engine its handle gives up on (see `EngineHandle.check`), and end it."""
        period = min(r.watch_every_s for r in self._replicas if r.watch_every_s is not None)
        while not self._stopped:
            time.sleep(period)
            for replica in self._replicas:
                reason = replica.check(time.monotonic() - replica.last_heard) if replica.alive else None
                if reason is not None and not self._stopped:
                    self._lose(replica, reason)
                    replica.kill()

    def _lose(self, replica: EngineHandle, reason: str) -> None:
        """An engine died: its requests and calls fail, it leaves the routing."""
        with self._lock:
            if not replica.alive:
                return
            replica.alive = False
            replica.reason = reason
            if self.router is not None:
                self.router.mark_dead(replica.index)
            streams = [rid for rid, stream in self._streams.items() if stream.replica is replica]
            calls = [cid for cid, call in self._calls.items() if call.replica is replica]
            lost_calls = [self._calls.pop(cid) for cid in calls]
        logger.error("%s died (%s)", replica.name, reason)
        error = f"{replica.name} died: {reason}"
        for request_id in streams:
            self._deliver(request_id, EngineDeadError(error))
        for call in lost_calls:
            _settle(call, None, EngineDeadError(error))


def _settle(call: _PendingCall, result: Any, error: BaseException | None) -> None:
    def settle() -> None:
        if call.future.done():  # the caller gave up
            return
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody waits
        call.loop.call_soon_threadsafe(settle)
