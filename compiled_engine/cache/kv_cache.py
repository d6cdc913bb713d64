"""The KV page pool: one tensor holding every layer's pages, sized from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether pages of `dtype` are FP8 (e4m3 or e5m2): one byte, a float."""
    return dtype.itemsize == 1 and dtype.is_floating_point


@dataclass(frozen=True)
class KVCacheSpec:
    """What one rank's page pool holds: `num_kv_heads` is this rank's share of the model's KV
    heads (all of them without tensor parallelism)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_page(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * element

    def pages_for_tokens(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, num_pages: int, device: torch.device) -> torch.Tensor:
        """[layers, pages, 2 (K then V), page_size, kv_heads, head_dim]: each layer's slice is the
        page layout FlashInfer calls NHD with K and V interleaved per page."""
        if num_pages < 1:
            raise ValueError(f"the KV cache needs at least one page, got {num_pages}")
        shape = (self.num_layers, num_pages, 2, self.page_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device)
