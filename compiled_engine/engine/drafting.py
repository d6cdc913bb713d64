"""The drafter seam: what proposes the tokens a step verifies (speculative decoding).

The engine calls a `Drafter` at two points of every step: `propose` before scheduling gives each
running sequence its draft (`Sequence.draft_token_ids`: tokens, or places a draft model fills
later), so the scheduler sizes the step and its pages with them; `fill` after scheduling
completes the drafts of the sequences that were scheduled and returns the distributions they
were drawn from, which the verifier (engine/verifier.py) needs for rejection sampling. After a
verify, `record` counts how the draft fared. Which drafter runs is picked once, when the engine
is built (engine/features.py); without speculation it is `NoDrafter`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from compiled_engine.engine.sequence import Sequence

if TYPE_CHECKING:
    from compiled_engine.engine.model_runner import ModelRunner


@dataclass
class SpeculativeStats:
    """Counts since the engine started."""

    drafts: int = 0  # sequence-steps that verified a draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [i]: drafts whose token i stood

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        self.accepted_at.extend([0] * (num_draft - len(self.accepted_at)))  # nothing when long enough
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    def copy(self) -> SpeculativeStats:
        return SpeculativeStats(self.drafts, self.draft_tokens, self.accepted_tokens, list(self.accepted_at))


DraftProbs = dict[int, torch.Tensor]  # seq id -> the distributions [k, vocab] its k draft tokens were drawn from


class Drafter(Protocol):
    stats: SpeculativeStats

    @property
    def runners(self) -> list[ModelRunner]:
        """The model runners it holds beside the engine's (their weights and pages count too)."""
        ...

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Before scheduling: set each running sequence's `draft_token_ids` for this step."""
        ...

    def fill(self, scheduled: list[Sequence], running: list[Sequence]) -> DraftProbs:
        """After scheduling: complete the drafts of `scheduled`; the distributions of the drafts
        that were sampled from one (none for drafts that need no probabilities)."""
        ...

    def record(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        """After a verify of `seq`'s `num_draft` tokens, of which `num_accepted` stood."""
        ...

    def snapshot(self) -> SpeculativeStats | None:
        """A copy of the counts for metrics; None when the engine does not speculate."""
        ...


class NoDrafter:
    """No speculation: no sequence ever gets a draft."""

    def __init__(self) -> None:
        self.stats = SpeculativeStats()

    @property
    def runners(self) -> list[ModelRunner]:
        return []

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        pass

    def fill(self, scheduled: list[Sequence], running: list[Sequence]) -> DraftProbs:
        return {}

    def record(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        pass

    def snapshot(self) -> SpeculativeStats | None:
        return None
