"""The KV page pool: one tensor holding every layer's pages, sized from a memory budget."""

from __future__ import annotations

import torch

from compiled_engine.model.config import ModelConfig

DEFAULT_PAGE_SIZE = 16


def bytes_per_page(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * page_size * config.num_kv_heads * config.head_dim * element


def pages_for_budget(config: ModelConfig, page_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    return budget_bytes // bytes_per_page(config, page_size, dtype)


def allocate_kv_cache(
    config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[layers, pages, 2 (K then V), page_size, kv_heads, head_dim]: each layer's slice is the
    page layout FlashInfer calls NHD with K and V interleaved per page."""
    if num_pages < 1:
        raise ValueError(f"the KV cache needs at least one page, got {num_pages}")
    shape = (config.num_layers, num_pages, 2, page_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
