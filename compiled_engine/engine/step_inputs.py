"""The engine's side of the runner's contract: a scheduled batch as the runner's `StepInputs`."""

from __future__ import annotations

from compiled_engine.cache.block_manager import PageCopy
from compiled_engine.engine.sequence import Sequence
from compiled_engine.executor.step import StepInputs, Wants

ScheduledBatch = list[tuple[Sequence, int]]  # each sequence with how many new tokens it runs


def step_inputs(
    batch: ScheduledBatch,
    lora_slots: list[int] | None = None,
    page_copies: list[PageCopy] | None = None,
    wants: Wants = Wants.LOGITS,
) -> StepInputs:
    """`lora_slots`: each sequence's adapter slot (engine/adapters.py; None: no adapters);
    `page_copies`: the scheduler's, run before the forward; `wants`: hidden states for pooling."""
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
    return StepInputs(
        token_ids, positions, query_lens, seq_lens, tables, lora_slots, counts, page_copies or None, wants
    )


def logit_count(seq: Sequence, num_new: int) -> int:
    """How many of a sequence's last new tokens of the step need logits: every one while its
    prompt logprobs are computed, 1 + its draft tokens when it verifies a draft, else one."""
    if seq.wants_prompt_logprobs:
        return num_new
    return 1 + len(seq.draft_token_ids)
