"""The pooler seam: a prompt's hidden states pooled into one embedding (`--runner pooling`,
pooling/). Picked once when the engine is built (engine/feature_plan.py): it gives each sequence
of a request its pooling state, refusing the kind of request the engine does not serve; takes a
step's hidden states before sampling; and hands over the embeddings of the sequences whose
prompt is all in. Without pooling the engine runs `NoPooler`, which refuses a pooling request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from compiled_engine.engine.feature_state import PoolingState
from compiled_engine.engine.step_inputs import ScheduledBatch
from compiled_engine.errors import RequestError
from compiled_engine.executor.step import Wants

if TYPE_CHECKING:
    import torch

    from compiled_engine.engine.sequence import Sequence


@dataclass(frozen=True)
class PoolingConfig:
    """How a model pools (its clients read it too: the server renormalizes truncated embeddings)."""

    mode: str = "last"  # one of POOLING_MODES (pooling/)
    normalize: bool = True

    @property
    def needs_every_token(self) -> bool:
        return self.mode != "last"


class Pooler(Protocol):
    @property
    def config(self) -> PoolingConfig | None: ...  # None: the engine generates text

    @property
    def wants(self) -> Wants: ...  # what the runner returns: logits, or every new token's hidden state

    def states(self, pooled: bool, n: int) -> list[PoolingState | None]:
        """Each of a new request's `n` sequences' state (`pooled`: a request to pool, else to
        generate); a RequestError if the engine does not serve that kind."""
        ...

    def reads_whole_prompt(self, seq: Sequence) -> bool:
        """Pooling `seq` needs every prompt token's hidden state: its prompt takes no cache hits."""
        ...

    def pool(self, batch: ScheduledBatch, rows: torch.Tensor) -> tuple[ScheduledBatch, torch.Tensor]:
        """After the forward, before `advance`: each pooled sequence takes its new tokens' rows;
        the sequences left to sample, and their logits."""
        ...

    def results(self, due: list[Sequence]) -> list[tuple[Sequence, list[float]]]:
        """The embedding of each pooled sequence of `due` (its prompt is all in)."""
        ...


class NoPooler:
    """An engine that generates text: a request to pool is refused."""

    config = None
    wants = Wants.LOGITS

    def states(self, pooled: bool, n: int) -> list[PoolingState | None]:
        if pooled:
            raise RequestError("this engine generates text (runner generate): it makes no embeddings")
        return [None] * n

    def reads_whole_prompt(self, seq: Sequence) -> bool:
        return False

    def pool(self, batch: ScheduledBatch, rows: torch.Tensor) -> tuple[ScheduledBatch, torch.Tensor]:
        return batch, rows

    def results(self, due: list[Sequence]) -> list[tuple[Sequence, list[float]]]:
        return []
