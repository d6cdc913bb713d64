"""What the server holds an engine by: one engine loop in this process (`AsyncEngine`), or a front
end over data-parallel replicas in processes of their own (compiled_engine/replicas/). Both give
the same requests, stats and lifecycle, so the routes never ask which one they talk to.

`ServedModel` is what the server reads of the model once, at start: its tokenizer, context length,
architecture and grammar compiler (a front end builds its own; the replicas compile again, from
their cache, when a request arrives).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from compiled_engine.engine.adapters import AdapterRequest
from compiled_engine.engine.grammars import GrammarSet
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.pooler import PoolingConfig
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.model.config import ModelConfig
from compiled_engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from compiled_engine.engine.async_engine import EngineStats
    from compiled_engine.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class ServedModel:
    tokenizer: Tokenizer | None
    max_model_len: int
    model_config: ModelConfig
    pooling: PoolingConfig | None  # None: a generating engine
    grammars: GrammarSet


@dataclass(frozen=True)
class ReplicaHealth:
    """One engine's state as the server reports it (`/health`, `/metrics`)."""

    index: int
    alive: bool
    error: str | None = None  # why it stopped, once it has


class EngineClient(Protocol):
    """What the server calls. `engine_stats` gives each live engine's latest snapshot by index
    (vLLM's `engine` label); `stats` their sum."""

    @property
    def served(self) -> ServedModel: ...

    @property
    def is_alive(self) -> bool:
        """At least one engine runs and can take requests."""
        ...

    @property
    def accepting(self) -> bool: ...

    @property
    def error(self) -> BaseException | None:
        """Why the whole engine stopped (None while any part of it runs)."""
        ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: AdapterRequest | None = None,
        pooling: bool = False,
    ) -> AsyncIterator[RequestOutput]: ...

    async def call(self, function: Callable[[LLMEngine], Any]) -> Any:
        """`function(engine)` on every engine's loop (a data-parallel front end sends it to each
        replica, so it must be picklable: a module-level function or a partial of one)."""
        ...

    def stats(self) -> EngineStats: ...

    def engine_stats(self) -> dict[int, EngineStats]: ...

    def health(self) -> list[ReplicaHealth]: ...

    def num_waiting(self) -> int: ...

    def stop_accepting(self) -> None: ...

    def abort_all(self) -> None: ...

    def shutdown(self, grace_s: float = 30.0) -> None: ...


@dataclass(frozen=True)
class SummedDraftStats:
    """Speculative counts added over replicas."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_at: list[int]


def summed_stats(snapshots: list[EngineStats]) -> EngineStats:
    """One snapshot for several engines: counts, pages and bytes added; the adapters running or
    waiting anywhere."""
    from compiled_engine.engine.async_engine import EngineStats

    if len(snapshots) == 1:
        return snapshots[0]
    values = {
        field.name: _COMBINED.get(field.name, sum)([getattr(snapshot, field.name) for snapshot in snapshots])
        for field in fields(EngineStats)
    }
    return EngineStats(**values)


def _union(found: list[tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(sorted({name for names in found for name in names}))


def _sum_of_known(found: list[int | None]) -> int | None:
    known = [value for value in found if value is not None]
    return sum(known) if known else None


def _summed_drafts(snapshots: list[Any]) -> SummedDraftStats | None:
    found = [stats for stats in snapshots if stats is not None]
    if not found:
        return None
    width = max(len(stats.accepted_at) for stats in found)
    return SummedDraftStats(
        sum(stats.drafts for stats in found),
        sum(stats.draft_tokens for stats in found),
        sum(stats.accepted_tokens for stats in found),
        [sum(stats.accepted_at[i] for stats in found if i < len(stats.accepted_at)) for i in range(width)],
    )


# How each field of EngineStats adds up over replicas, where not by `sum`.
_COMBINED: dict[str, Callable[[list[Any]], Any]] = {
    "lora_running": _union,
    "lora_waiting": _union,
    "lora_max": _sum_of_known,
    "speculative": _summed_drafts,
    "kv_cache_dtype": lambda found: found[0],  # every replica is built from one config
}
