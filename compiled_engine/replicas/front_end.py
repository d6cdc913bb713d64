"""`serve --data-parallel-size N`: one HTTP front end over N engine replicas, each a process of its
own (replicas/replica.py) on its own share of the cores, or its own GPUs (replicas/placement.py).

The front end speaks the server's engine interface (engine/engine_client.py), so every route
works unchanged. A request goes to the replica `PrefixRouter` picks (the one that caches most of
its prompt unless it is overloaded, else the least loaded); its outputs come back over that
replica's pipe, read by one thread per replica, and reach the request's asyncio stream. What goes
to a replica is queued for a writer thread of its own: a replica reads its pipe only between
steps, and the server's event loop must never wait for that.

A replica that dies is seen at once: its engine's failure when it reports it, its process's exit
when its pipe closes. One that stops or hangs is seen when it has sent nothing (no step report, no
idle heartbeat) for `replica_heartbeat_timeout_s`; its process is then killed. A lost replica's
requests end with EngineDeadError (a 503 before a stream's 200, the API's error event after it),
it leaves the routing, `/health` and `/metrics` report it down, and the other replicas go on serving. Shutdown drains all of them:
no new requests, in-flight ones finish for the grace period, then the rest are aborted and the
replicas are stopped.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import itertools
import logging
import multiprocessing
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec

from compiled_engine.cache.events import CacheEvent, prompt_page_keys, salt_key
from compiled_engine.config import EngineConfig
from compiled_engine.engine.adapters import AdapterRequest
from compiled_engine.engine.async_engine import EngineStats, request_outputs
from compiled_engine.engine.engine_client import ReplicaHealth, ServedModel, summed_stats
from compiled_engine.engine.feature_plan import plan_features
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import EngineDeadError, EngineOverloadedError, EngineShuttingDownError
from compiled_engine.lora.adapter import LoRAError, adapter_dir, digest_of
from compiled_engine.replicas import placement as placing
from compiled_engine.replicas.messages import (
    AbortRequest,
    AddRequest,
    CallDone,
    CallEngine,
    FromReplica,
    ReplicaFailed,
    ReplicaReady,
    StepReport,
    Stop,
    ToReplica,
)
from compiled_engine.replicas.replica import ReplicaSpec, run_replica
from compiled_engine.replicas.routing import DEFAULT_BALANCE_SLACK, PrefixRouter
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.weights.source import resolve_model_dir

logger = logging.getLogger(__name__)

# Replica index, its cache events: what a KV-event publisher is handed (on a reader thread).
ReplicaEventSink = Callable[[int, list[CacheEvent]], None]


@dataclass
class _Replica:
    index: int
    process: BaseProcess
    conn: Connection
    stats: EngineStats
    outbox: queue.SimpleQueue[ToReplica | None] = field(default_factory=queue.SimpleQueue)
    alive: bool = True
    error: str | None = None
    adds_sent: int = 0
    adds_taken: int = 0
    last_heard: float = field(default_factory=time.monotonic)  # when its last message came

    def send(self, message: ToReplica) -> None:
        """Queue `message` for the replica's writer thread, in order. It never blocks: a pipe
        write waits while the replica is inside a step (it reads between steps), which must not
        stall the event loop. Raises EngineDeadError when the replica is gone."""
        if not self.alive:
            raise EngineDeadError(f"data-parallel replica {self.index} is not running")
        self.outbox.put(message)

    def write(self) -> None:
        """The writer thread: the queued messages into the pipe until None, or until the pipe
        breaks (the reader then sees it close and loses the replica)."""
        while (message := self.outbox.get()) is not None:
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # a broken or closed pipe
                return


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    replica: int


@dataclass
class _PendingCall:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    replica: int


class DataParallelEngine:
    def __init__(
        self,
        config: EngineConfig,
        lora_modules: dict[str, str] | None = None,
        max_waiting_requests: int = 256,
        cache_events: ReplicaEventSink | None = None,
        balance_slack: int = DEFAULT_BALANCE_SLACK,
        start_timeout_s: float = 1800.0,
        log_format: str = "text",
    ) -> None:
        self.config = config
        self.size = config.data_parallel_size
        self.lora_modules = dict(lora_modules or {})
        self.max_waiting_requests = max_waiting_requests
        self._cache_events = cache_events
        self._balance_slack = balance_slack
        self._start_timeout_s = start_timeout_s
        self._log_format = log_format
        self._lock = threading.Lock()
        self._replicas: list[_Replica] = []
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, _PendingCall] = {}
        self._call_ids = itertools.count()
        self._accepting = True
        self._stopped = False
        self.router: PrefixRouter | None = None
        self._served: ServedModel | None = None
        self._adapter_digests: dict[tuple[str, str], str] = {}  # by adapter name and path

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every replica and return once all are ready; if one fails to start, stop the
        others and raise its error."""
        config = msgspec.structs.replace(self.config, data_parallel_size=1)
        device = config.resolved_device().type
        where = placing.placements(self.size, config.tensor_parallel_size, device)
        context = multiprocessing.get_context("spawn")
        atexit.register(self._stop_processes)
        started: list[tuple[BaseProcess, Connection]] = []
        for index, placement in enumerate(where):
            ours, theirs = context.Pipe()
            spec = ReplicaSpec(index, config, self.lora_modules, placement, self._log_format)
            process = context.Process(target=run_replica, args=(spec, theirs), name=f"dp-replica-{index}")
            process.start()
            theirs.close()
            started.append((process, ours))
            logger.info("data-parallel replica %d started (pid %s, %s)", index, process.pid, _where(placement))
        try:
            ready = [self._wait_ready(index, process, conn) for index, (process, conn) in enumerate(started)]
        except BaseException:
            for stopped, pipe in started:
                pipe.close()
                stopped.kill()
                stopped.join()
            raise
        self._replicas = [
            _Replica(index, process, conn, message.stats)
            for index, ((process, conn), message) in enumerate(zip(started, ready, strict=True))
        ]
        first = ready[0]
        self.router = PrefixRouter(self.size, first.page_size, self._balance_slack)
        self._served = self._serve_model(first)
        for replica in self._replicas:
            threading.Thread(
                target=self._read, args=(replica,), name=f"dp-replica-{replica.index}-reader", daemon=True
            ).start()
            threading.Thread(target=replica.write, name=f"dp-replica-{replica.index}-writer", daemon=True).start()
        threading.Thread(target=self._watch, name="dp-replica-watchdog", daemon=True).start()

    def _wait_ready(self, index: int, process: BaseProcess, conn: Connection) -> ReplicaReady:
        deadline = time.monotonic() + self._start_timeout_s
        while not conn.poll(1.0):
            if not process.is_alive():
                raise EngineDeadError(f"data-parallel replica {index} exited while starting (code {process.exitcode})")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"data-parallel replica {index} was not ready in {self._start_timeout_s:.0f} s")
        try:
            message: FromReplica = conn.recv()
        except EOFError:
            process.join()
            raise EngineDeadError(
                f"data-parallel replica {index} exited while starting (code {process.exitcode})"
            ) from None
        if isinstance(message, ReplicaFailed):
            raise EngineDeadError(message.error)
        assert isinstance(message, ReplicaReady), message
        logger.info("data-parallel replica %d ready", index)
        return message

    def _serve_model(self, ready: ReplicaReady) -> ServedModel:
        """The front end's own tokenizer and grammar compiler; the rest from replica 0."""
        model_dir = resolve_model_dir(self.config.model)
        tokenizer_file = model_dir / "tokenizer.json"
        tokenizer = Tokenizer(model_dir) if tokenizer_file.is_file() else None
        eos = tokenizer.eos_token_ids if tokenizer else frozenset(ready.model_config.eos_token_ids)
        grammars = plan_features(self.config, Path(model_dir)).grammars(
            tokenizer_file if tokenizer else None, ready.model_config.vocab_size, eos
        )
        return ServedModel(tokenizer, ready.max_model_len, ready.model_config, ready.pooling, grammars)

    @property
    def served(self) -> ServedModel:
        if self._served is None:
            raise EngineDeadError("the data-parallel replicas were never started")
        return self._served

    @property
    def is_alive(self) -> bool:
        return not self._stopped and any(replica.alive for replica in self._replicas)

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def error(self) -> BaseException | None:
        if self._replicas and not any(replica.alive for replica in self._replicas):
            reasons = "; ".join(replica.error or "stopped" for replica in self._replicas)
            return EngineDeadError(f"every data-parallel replica has stopped: {reasons}")
        return None

    def stop_accepting(self) -> None:
        self._accepting = False

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop admission, let in-flight requests finish for up to `grace_s`, abort the rest, then
        stop every replica."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self.is_alive and self._in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.abort_all()
        deadline = time.monotonic() + 5.0
        while self.is_alive and self._in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop_processes()

    def _stop_processes(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for replica in self._replicas:
            if replica.alive:
                with contextlib.suppress(EngineDeadError):
                    replica.send(Stop())
        for replica in self._replicas:
            replica.process.join(timeout=10.0)
            if replica.process.is_alive():
                replica.process.kill()
                replica.process.join()
            replica.outbox.put(None)
            replica.conn.close()

    def _in_flight(self) -> bool:
        with self._lock:
            return bool(self._streams)

    def kill_replica(self, index: int) -> None:
        """Kill one replica's process (as a crash would): for tests and drills."""
        self._replicas[index].process.kill()

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
        """AsyncEngine.generate's contract, on the replica the router picks."""
        if not self.is_alive:
            raise EngineDeadError(str(self.error or "the data-parallel replicas are not running"))
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down and admits no new requests")
        if self.num_waiting() >= self.max_waiting_requests:
            raise EngineOverloadedError(f"{self.max_waiting_requests} requests are already waiting")
        assert self.router is not None
        request_id = request_id or uuid.uuid4().hex
        salt = await self._prefix_salt(cache_salt, lora_request)
        keys = prompt_page_keys(prompt, salt, self.router.page_size) if isinstance(prompt, list) else []
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            try:
                route = self.router.choose(keys)
            except LookupError:
                raise EngineDeadError("no data-parallel replica is alive") from None
            replica = self._replicas[route.replica]
            self.router.replicas[route.replica].in_flight += 1
            self._streams[request_id] = _Stream(asyncio.get_running_loop(), stream, route.replica)
            replica.adds_sent += 1
        forget = functools.partial(self._forget, request_id, route.replica)
        try:
            replica.send(AddRequest(request_id, prompt, params, cache_salt, lora_request, pooling))
        except EngineDeadError:
            forget()
            raise
        outputs = request_outputs(stream, functools.partial(self.abort, request_id), forget)
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                yield output

    async def _prefix_salt(self, cache_salt: str | None, lora_request: AdapterRequest | None) -> int:
        """The salt a replica's prefix cache keys the request's pages under (Sequence.prefix_salt):
        with an adapter, its name and a digest of its files, read once per name and path off the
        event loop. An adapter whose files cannot be read gets no digest here: its keys match
        nothing, it goes by load, and its replica gives the error."""
        if lora_request is None:
            return salt_key(cache_salt, None, None)
        source = (lora_request.name, lora_request.path)
        digest = self._adapter_digests.get(source)
        if digest is None:
            with contextlib.suppress(OSError, LoRAError):
                digest = await asyncio.to_thread(lambda: digest_of(adapter_dir(lora_request.path)))
                self._adapter_digests[source] = digest
        return salt_key(cache_salt, lora_request.name, digest)

    def _forget(self, request_id: str, replica: int) -> None:
        assert self.router is not None
        with self._lock:
            if self._streams.pop(request_id, None) is not None:
                self.router.replicas[replica].in_flight -= 1

    def abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            with contextlib.suppress(EngineDeadError):
                self._replicas[stream.replica].send(AbortRequest(request_id))

    def abort_all(self) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id)

    async def call(self, function: Callable[[LLMEngine], Any]) -> Any:
        """`function(engine)` on every live replica, in turn of their answers; the first error any
        of them raised, else replica 0's (the first live one's) result."""
        loop = asyncio.get_running_loop()
        futures = []
        for replica in self._replicas:
            if not replica.alive:
                continue
            future: asyncio.Future[Any] = loop.create_future()
            call_id = next(self._call_ids)
            with self._lock:
                self._calls[call_id] = _PendingCall(loop, future, replica.index)
            try:
                replica.send(CallEngine(call_id, function))
            except EngineDeadError:  # lost since the check: the others still answer
                with self._lock:
                    self._calls.pop(call_id, None)
                continue
            futures.append(future)
        if not futures:
            raise EngineDeadError("no data-parallel replica is alive")
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results[0]

    # -- stats ----------------------------------------------------------------------------------

    def engine_stats(self) -> dict[int, EngineStats]:
        """Each live replica's latest snapshot, counting the requests sent to it and not yet
        taken in as waiting."""
        with self._lock:
            return self._live_stats()

    def _live_stats(self) -> dict[int, EngineStats]:
        return {
            replica.index: replace(
                replica.stats,
                waiting_requests=replica.stats.waiting_requests + max(0, replica.adds_sent - replica.adds_taken),
            )
            for replica in self._replicas
            if replica.alive
        }

    def stats(self) -> EngineStats:
        """The live replicas' snapshots added up, and the counters of those lost (so that no
        total counted so far goes down when a replica dies)."""
        with self._lock:  # one reading: a replica lost meanwhile is counted once
            found = list(self._live_stats().values())
            lost = [replica.stats.counters_only() for replica in self._replicas if not replica.alive]
        if not found:
            raise EngineDeadError("no data-parallel replica is alive")
        return summed_stats(found + lost)

    def num_waiting(self) -> int:
        return sum(stats.waiting_requests for stats in self.engine_stats().values())

    def health(self) -> list[ReplicaHealth]:
        return [ReplicaHealth(replica.index, replica.alive, replica.error) for replica in self._replicas]

    # -- the reader threads ---------------------------------------------------------------------

    def _read(self, replica: _Replica) -> None:
        """One replica's messages until its pipe closes; then it is dead (unless stopping)."""
        while True:
            try:
                message: FromReplica = replica.conn.recv()
            except (EOFError, OSError):
                break
            replica.last_heard = time.monotonic()
            if isinstance(message, StepReport):
                self._take_report(replica, message)
            elif isinstance(message, CallDone):
                self._settle(message)
            elif isinstance(message, ReplicaFailed) and not self._stopped:
                # Lost now, not when its pipe closes: its engine's shutdown may take a while (a
                # lost rank of its own), and no request may be routed to it meanwhile.
                self._lose(replica, message.error)
        if not self._stopped and replica.alive:
            replica.process.join(timeout=5.0)
            self._lose(replica, f"its process exited with code {replica.process.exitcode}")

    def _watch(self) -> None:
        """Lose (and kill) each replica that has sent nothing for the heartbeat timeout: a stopped
        or deadlocked process never closes its pipe, and would hold its requests forever."""
        timeout = self.config.replica_heartbeat_timeout_s
        while not self._stopped:
            time.sleep(min(1.0, timeout / 4))
            for replica in self._replicas:
                silent = time.monotonic() - replica.last_heard
                if replica.alive and not self._stopped and silent > timeout:
                    self._lose(
                        replica, f"it reported nothing for {silent:.1f} s (stopped or hung); its process was killed"
                    )
                    replica.process.kill()

    def _take_report(self, replica: _Replica, report: StepReport) -> None:
        assert self.router is not None
        with self._lock:
            replica.stats = report.stats
            replica.adds_taken = report.adds_taken
            self.router.apply(replica.index, report.cache_events)
        if self._cache_events is not None and report.cache_events:
            self._cache_events(replica.index, report.cache_events)
        for request_id, error in report.refused:
            self._deliver(request_id, error)
        for output in report.outputs:
            output.engine_index = replica.index
            self._deliver(output.request_id, output)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody listens
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _settle(self, done: CallDone) -> None:
        with self._lock:
            pending = self._calls.pop(done.call_id, None)
        if pending is not None:
            _settle_future(pending, done.result, done.error)

    def _lose(self, replica: _Replica, reason: str) -> None:
        """A replica died: its requests and calls fail, it leaves the routing."""
        assert self.router is not None
        with self._lock:
            if not replica.alive:
                return
            replica.alive = False
            replica.error = reason
            self.router.mark_dead(replica.index)
            streams = [rid for rid, stream in self._streams.items() if stream.replica == replica.index]
            calls = [cid for cid, call in self._calls.items() if call.replica == replica.index]
            lost_calls = [self._calls.pop(cid) for cid in calls]
        replica.outbox.put(None)  # its writer thread ends
        logger.error("data-parallel replica %d died (%s); the others go on serving", replica.index, reason)
        error = f"data-parallel replica {replica.index} died: {reason}"
        for request_id in streams:
            self._deliver(request_id, EngineDeadError(error))
        for call in lost_calls:
            _settle_future(call, None, EngineDeadError(error))


def _settle_future(call: _PendingCall, result: Any, error: BaseException | None) -> None:
    def settle() -> None:
        if call.future.done():
            return
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(result)

    with contextlib.suppress(RuntimeError):
        call.loop.call_soon_threadsafe(settle)


def _where(placement: placing.Placement) -> str:
    if placement.cores is not None:
        return f"cores {','.join(map(str, placement.cores))}"
    if placement.cuda_devices is not None:
        return f"GPUs {placement.cuda_devices}"
    return "every core"
