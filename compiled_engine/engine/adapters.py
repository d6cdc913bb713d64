"""The adapter seam: weights a request may run with on top of the base model (LoRA, lora/).

Two parts, picked once when the engine is built (engine/feature_plan.py):
- an `AdapterInstall` (executor/prepare.py) puts per-token adapter products into the model before
  it is compiled and returns the `AdapterSlots` the runner sets before each forward (which slot
  each token uses);
- an `AdapterSet` then serves requests: `admit` loads and holds a request's adapter and gives its
  typed part of the prefix-cache key, `must_wait` keeps a sequence out while the step's slots
  are full of other adapters, `slots_for` assigns the slots of a batch, `release` lets go.
Without adapters the engine runs `NoAdapters`, which refuses a request that names one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from compiled_engine.engine.feature_state import AdapterKey
from compiled_engine.errors import RequestError

if TYPE_CHECKING:
    from compiled_engine.engine.sequence import Sequence


class AdapterRequest(Protocol):
    """What a request names: the adapter known as `name`, from the files at `path`."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> str: ...


@dataclass(frozen=True)
class AdapterStats:
    loaded: int  # adapters held in memory
    resident: int  # adapters in device slots
    max_slots: int  # the device slots (--max-loras)
    running: tuple[str, ...]  # adapters of running sequences
    waiting: tuple[str, ...]  # adapters of waiting ones


class AdapterSet(Protocol):
    def admit(self, request: AdapterRequest | None) -> AdapterKey | None:
        """Load the adapter `request` names if new, and hold it until `release`; None: the base
        model. A RequestError says why it cannot run."""
        ...

    def release(self, key: AdapterKey | None) -> None: ...

    def must_wait(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether `seq` cannot join `running` yet (its adapter would need a slot none has free)."""
        ...

    def slots_for(self, seqs: Iterable[Sequence]) -> list[int] | None:
        """Each sequence's device slot for one forward (-1: the base model); None: no adapters."""
        ...

    def stats(self, running: list[Sequence], waiting: Iterable[Sequence]) -> AdapterStats | None: ...


class NoAdapters:
    """An engine started without adapters: a request that names one is refused."""

    def admit(self, request: AdapterRequest | None) -> AdapterKey | None:
        if request is not None:
            raise RequestError(
                "this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)", param="lora_request"
            )
        return None

    def release(self, key: AdapterKey | None) -> None:
        pass

    def must_wait(self, seq: Sequence, running: list[Sequence]) -> bool:
        return False

    def slots_for(self, seqs: Iterable[Sequence]) -> list[int] | None:
        return None

    def stats(self, running: list[Sequence], waiting: Iterable[Sequence]) -> AdapterStats | None:
        return None
