"""The drafter seam: what proposes the tokens a step verifies (speculative decoding).

The engine calls a `Drafter` at two points of every step: `propose` before scheduling gives each
running sequence its draft (`Sequence.draft_token_ids`: tokens, or places a draft model fills
later), so the scheduler sizes the step and its pages with them; `fill` after scheduling
completes the drafts of the sequences that were scheduled and returns the distributions they
were drawn from, which the verifier (engine/verifier.py) needs for rejection sampling. After a
verify, `record` counts how the draft fared. Which drafter runs is picked once, when the engine
is built (engine/feature_plan.py); without speculation it is `NoDrafter`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from compiled_engine.engine.sequence import Sequence

if TYPE_CHECKING:
    from compiled_engine.executor.runner import Runner


class DraftStats(Protocol):
    """How the drafts fared since the engine started (a drafter's counts; speculative/drafts.py)."""

    drafts: int  # sequence-steps that verified a draft
    draft_tokens: int
    accepted_tokens: int
    accepted_at: list[int]  # [i]: drafts whose token i stood


DraftProbs = dict[int, torch.Tensor]  # seq id -> the distributions [k, vocab] its k draft tokens were drawn from


class Drafter(Protocol):
    @property
    def stats(self) -> DraftStats | None:
        """Its counts since the engine started; None: it never drafts."""
        ...

    @property
    def runners(self) -> list[Runner]:
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

    def snapshot(self) -> DraftStats | None:
        """A copy of the counts for metrics; None when the engine does not speculate."""
        ...


class NoDrafter:
    """No speculation: no sequence ever gets a draft."""

    @property
    def stats(self) -> DraftStats | None:
        return None

    @property
    def runners(self) -> list[Runner]:
        return []

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        pass

    def fill(self, scheduled: list[Sequence], running: list[Sequence]) -> DraftProbs:
        return {}

    def record(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        pass

    def snapshot(self) -> DraftStats | None:
        return None
