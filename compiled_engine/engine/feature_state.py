"""What a sequence carries for each optional feature: the adapter it runs with, its grammar's
state and its pooling so far. A leaf, so that `Sequence` can hold them while the seams
(engine/adapters.py, engine/grammars.py, engine/pooler.py) take sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class AdapterKey:
    """The adapter a sequence runs with: its name, and a digest of its files, which is its part
    of the prefix-cache key (its K/V is never shared with the base model, another adapter, or
    this one before its files changed)."""

    name: str
    digest: str


class GrammarState(Protocol):
    """One sequence's position in its grammar."""

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: the tokens allowed next."""
        ...

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the start, the grammar would take now."""
        ...

    def try_advance(self, token: int) -> bool:
        """Consume `token` if the grammar takes it; False (and no change) if not."""
        ...

    def rollback(self, num_tokens: int) -> None: ...

    def masks_along(self, draft: list[int]) -> list[torch.Tensor | None]:
        """The allowed tokens at each of a draft's 1 + k verify rows."""
        ...

    def advance(self, token: int) -> bool:
        """Consume an emitted token; False if the grammar refuses it."""
        ...

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but the end."""
        ...


class PoolingState(Protocol):
    """One pooled sequence's embedding so far."""

    def add(self, rows: torch.Tensor, start: int) -> None:
        """The hidden states of the prompt tokens at positions start, start + 1, ...; a chunk
        that starts at 0 starts over (a preempted sequence recomputes its prompt)."""
        ...

    def result(self) -> list[float]: ...
