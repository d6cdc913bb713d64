"""An engine as the client holds it: `send` a command, receive its loop's reports (the callback
given to `launch`). Two transports: `ThreadHandle`, the engine on a thread of this process (one
engine: `serve` without data parallelism), and `ProcessHandle` (serving/replica.py), a replica
process. The handle also carries the client's record of its engine (stats, liveness), which the
client changes under its lock.

A thread handle given a function that builds the engine builds it on the loop thread, before its
first step, so every torch operation of the engine runs on that one thread. That matters on CPU:
once the main thread has run PyTorch's OpenMP-parallel kernels, the same kernels called from
another thread ran markedly slower (docs/benchmarks.md has the measurement).
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from compiled_engine.engine.grammars import GrammarSet
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.pooler import PoolingConfig
from compiled_engine.engine.stats import EngineStats
from compiled_engine.errors import EngineDeadError
from compiled_engine.model.config import ModelConfig
from compiled_engine.serving.loop import EngineLoop, ready_report
from compiled_engine.serving.messages import Command, EngineFailed, EngineReady, Report, Stop
from compiled_engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """What the server reads of the model once, at start: its tokenizer, context length,
    architecture and grammar compiler (for replicas the client builds its own; they compile
    again, from their cache, when a request arrives)."""

    tokenizer: Tokenizer | None
    max_model_len: int
    model_config: ModelConfig
    pooling: PoolingConfig | None  # None: a generating engine
    grammars: GrammarSet


class EngineHandle(abc.ABC):
    engine: LLMEngine | None = None  # the engine, where it runs in this process

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name  # as errors and logs call it
        # The client's record, under its lock:
        self.stats: EngineStats | None = None  # the loop's latest snapshot
        self.alive = False  # ready and not lost
        self.reason: str | None = None  # why it was lost
        self.adds_sent = 0
        self.adds_taken = 0
        self.last_heard = 0.0  # when its last report came (time.monotonic)

    @abc.abstractmethod
    def launch(self, on_report: Callable[[Report], None]) -> None:
        """Start the engine; its loop's reports go to `on_report`, on a thread of the handle's."""

    @abc.abstractmethod
    def wait_ready(self) -> EngineReady:
        """Once the engine is built; raises why it could not start."""

    @abc.abstractmethod
    def served(self) -> ServedModel: ...

    @abc.abstractmethod
    def send(self, command: Command) -> None:
        """Queue `command` for the loop, in order; never waits for the loop."""

    @property
    @abc.abstractmethod
    def watch_every_s(self) -> float | None:
        """How often the watchdog should `check` the engine (None: there is nothing to check)."""

    @abc.abstractmethod
    def check(self, silent_s: float) -> str | None:
        """Why the engine must be given up, its loop silent for `silent_s` (None: it is fine)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """End a lost engine without waiting for it."""

    def stop(self) -> None:
        """Ask the loop to end (`close` waits for it)."""
        self.send(Stop())

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the loop and wait for it to end (end it, if it will not)."""


class ThreadHandle(EngineHandle):
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        """`engine`: an engine (its owner shuts it down), or a function that builds one on the
        loop thread (the loop shuts it down when it ends)."""
        super().__init__(0, "the engine loop")
        self._build: Callable[[], LLMEngine] | None = None
        if isinstance(engine, LLMEngine):
            self.engine = engine
        else:
            self._build = engine
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._built = threading.Event()
        self._ready: EngineReady | BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def launch(self, on_report: Callable[[Report], None]) -> None:
        self._on_report = on_report
        self._thread.start()

    def wait_ready(self) -> EngineReady:
        self._built.wait()
        if not isinstance(self._ready, EngineReady):
            self._thread.join()
            raise self._ready or EngineDeadError("the engine loop ended before it was ready")
        return self._ready

    def served(self) -> ServedModel:
        engine = self.engine
        assert engine is not None
        return ServedModel(
            engine.tokenizer, engine.max_model_len, engine.runner.model_config, engine.pooling, engine.grammars
        )

    def send(self, command: Command) -> None:
        self._inbox.put(command)

    @property
    def watch_every_s(self) -> float | None:
        return 1.0 if self.engine is not None and self.engine.ranks is not None else None

    def check(self, silent_s: float) -> str | None:
        """A lost tensor-parallel rank, checked even while the loop idles (its step would find it
        only when a request comes)."""
        ranks = None if self.engine is None else self.engine.ranks
        try:
            if ranks is not None:
                ranks.check_alive()
        except EngineDeadError as exc:
            return str(exc)
        return None

    def kill(self) -> None:
        self.stop()  # a thread cannot be killed: its loop ends at its next step

    def close(self) -> None:
        self.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    def _receive(self, wait_s: float) -> Command | None:
        try:
            return self._inbox.get(timeout=wait_s) if wait_s else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        try:
            engine = self.engine
            if engine is None:
                assert self._build is not None
                engine = self.engine = self._build()
            self._ready = ready_report(engine)
        except BaseException as exc:
            self._ready = exc
            return
        finally:
            self._built.set()
        try:
            EngineLoop(engine, self._receive, self._on_report).run()
        except BaseException as exc:
            logger.exception("the engine loop died")
            self._on_report(EngineFailed(repr(exc)))
        finally:
            if self._build is not None:
                engine.shutdown()
