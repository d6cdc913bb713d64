"""The portable reference backend: scatter new K/V into their slots, gather each sequence's pages,
and run scaled-dot-product attention with a causal mask offset by the cached prefix (the paged
SDPA path of `attention/paged.py`), with sliding windows, logit soft-caps and attention sinks. It runs on every
device and dtype; the other backends are tested against it.
"""

from __future__ import annotations

from typing import Self

import torch

from compiled_engine.attention.backend import AttentionBackend, AttentionShape
from compiled_engine.attention.metadata import AttentionMetadata, GraphMetadata
from compiled_engine.attention.paged import (
    DecodeRows,
    TorchPlan,
    decode_rows,
    kv_rows,
    paged_forward,
    prepare_torch_plan,
)


class TorchAttentionBackend(AttentionBackend[TorchPlan]):
    name = "torch"
    # A decode plan reads device tensors only, so it is rebuilt from the buffers at every replay.
    supports_cuda_graphs = True
    supports_sliding_window = True
    supports_soft_cap = True
    supports_sinks = True

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype  # of the key masks: the model's activations

    @classmethod
    def create(cls, shape: AttentionShape) -> Self:
        return cls(shape.dtype)

    def prepare(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> TorchPlan:
        return prepare_torch_plan(metadata, kv_cache.shape[-3], self.dtype)

    def prepare_graph(self, metadata: GraphMetadata) -> TorchPlan:
        page_size = metadata.page_size
        rows, bias = decode_rows(metadata.block_tables, metadata.seq_lens, page_size, self.dtype)
        # The lengths stay device tensors: a window's mask is built from them at every replay.
        decode = DecodeRows(rows, bias, metadata.seq_lens)
        return TorchPlan(metadata.slot_mapping, kv_rows(metadata.slot_mapping, page_size), decode, None)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: TorchPlan,
        scale: float,
        window: int = 0,
        soft_cap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_forward(q, k, v, kv_cache, plan, scale, window, soft_cap, sinks)
