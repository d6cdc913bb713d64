"""Which adapters the engine knows and which sit in device slots.

`LoRAManager` keeps the adapters loaded from disk by name (at most `max_cpu_loras`, least
recently used dropped first, never one a request still uses) and assigns device slots to the
adapters of each step: an adapter already in a slot stays there; a new one takes a free slot or
the least recently used one. The scheduler admits a sequence only while the running sequences use
at most `max_loras` distinct adapters, so a step's adapters always fit the slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from compiled_engine.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from compiled_engine.lora.layers import LoRASlots
from compiled_engine.model.config import ModelConfig


@dataclass(frozen=True)
class LoRARequest:
    """Run a request with the adapter in directory `path`, known to the engine as `name`."""

    name: str
    path: str


class LoRAManager:
    def __init__(self, slots: LoRASlots, config: ModelConfig, max_cpu_loras: int) -> None:
        self.slots = slots
        self.model_config = config
        self.max_cpu_loras = max_cpu_loras
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.in_use: dict[str, int] = {}  # unfinished sequences per adapter name
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._free = list(range(slots.num_slots))

    def add(self, request: LoRARequest) -> LoRAAdapter:
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

    def release(self, name: str) -> None:
        self.in_use[name] -= 1
        if not self.in_use[name]:
            del self.in_use[name]

    def slots_for(self, names: Iterable[str]) -> dict[str, int]:
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
