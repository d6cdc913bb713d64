"""The runner's contract: `StepInputs`, one forward as plain lists (what the runner builds its
tensors from, and what the other ranks receive from rank 0), and `StepOutput`, what came back.
The engine builds the inputs from its scheduled batch (engine/step_inputs.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from compiled_engine.cache.block_manager import PageCopy


class Wants(enum.Enum):
    """What a step asks rank 0's runner for."""

    LOGITS = "logits"  # the rows to sample (`Logits`)
    HIDDEN_STATES = "hidden_states"  # every token's final hidden state (`HiddenStates`, pooling)
    NOTHING = "nothing"  # only the K/V it writes (a draft model catching up)


@dataclass(frozen=True)
class Logits:
    """fp32 [rows, vocab]: each sequence's last new token's logits, or its last `logit_counts`."""

    rows: torch.Tensor


@dataclass(frozen=True)
class HiddenStates:
    """fp32 [tokens, hidden]: the final hidden state of every new token of the step, in order (what
    a pooler reads)."""

    rows: torch.Tensor


@dataclass(frozen=True)
class NoOutput:
    """The step ran and wrote its K/V; nothing comes back (a rank other than 0, or `Wants.NOTHING`)."""


StepOutput = Logits | HiddenStates | NoOutput


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
    # Hidden states (pooling) run the model eagerly, never a CUDA graph, on every rank alike.
    wants: Wants = Wants.LOGITS

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


def _part(values: list[int] | None, start: int, end: int) -> list[int] | None:
    return None if values is None else values[start:end]
