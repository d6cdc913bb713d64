"""The pooler seam: a prompt's hidden states pooled into one embedding (`--runner pooling`,
pooling/).

A `Pooler` is picked once when the engine is built (engine/feature_plan.py). It gives each
sequence of an admitted request its pooling state (`states`), refusing the kind of request the
engine does not serve; says whether the runner returns hidden states rather than logits
(`pools`) and whether a sequence needs every prompt token's (`reads_whole_prompt`: its prompt
then takes no prefix-cache hits); takes a step's hidden-state rows before sampling (`pool`); and
hands over the embeddings of the sequences whose prompt is all in (`results`). Without pooling
the engine runs `NoPooler`, which refuses a pooling request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from compiled_engine.engine.feature_state import PoolingState
from compiled_engine.errors import RequestError

if TYPE_CHECKING:
    import torch

    from compiled_engine.engine.sequence import Sequence


@dataclass(frozen=True)
class PoolingConfig:
    """How a model pools (what a pooling engine tells its clients, as its server truncates and
    renormalizes embeddings)."""

    mode: str = "last"  # one of POOLING_MODES (pooling/)
    normalize: bool = True

    @property
    def needs_every_token(self) -> bool:
        return self.mode != "last"


class Pooler(Protocol):
    @property
    def config(self) -> PoolingConfig | None:
        """How it pools; None: the engine generates text."""
        ...

    @property
    def pools(self) -> bool:
        """A step's rows are every new token's hidden state, to pool, not logits to sample."""
        ...

    def states(self, pooled: bool, n: int) -> list[PoolingState | None]:
        """The pooling state of each of a new request's `n` sequences (`pooled`: a request to
        pool, else to generate); a RequestError if this engine does not serve that kind."""
        ...

    def reads_whole_prompt(self, seq: Sequence) -> bool:
        """Whether pooling `seq` needs every prompt token's hidden state (nothing cached)."""
        ...

    def pool(
        self, batch: list[tuple[Sequence, int]], rows: torch.Tensor
    ) -> tuple[list[tuple[Sequence, int]], torch.Tensor]:
        """After the forward, before `advance`: give each pooled sequence its new tokens' rows;
        the sequences left to sample and their logits."""
        ...

    def results(self, due: list[Sequence]) -> list[tuple[Sequence, list[float]]]:
        """The embedding of each pooled sequence of `due` (its prompt is all in)."""
        ...


class NoPooler:
    """An engine that generates text: a request to pool is refused."""

    config = None
    pools = False

    def states(self, pooled: bool, n: int) -> list[PoolingState | None]:
        if pooled:
            raise RequestError("this engine generates text (runner generate): it makes no embeddings")
        return [None] * n

    def reads_whole_prompt(self, seq: Sequence) -> bool:
        return False

    def pool(
        self, batch: list[tuple[Sequence, int]], rows: torch.Tensor
    ) -> tuple[list[tuple[Sequence, int]], torch.Tensor]:
        return batch, rows

    def results(self, due: list[Sequence]) -> list[tuple[Sequence, list[float]]]:
        return []
