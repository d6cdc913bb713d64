"""What a data-parallel front end and its replica processes send each other over their pipe:
plain dataclasses, pickled by multiprocessing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from compiled_engine.cache.events import CacheEvent
from compiled_engine.engine.async_engine import AddRequest, EngineStats
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.pooler import PoolingConfig
from compiled_engine.model.config import ModelConfig

if TYPE_CHECKING:
    from compiled_engine.engine.llm_engine import LLMEngine

# -- front end -> replica (and AddRequest, the same as in this process's engine loop) --------------


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class CallEngine:
    call_id: int
    function: Callable[[LLMEngine], Any]


@dataclass(frozen=True)
class Stop:
    """Finish: the replica shuts its engine down and exits."""


ToReplica = AddRequest | AbortRequest | CallEngine | Stop

# -- replica -> front end ------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaReady:
    max_model_len: int
    model_config: ModelConfig
    pooling: PoolingConfig | None
    page_size: int
    stats: EngineStats


@dataclass(frozen=True)
class StepReport:
    """After a step, or after taking commands in: the outputs, the requests refused (with the
    engine's error), the engine's snapshot, the cache events, and how many adds it has taken in
    since it started (the front end counts the rest as still waiting)."""

    outputs: list[RequestOutput]
    refused: list[tuple[str, BaseException]]
    stats: EngineStats
    cache_events: list[CacheEvent]
    adds_taken: int


@dataclass(frozen=True)
class CallDone:
    call_id: int
    result: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Heartbeat:
    """An idle replica's loop is alive (a busy one says so with its step reports)."""


@dataclass(frozen=True)
class ReplicaFailed:
    """The replica's engine failed to build or its loop died; the process exits after this."""

    error: str


FromReplica = ReplicaReady | StepReport | CallDone | Heartbeat | ReplicaFailed
