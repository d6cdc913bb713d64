"""Which adapters the engine knows and which sit in device slots: the engine's adapter set
(engine/adapters.py) for LoRA.

`LoRAManager` keeps the adapters loaded from disk by name (at most `max_cpu_loras`, least
recently used dropped first, never one a request still uses) and assigns device slots to the
adapters of each step: an adapter already in a slot stays there; a new one takes a free slot or
the least recently used one. The scheduler admits a sequence only while the running sequences use
at most `max_loras` distinct adapters, so a step's adapters always fit the slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from pathlib import Path

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.engine.adapters import AdapterRequest, AdapterSet, AdapterStats
from compiled_engine.engine.feature_state import AdapterKey
from compiled_engine.engine.sequence import Sequence
from compiled_engine.executor.prepare import AdapterSlots
from compiled_engine.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from compiled_engine.lora.layers import LoRASlots, install_lora
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.layers import DecoderModel


@dataclass(frozen=True)
class LoRARequest:
    """Run a request with the adapter in directory `path`, known to the engine as `name`."""

    name: str
    path: str


def per_prompt(
    request: LoRARequest | Sequence_[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """The adapter of each of `num_prompts` prompts: one for all (None: the base model), or one each."""
    requests = [request] * num_prompts if request is None or isinstance(request, LoRARequest) else list(request)
    if len(requests) != num_prompts:
        raise ValueError(f"{len(requests)} lora requests for {num_prompts} prompts")
    return requests


class LoRAManager:
    def __init__(self, slots: LoRASlots, config: ModelConfig, max_cpu_loras: int) -> None:
        self.slots = slots
        self.model_config = config
        self.max_cpu_loras = max_cpu_loras
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.in_use: dict[str, int] = {}  # unfinished sequences per adapter name
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._free = list(range(slots.num_slots))

    # -- the engine's adapter set ----------------------------------------------------------------

    def admit(self, request: AdapterRequest | None) -> AdapterKey | None:
        if request is None:
            return None
        adapter = self.add(request)
        self.acquire(request.name)
        return AdapterKey(request.name, adapter.digest)

    def release(self, key: AdapterKey | None) -> None:
        if key is None:
            return
        self.in_use[key.name] -= 1
        if not self.in_use[key.name]:
            del self.in_use[key.name]

    def must_wait(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Its adapter is not among the running ones, and those already fill every slot."""
        if seq.adapter is None:
            return False
        names = {s.adapter.name for s in running if s.adapter is not None}
        return seq.adapter.name not in names and len(names) >= self.slots.num_slots

    def slots_for(self, seqs: Iterable[Sequence]) -> list[int] | None:
        seqs = list(seqs)
        slot_of = self.slots_of(s.adapter.name for s in seqs if s.adapter is not None)
        return [-1 if s.adapter is None else slot_of[s.adapter.name] for s in seqs]

    def stats(self, running: list[Sequence], waiting: Iterable[Sequence]) -> AdapterStats | None:
        return AdapterStats(
            len(self.adapters), self.num_resident, self.slots.num_slots, _names(running), _names(waiting)
        )

    # -- loading and slots ----------------------------------------------------------------------

    def add(self, request: AdapterRequest) -> LoRAAdapter:
        """The adapter `request` names, loaded now if the engine does not hold it. The same name
        with another path is refused while requests use it, and replaced otherwise. A failure
        leaves every adapter already loaded as it was."""
        known = self.adapters.get(request.name)
        if known is not None and known.path == Path(request.path):
            self.adapters.move_to_end(request.name)
            return known
        if known is not None and self.in_use.get(request.name):
            raise LoRAError(f"adapter {request.name!r} is in use from {known.path}; it cannot load from {request.path}")
        idle = [name for name in self.adapters if not self.in_use.get(name) and name != request.name]
        if known is None and len(self.adapters) >= self.max_cpu_loras and not idle:
            raise LoRAError(f"all {self.max_cpu_loras} loaded adapters are in use (--max-cpu-loras)")
        adapter = load_adapter(request.path, self.model_config, self.slots.max_rank)
        if known is None and len(self.adapters) >= self.max_cpu_loras:
            self.remove(idle[0])
        self.remove(request.name)
        self.adapters[request.name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        """Forget an adapter (and empty its slot); refused while requests use it."""
        if self.in_use.get(name):
            raise LoRAError(f"adapter {name!r} is in use by {self.in_use[name]} running sequences")
        self.adapters.pop(name, None)
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self.slots.clear(slot)
            self._free.append(slot)

    @property
    def num_resident(self) -> int:
        """Adapters in device slots."""
        return len(self._slot_of)

    def acquire(self, name: str) -> None:
        self.in_use[name] = self.in_use.get(name, 0) + 1

    def slots_of(self, names: Iterable[str]) -> dict[str, int]:
        """A slot for each adapter of a step (at most num_slots distinct ones)."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.slots.num_slots:
            raise LoRAError(f"{len(wanted)} adapters in one step, but only {self.slots.num_slots} slots")
        for name in wanted:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
                continue
            if self._free:
                slot = self._free.pop()
            else:
                evict = next(n for n in self._slot_of if n not in wanted)
                slot = self._slot_of.pop(evict)
            self.slots.load(slot, self.adapters[name])
            self._slot_of[name] = slot
        return {name: self._slot_of[name] for name in wanted}


def _names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    return tuple(sorted({s.adapter.name for s in seqs if s.adapter is not None}))


class LoRAPlan:
    """What the engine builds for `enable_lora`: LoRA products with `max_loras` slots of rank up to
    `max_lora_rank` in every layer, then the manager over those slots."""

    def __init__(self, config: EngineConfig) -> None:
        """Refuses, before any work, options LoRA cannot run with."""
        if config.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters with tensor parallelism are not supported yet")
        if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
            raise ValueError(f"max_cpu_loras ({config.max_cpu_loras}) must be at least max_loras ({config.max_loras})")
        self.config = config

    def install(
        self, model: DecoderModel, model_config: ModelConfig, max_tokens: int, dtype: torch.dtype
    ) -> AdapterSlots:
        return install_lora(model, model_config, self.config.max_loras, self.config.max_lora_rank, max_tokens, dtype)

    def start(self, slots: AdapterSlots, model_config: ModelConfig) -> AdapterSet:
        assert isinstance(slots, LoRASlots)
        return LoRAManager(slots, model_config, self.config.max_cpu_loras or self.config.max_loras)
