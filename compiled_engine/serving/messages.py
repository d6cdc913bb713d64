"""What a client and an engine loop send each other: plain dataclasses, passed as they are to a
loop on a thread of this process, pickled by multiprocessing to a replica process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from compiled_engine.cache.events import CacheEvent
from compiled_engine.engine.adapters import AdapterRequest
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.pooler import PoolingConfig
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine.stats import EngineStats
from compiled_engine.model.config import ModelConfig

if TYPE_CHECKING:
    from compiled_engine.engine.llm_engine import LLMEngine

# -- client -> loop --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
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
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class CallEngine:
    """Run `function(engine)` on the loop, between steps (what only the loop may touch: adapters)."""

    call_id: int
    function: Callable[[LLMEngine], Any]


@dataclass(frozen=True)
class Stop:
    """Finish: the loop returns (a replica then shuts its engine down and exits)."""


Command = AddRequest | AbortRequest | CallEngine | Stop

# -- loop -> client --------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineReady:
    max_model_len: int
    model_config: ModelConfig
    pooling: PoolingConfig | None
    page_size: int
    stats: EngineStats


@dataclass(frozen=True)
class StepReport:
    """After a step, or after taking commands in: the outputs, the requests refused (with the
    engine's error), the engine's snapshot, the cache events, and how many adds it has taken in
    since it started (the client counts the rest as still waiting)."""

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
    """An idle loop is alive (a busy one says so with its step reports)."""


@dataclass(frozen=True)
class EngineFailed:
    """The engine failed to build or its loop died (a replica's process exits after this)."""

    reason: str


Report = StepReport | CallDone | Heartbeat | EngineFailed
