"""The interface every attention backend implements, and the lookup by name."""

from __future__ import annotations

from typing import Protocol

import torch

from compiled_engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Writes the new K/V into the paged cache, then attends causally over each sequence's context.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    kv_cache: one layer's pages, [num_pages, 2, page_size, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim].
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from compiled_engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (available: torch)")
