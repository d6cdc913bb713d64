"""StepInputs: one forward as plain lists, what the runner builds its tensors from and what
tensor-parallel ranks receive from rank 0."""

from __future__ import annotations

from dataclasses import dataclass

from compiled_engine.cache.block_manager import PageCopy
from compiled_engine.engine.sequence import Sequence

ScheduledBatch = list[tuple[Sequence, int]]  # each sequence with how many new tokens it runs


@dataclass(frozen=True)
class StepInputs:
    """The new tokens of every sequence, flat, with their positions, and where their pages are."""

    token_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    lora_slots: list[int] | None = None  # each sequence's adapter slot, -1 for none; None: no adapters
    # How many of each sequence's last tokens need logits (`logit_count`): 1 + its draft tokens
    # (speculative decoding verifies each), or all of them (prompt logprobs); None: one each.
    logit_counts: list[int] | None = None
    # K/V copied between pages before the forward (prefix-cache hits inside a page)
    page_copies: list[PageCopy] | None = None
    # The step's output is every token's final hidden state (pooling), not logits: it runs the
    # model eagerly, never a CUDA graph, on every rank alike.
    hidden_states: bool = False

    @property
    def decode_only(self) -> bool:
        return len(self.token_ids) == len(self.query_lens)

    def micro_batches(self, parts: int) -> list[StepInputs]:
        """The step cut into at most `parts` runs of whole sequences, in order and of about equal
        token counts (a pipeline's micro-batches). Page copies stay with the whole step: they run
        once, before any of it."""
        total, count = len(self.token_ids), len(self.query_lens)
        parts = min(parts, count)
        cuts: list[int] = []
        seen = 0
        for i, query_len in enumerate(self.query_lens[:-1]):
            seen += query_len
            still = parts - 1 - len(cuts)  # cuts still to make
            if still == 0:
                break
            # Cut once this run holds its share of the tokens, or when each sequence left must
            # start a run of its own.
            if seen >= total * (len(cuts) + 1) / parts or count - (i + 1) == still:
                cuts.append(i + 1)
        start = 0
        runs = []
        token = 0
        for end in [*cuts, count]:
            tokens = sum(self.query_lens[start:end])
            runs.append(
                StepInputs(
                    self.token_ids[token : token + tokens],
                    self.positions[token : token + tokens],
                    self.query_lens[start:end],
                    self.seq_lens[start:end],
                    self.block_tables[start:end],
                    _part(self.lora_slots, start, end),
                )
            )
            start, token = end, token + tokens
        return runs

    @classmethod
    def from_batch(
        cls,
        batch: ScheduledBatch,
        lora_slots: list[int] | None = None,
        page_copies: list[PageCopy] | None = None,
        hidden_states: bool = False,
    ) -> StepInputs:
        """`lora_slots`: each sequence's adapter slot (engine/adapters.py; None: no adapters);
        `page_copies`: the scheduler's, run before the forward; `hidden_states`: pooling's step."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens = [], []
        for seq, num_new in batch:
            start = seq.num_computed_tokens
            end = start + num_new
            prompt_len = len(seq.prompt_token_ids)
            if start >= prompt_len:  # decoding: no copy of the prompt
                token_ids.extend(seq.output_token_ids[start - prompt_len : end - prompt_len])
            else:
                token_ids.extend(seq.token_ids[start:end])
            if end > seq.num_tokens:  # the draft tokens after the last one, to verify
                token_ids.extend(seq.draft_token_ids[: end - seq.num_tokens])
            positions.extend(range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
        every = [logit_count(seq, num_new) for seq, num_new in batch]
        counts = None if all(count == 1 for count in every) else every
        tables = [list(seq.block_table) for seq, _ in batch]
        return cls(
            token_ids, positions, query_lens, seq_lens, tables, lora_slots, counts, page_copies or None, hidden_states
        )


def _part(values: list[int] | None, start: int, end: int) -> list[int] | None:
    return None if values is None else values[start:end]


def logit_count(seq: Sequence, num_new: int) -> int:
    """How many of a sequence's last new tokens of the step need logits: every one while its
    prompt logprobs are computed, 1 + its draft tokens when it verifies a draft, else one."""
    if seq.wants_prompt_logprobs:
        return num_new
    return 1 + len(seq.draft_token_ids)
