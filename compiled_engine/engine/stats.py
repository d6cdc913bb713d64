"""`EngineStats`: one engine's state at one moment, read on the thread that steps it and published
whole; `summed_stats`: one snapshot for several engines (data-parallel replicas)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from compiled_engine.engine.adapters import AdapterStats
from compiled_engine.engine.drafting import DraftStats

if TYPE_CHECKING:
    from compiled_engine.engine.llm_engine import LLMEngine


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
        the scheduler's queue only (the client adds the requests sent and not yet taken in)."""
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
