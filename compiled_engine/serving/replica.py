"""A data-parallel replica: one engine in a process of its own, on its own share of the cores or its
own GPUs (serving/placement.py), driven over a pipe (`ProcessHandle`).

The process pins itself to its cores or GPUs, builds its engine (loading, compiling and warming up
on its main thread, as the single-engine server does on its loop thread), says it is ready, then
runs the engine loop (serving/loop.py) on the pipe. A pipe that closes (the client died) ends it,
as does `Stop`; an engine that fails reports why before the process exits, so the client can fail
that replica's requests at once.

On the client's side, what goes to a replica is queued for a writer thread of its own: a replica
reads its pipe only between steps, and the server's event loop must never wait for that. Its
reports are read by a reader thread; a pipe that closes is a process that exited.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec

from compiled_engine.config import EngineConfig
from compiled_engine.engine.feature_plan import plan_features
from compiled_engine.errors import EngineDeadError
from compiled_engine.logs import configure_logging
from compiled_engine.serving import placement as placing
from compiled_engine.serving.handle import EngineHandle, ServedModel
from compiled_engine.serving.loop import EngineLoop, build_engine, ready_report
from compiled_engine.serving.messages import Command, EngineFailed, EngineReady, Report
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.weights.source import resolve_model_dir

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica process is started with (picklable: the spawn start method sends it)."""

    index: int
    config: EngineConfig
    lora_modules: dict[str, str]
    placement: placing.Placement
    log_format: str = "text"  # the server's --log-format


def replica_handles(
    config: EngineConfig, lora_modules: dict[str, str] | None = None, log_format: str = "text"
) -> list[ProcessHandle]:
    """`config.data_parallel_size` replicas of `config`'s engine, each on its share of the machine."""
    config_ = msgspec.structs.replace(config, data_parallel_size=1)
    where = placing.placements(config.data_parallel_size, config.tensor_parallel_size, config.resolved_device().type)
    return [
        ProcessHandle(ReplicaSpec(index, config_, dict(lora_modules or {}), placement, log_format))
        for index, placement in enumerate(where)
    ]


class ProcessHandle(EngineHandle):
    def __init__(self, spec: ReplicaSpec) -> None:
        super().__init__(spec.index, f"data-parallel replica {spec.index}")
        self.spec = spec
        self.config = spec.config
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._closed = False

    def launch(self, on_report: Callable[[Report], None]) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=run_replica, args=(self.spec, theirs), name=f"dp-replica-{self.index}")
        self.process.start()
        theirs.close()
        self._on_report = on_report
        atexit.register(self.close)
        logger.info("%s started (pid %s, %s)", self.name, self.process.pid, _where(self.spec.placement))

    def wait_ready(self) -> EngineReady:
        deadline = time.monotonic() + START_TIMEOUT_S
        exited = f"{self.name} exited while starting (code {{}})"
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise EngineDeadError(exited.format(self.process.exitcode))
            if time.monotonic() > deadline:
                raise EngineDeadError(f"{self.name} was not ready in {START_TIMEOUT_S:.0f} s")
        try:
            message: EngineReady | EngineFailed = self.conn.recv()
        except EOFError:
            self.process.join()
            raise EngineDeadError(exited.format(self.process.exitcode)) from None
        if isinstance(message, EngineFailed):
            raise EngineDeadError(message.reason)
        logger.info("%s ready", self.name)
        self._ready = message
        threading.Thread(target=self._read, name=f"dp-replica-{self.index}-reader", daemon=True).start()
        threading.Thread(target=self._write, name=f"dp-replica-{self.index}-writer", daemon=True).start()
        return message

    def served(self) -> ServedModel:
        """The client's own tokenizer and grammar compiler; the rest from the replica."""
        ready = self._ready
        model_dir = resolve_model_dir(self.config.model)
        tokenizer_file = model_dir / "tokenizer.json"
        tokenizer = Tokenizer(model_dir) if tokenizer_file.is_file() else None
        eos = tokenizer.eos_token_ids if tokenizer else frozenset(ready.model_config.eos_token_ids)
        grammars = plan_features(self.config, Path(model_dir)).grammars(
            tokenizer_file if tokenizer else None, ready.model_config.vocab_size, eos
        )
        return ServedModel(tokenizer, ready.max_model_len, ready.model_config, ready.pooling, grammars)

    def send(self, command: Command) -> None:
        """Queued for the writer thread: a pipe write waits while the replica is inside a step
        (it reads between steps), which must not stall the event loop."""
        self._outbox.put(command)

    @property
    def watch_every_s(self) -> float:
        return min(1.0, self.config.replica_heartbeat_timeout_s / 4)

    def check(self, silent_s: float) -> str | None:
        """A stopped or deadlocked process never closes its pipe, and would hold its requests
        forever: one that has sent nothing (no step report, no idle heartbeat) for the timeout
        is given up."""
        if silent_s > self.config.replica_heartbeat_timeout_s:
            return f"it reported nothing for {silent_s:.1f} s (stopped or hung); its process was killed"
        return None

    def kill(self) -> None:
        self.process.kill()
        self._outbox.put(None)  # its writer thread ends

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        self.process.join(timeout=10.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._outbox.put(None)
        self.conn.close()

    def _write(self) -> None:
        """The queued commands into the pipe until None, or until the pipe breaks (the reader then
        sees it close)."""
        while (command := self._outbox.get()) is not None:
            try:
                self.conn.send(command)
            except (OSError, ValueError):  # a broken or closed pipe
                return

    def _read(self) -> None:
        """The replica's reports until its pipe closes; then its process has exited."""
        while True:
            try:
                report: Report = self.conn.recv()
            except (EOFError, OSError):
                break
            self._on_report(report)
        if not self._closed and self.alive:  # (a lost one's killer reaps it)
            self.process.join(timeout=5.0)
            self._on_report(EngineFailed(f"its process exited with code {self.process.exitcode}"))


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
        _send_quietly(conn, EngineFailed(f"replica {spec.index} failed to start: {exc!r}"))
        raise SystemExit(1) from None
    conn.send(ready_report(engine))

    def receive(wait_s: float) -> Command | None:
        return conn.recv() if conn.poll(wait_s) else None

    try:
        EngineLoop(engine, receive, conn.send).run()
    except BaseException as exc:
        logger.exception("the engine loop died")
        _send_quietly(conn, EngineFailed(f"replica {spec.index}'s engine loop died: {exc!r}"))
        raise SystemExit(1) from None
    finally:
        engine.shutdown()
    os._exit(0)  # the engine's threads and the pipe's need no orderly end: nothing is left to say


def _send_quietly(conn: Connection, message: EngineFailed) -> None:
    with contextlib.suppress(OSError):  # the client is gone too
        conn.send(message)


def _where(placement: placing.Placement) -> str:
    if placement.cores is not None:
        return f"cores {','.join(map(str, placement.cores))}"
    if placement.cuda_devices is not None:
        return f"GPUs {placement.cuda_devices}"
    return "every core"
