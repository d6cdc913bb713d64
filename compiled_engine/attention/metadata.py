"""Where each sequence's new tokens sit in the flat batch and in the page pool: `AttentionMetadata`
for a forward built from the scheduler's batch, `GraphMetadata` for a decode CUDA graph's static
buffers (device tensors only, so nothing can read host values the graph does not replay)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Tensors describing one forward over a flat batch of tokens from many sequences.

    Sequence i owns new tokens `query_start_loc[i]:query_start_loc[i+1]` of the flat batch; after
    this forward its context holds `seq_lens[i]` tokens (cached prefix plus the new ones), stored
    in the pages `block_tables[i, :ceil(seq_lens[i] / page_size)]`. New token t is written to
    slot `slot_mapping[t]` (page * page_size + offset in page).
    """

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], on the model device
    seq_lens: torch.Tensor  # int32 [num_seqs], on the model device
    block_tables: torch.Tensor  # int32 [num_seqs, max_pages_per_seq], on the model device
    slot_mapping: torch.Tensor  # int64 [num_tokens], on the model device
    # Host copies, so the reference backend can loop over sequences without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    decode_only: bool = False  # every sequence adds exactly one token

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def decoding_seqs(self) -> list[int]:
        """The sequences that add exactly one token in this forward (from the host lists)."""
        starts = self.query_start_loc_cpu
        return [i for i in range(self.num_seqs) if starts[i + 1] - starts[i] == 1]

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        page_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Metadata for sequences that add `query_lens[i]` tokens, ending at `seq_lens[i]`."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        starts = [0]
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if q_len <= 0 or q_len > s_len:
                raise ValueError(f"query length {q_len} must be in 1..{s_len}")
            if len(table) * page_size < s_len:
                raise ValueError(f"{len(table)} pages cannot hold {s_len} tokens")
            starts.append(starts[-1] + q_len)
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // page_size] * page_size + pos % page_size)
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), width),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(seq_lens),
            decode_only=all(q == 1 for q in query_lens),
        )


@dataclass(frozen=True)
class GraphMetadata:
    """A decode batch of `num_seqs` rows (one new token each) held in static device buffers that
    are rewritten before every CUDA-graph replay (executor/cuda_graphs.py). It has no host lists on
    purpose: a captured graph replays only device work, so a backend must not plan from values
    that would be frozen at capture time."""

    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_pages_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_seqs]
    page_size: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
