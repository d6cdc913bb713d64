"""The engine loop: the one thread that touches an engine, on a thread of the server's process
(serving/handle.py) or as a replica process's main thread (serving/replica.py).

It takes the client's commands in, runs a step while any request is unfinished, and reports the
step's outputs, the engine's snapshot (`EngineStats`) and the prefix cache's events. The snapshot
is read on this thread after every step and reported with the step's outputs, so a caller that
has seen its request finish sees it finished in the stats too; reading the scheduler from another
thread could meet it mid-change ("deque mutated during iteration"). When idle the loop waits for
commands and says it is alive every HEARTBEAT_S (a client loses a replica that stays silent).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.stats import EngineStats
from compiled_engine.lora.manager import LoRAManager, LoRARequest
from compiled_engine.serving.messages import (
    AbortRequest,
    AddRequest,
    CallDone,
    CallEngine,
    Command,
    EngineReady,
    Heartbeat,
    Report,
    StepReport,
    Stop,
)

IDLE_WAIT_S = 0.5
HEARTBEAT_S = 1.0  # an idle loop's "still here", at most this far apart

# The next command, waiting up to the given seconds (None: none came); EOFError: the client is gone.
Receive = Callable[[float], Command | None]


def build_engine(config: EngineConfig, lora_modules: dict[str, str], record_cache_events: bool = False) -> LLMEngine:
    """An engine with the adapters of `--lora-modules` loaded (each checked now: a bad adapter
    stops the start)."""
    engine = LLMEngine(config, record_cache_events)
    for lora_name, path in lora_modules.items():
        assert isinstance(engine.adapters, LoRAManager)
        engine.adapters.add(LoRARequest(lora_name, path))
    return engine


def ready_report(engine: LLMEngine) -> EngineReady:
    return EngineReady(
        engine.max_model_len,
        engine.runner.model_config,
        engine.pooling,
        engine.runner.page_size,
        EngineStats.read(engine),
    )


class EngineLoop:
    def __init__(self, engine: LLMEngine, receive: Receive, send: Callable[[Report], None]) -> None:
        self.engine = engine
        self.receive = receive
        self._send = send
        self.adds_taken = 0  # since the start: the client counts the adds it sent beyond these as waiting
        self.last_sent = time.monotonic()

    def send(self, report: Report) -> None:
        self._send(report)
        self.last_sent = time.monotonic()

    def run(self) -> None:
        """Until `Stop`, or until the client is gone."""
        engine = self.engine
        while True:
            try:
                commands = self._take_in(0.0 if engine.has_unfinished_requests() else IDLE_WAIT_S)
            except EOFError:
                return
            # A request aborted before the loop took it in (its caller left) is never added.
            aborted = {command.request_id for command in commands if isinstance(command, AbortRequest)}
            refused: list[tuple[str, BaseException]] = []
            for command in commands:
                if isinstance(command, Stop):
                    return
                if isinstance(command, AddRequest):
                    self.adds_taken += 1
                    try:
                        if command.request_id not in aborted:
                            command.add_to(engine)
                    except Exception as exc:  # an invalid request: its caller gets the error
                        refused.append((command.request_id, exc))
                elif isinstance(command, AbortRequest):
                    engine.abort_request(command.request_id)
                else:
                    self._call(command)
            ran = engine.has_unfinished_requests()
            outputs = engine.step() if ran else []
            events = engine.take_cache_events()
            if ran or commands or events:
                self.send(StepReport(outputs, refused, EngineStats.read(engine), events, self.adds_taken))
            elif time.monotonic() - self.last_sent >= HEARTBEAT_S:
                self.send(Heartbeat())

    def _take_in(self, wait_s: float) -> list[Command]:
        """The commands waiting, after waiting up to `wait_s` for the first."""
        commands: list[Command] = []
        while (command := self.receive(0.0 if commands else wait_s)) is not None:
            commands.append(command)
        return commands

    def _call(self, command: CallEngine) -> None:
        try:
            done = CallDone(command.call_id, command.function(self.engine))
        except Exception as exc:  # handed to the caller, the loop goes on
            done = CallDone(command.call_id, error=exc)
        # What the call changed (adapters, a cache reset) is in the stats before its caller resumes.
        events = self.engine.take_cache_events()
        self.send(StepReport([], [], EngineStats.read(self.engine), events, self.adds_taken))
        self.send(done)
