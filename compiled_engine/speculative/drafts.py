"""Drafts for speculative decoding: which sequences get one this step, how long, and the n-gram
drafter (the engine's `Drafter`, engine/drafting.py, for the "ngram" method).

An n-gram draft brings no probabilities: the verifier's greedy walk keeps the target's
distribution, and with the sampler's seeded noise the very tokens of the same request without
speculation. A draft model's sampled drafts bring theirs, for rejection sampling
(engine/verifier.py says both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from compiled_engine.config import EngineConfig, SpeculativeConfig
from compiled_engine.engine.drafting import DraftProbs
from compiled_engine.engine.sequence import Sequence
from compiled_engine.executor.runner import Runner
from compiled_engine.speculative.ngram import propose_ngram

DraftOf = Callable[[SpeculativeConfig, Sequence, int], list[int]]  # a sequence's draft of at most k tokens


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
        if len(self.accepted_at) < num_draft:
            self.accepted_at.extend([0] * (num_draft - len(self.accepted_at)))
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    def copy(self) -> SpeculativeStats:
        return SpeculativeStats(self.drafts, self.draft_tokens, self.accepted_tokens, list(self.accepted_at))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step gives a sequence on average: its accepted drafts plus one."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0


def ngram_draft(config: SpeculativeConfig, seq: Sequence, k: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the sequence's longest suffix.
    A constrained sequence (structured outputs) verifies only what its grammar allows."""
    draft = propose_ngram(seq.token_ids, config.prompt_lookup_min, config.prompt_lookup_max, k)
    return draft if seq.grammar is None else draft[: seq.grammar.valid_prefix(draft)]


def propose_drafts(
    config: SpeculativeConfig, running: list[Sequence], max_model_len: int, draft_of: DraftOf = ngram_draft
) -> None:
    """Give each decoding sequence of `running` this step's draft (`draft_token_ids`), none when
    the batch is above `disable_by_batch_size`, the sequence stopped speculating, or no room is
    left before max_tokens or the context's end. A draft a sequence kept from a step that did not
    schedule it is dropped: every step's drafts are this step's.

    `draft_of` gives a sequence's draft: an n-gram draft is known now; a draft model's places are
    reserved now and filled after scheduling (speculative/draft_model.py)."""
    off = config.disable_by_batch_size is not None and len(running) > config.disable_by_batch_size
    for seq in running:
        seq.draft_token_ids = []
        if off or seq.is_prefilling or not seq.speculating:
            continue
        # The step emits up to k + 1 tokens; the k drafts sit at positions up to num_tokens - 1 + k.
        room = min(seq.params.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens) - 1
        k = min(seq.draft_length or config.num_speculative_tokens, room)
        if k <= 0:
            continue
        seq.draft_token_ids = draft_of(config, seq, k)


def update_speculating(config: SpeculativeConfig, seq: Sequence, num_draft: int, num_accepted: int) -> None:
    """After a verify: the next draft's length (adaptive_draft_length), and a sequence whose
    drafts stay mostly rejected stops speculating."""
    if config.adaptive_draft_length:
        length = seq.draft_length or config.num_speculative_tokens
        length = length + 2 if num_accepted == num_draft else length - 1
        seq.draft_length = max(1, min(length, config.num_speculative_tokens))
    if (
        seq.num_draft_tokens >= config.acceptance_probe
        and seq.num_accepted_tokens < config.min_acceptance_rate * seq.num_draft_tokens
    ):
        seq.speculating = False


class NgramDrafter:
    """Prompt-lookup drafts: the sequence's own earlier tokens propose what comes next. They need
    no probabilities: the verifier's greedy walk keeps the target's distribution."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpeculativeStats()

    @classmethod
    def plan(cls, config: SpeculativeConfig, engine_config: EngineConfig, model_dir: Path) -> NgramDrafter:
        return cls(config)

    shared_pool = None  # as a plan: no model of its own

    def start(self, runner: Runner) -> NgramDrafter:
        return self

    @property
    def runners(self) -> list[Runner]:
        return []

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        propose_drafts(self.config, running, max_model_len)

    def fill(self, scheduled: list[Sequence], running: list[Sequence]) -> DraftProbs:
        return {}

    def record(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        record_verify(self.config, self.stats, seq, num_draft, num_accepted)

    def snapshot(self) -> SpeculativeStats | None:
        return self.stats.copy()


def record_verify(
    config: SpeculativeConfig, stats: SpeculativeStats, seq: Sequence, num_draft: int, num_accepted: int
) -> None:
    """Count a verify of `seq`'s draft (nothing when it had none) and adapt its next one."""
    if not num_draft:
        return
    stats.record(num_draft, num_accepted)
    seq.num_draft_tokens += num_draft
    seq.num_accepted_tokens += num_accepted
    update_speculating(config, seq, num_draft, num_accepted)
