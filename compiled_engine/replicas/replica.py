"""A data-parallel replica: one engine in a process of its own, driven by the front end over a
pipe (replicas/messages.py).

The process pins itself to its cores or GPUs, builds its engine (loading, compiling and warming up
on its main thread, as the single-engine server does on its loop thread), says it is ready, then
loops: take in the front end's commands, run a step when any request is unfinished, and report
the step's outputs, its snapshot and its cache events. When idle it waits on the pipe, and says
it is alive every HEARTBEAT_S (the front end loses a replica that stays silent). A pipe
that closes (the front end died) ends it, as does `Stop`; an engine that fails reports why
before the process exits, so the front end can fail that replica's requests at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from compiled_engine.config import EngineConfig
from compiled_engine.engine.async_engine import EngineStats
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.logs import configure_logging
from compiled_engine.lora.manager import LoRAManager, LoRARequest
from compiled_engine.replicas import placement as placing
from compiled_engine.replicas.messages import (
    AbortRequest,
    AddRequest,
    CallDone,
    CallEngine,
    Heartbeat,
    ReplicaFailed,
    ReplicaReady,
    StepReport,
    Stop,
    ToReplica,
)

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
HEARTBEAT_S = 1.0  # an idle loop's "still here", at most this far apart


def build_engine(config: EngineConfig, lora_modules: dict[str, str], record_cache_events: bool = False) -> LLMEngine:
    """An engine with the adapters of `--lora-modules` loaded (each checked now: a bad adapter
    stops the start)."""
    engine = LLMEngine(config, record_cache_events)
    for lora_name, path in lora_modules.items():
        assert isinstance(engine.adapters, LoRAManager)
        engine.adapters.add(LoRARequest(lora_name, path))
    return engine


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica process is started with (picklable: the spawn start method sends it)."""

    index: int
    config: EngineConfig
    lora_modules: dict[str, str]
    placement: placing.Placement
    log_format: str = "text"  # the server's --log-format


def run_replica(spec: ReplicaSpec, conn: Connection) -> None:
    """The replica process's entry point."""
    configure_logging(spec.log_format, engine=str(spec.index))
    placing.apply(spec.placement)
    config = spec.config
    threads = placing.threads_for(spec.placement, config.tensor_parallel_size)
    if config.cpu_threads is None and threads is not None and config.resolved_device().type == "cpu":
        config = msgspec.structs.replace(config, cpu_threads=threads)
    try:
        engine = build_engine(config, spec.lora_modules, record_cache_events=True)
    except BaseException as exc:
        logger.exception("the engine failed to start")
        _send_quietly(conn, ReplicaFailed(f"replica {spec.index} failed to start: {exc!r}"))
        raise SystemExit(1) from None
    conn.send(
        ReplicaReady(
            engine.max_model_len,
            engine.runner.model_config,
            engine.pooling,
            engine.runner.page_size,
            EngineStats.read(engine),
        )
    )
    try:
        _ReplicaLoop(engine, conn).run()
    except BaseException as exc:
        logger.exception("the engine loop died")
        _send_quietly(conn, ReplicaFailed(f"replica {spec.index}'s engine loop died: {exc!r}"))
        raise SystemExit(1) from None
    finally:
        engine.shutdown()
    os._exit(0)  # the engine's threads and the pipe's need no orderly end: nothing is left to say


def _send_quietly(conn: Connection, message: ReplicaFailed) -> None:
    with contextlib.suppress(OSError):  # the front end is gone too
        conn.send(message)


class _ReplicaLoop:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.adds_taken = 0  # since the start: the front end counts the adds it sent beyond these as waiting
        self.stopping = False
        self.last_sent = time.monotonic()

    def send(self, message: StepReport | CallDone | Heartbeat) -> None:
        self.conn.send(message)
        self.last_sent = time.monotonic()

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            refused: list[tuple[str, BaseException]] = []
            received = False
            while self.conn.poll(0 if busy or received else IDLE_WAIT_S):
                received = True
                try:
                    command = self.conn.recv()
                except EOFError:  # the front end is gone
                    return
                self._take(command, refused)
                if self.stopping:
                    return
            ran = self.engine.has_unfinished_requests()
            outputs = self.engine.step() if ran else []
            events = self.engine.take_cache_events()
            if ran or received or events:
                self.send(StepReport(outputs, refused, EngineStats.read(self.engine), events, self.adds_taken))
            elif time.monotonic() - self.last_sent >= HEARTBEAT_S:
                self.send(Heartbeat())

    def _take(self, command: ToReplica, refused: list[tuple[str, BaseException]]) -> None:
        if isinstance(command, AddRequest):
            self.adds_taken += 1
            try:
                command.add_to(self.engine)
            except Exception as exc:  # an invalid request: its caller gets the error
                refused.append((command.request_id, exc))
        elif isinstance(command, AbortRequest):
            self.engine.abort_request(command.request_id)
        elif isinstance(command, CallEngine):
            try:
                done = CallDone(command.call_id, command.function(self.engine))
            except Exception as exc:
                done = CallDone(command.call_id, error=exc)
            self.send(done)
        elif isinstance(command, Stop):
            self.stopping = True
