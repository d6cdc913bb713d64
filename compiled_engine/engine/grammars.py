"""The grammar seam: constraints on what a sequence may emit (structured outputs, structured/).

A `GrammarSet` is picked once when the engine is built (engine/feature_plan.py). It gives each
constrained sequence a `GrammarState` when its request is admitted (`states`), the masks of a
batch's sample rows before sampling (`masks`), and the verdict on each emitted token (`advance`):
go on, stop (the grammar is complete), or abort (the grammar refused a token its own mask
allowed, which never happens by design). Unconstrained sequences have no state and cost nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from compiled_engine.engine.feature_state import GrammarState
from compiled_engine.engine.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    from compiled_engine.engine.sequence import FinishReason, Sequence


class GrammarSet(Protocol):
    def states(self, spec: StructuredOutputs, n: int) -> list[GrammarState]:
        """A fresh state for each of a request's `n` sequences; a RequestError if `spec` is invalid."""
        ...

    async def prepare(self, spec: StructuredOutputs) -> None:
        """Build (and cache) the grammar of `spec` off the event loop; a RequestError if invalid."""
        ...

    def masks(self, due: list[Sequence]) -> list[torch.Tensor | None] | None:
        """The allowed tokens of each sample row of `due` (1 + its draft tokens each, in order);
        None when no sequence of the batch is constrained."""
        ...

    def advance(self, seq: Sequence, token: int) -> FinishReason | None:
        """After `seq` emitted `token`: None to go on, STOP when its grammar is complete, ABORT
        when its grammar refused the token."""
        ...
