"""Attention as one opaque operator, so torch.compile traces the model without graph breaks.

The model calls `paged_attention(q, k, v, kv_cache, scale)`. What the operator needs besides its
tensors (the backend, and the AttentionMetadata of the batch with its host-side lists) is set
once per forward by `attention_forward(...)`, outside any compiled region. Dynamo therefore never
sees the metadata: batch composition changes neither the traced graph nor its guards, and the
token count is the only shape that varies.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from compiled_engine.attention.backend import AttentionBackend
from compiled_engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class _Forward:
    backend: AttentionBackend
    metadata: AttentionMetadata


_current: _Forward | None = None


@contextmanager
def attention_forward(backend: AttentionBackend, metadata: AttentionMetadata) -> Iterator[None]:
    """Every `paged_attention` call inside this block attends with `backend` over `metadata`."""
    global _current
    previous, _current = _current, _Forward(backend, metadata)
    try:
        yield
    finally:
        _current = previous


@torch.library.custom_op("compiled_engine::paged_attention", mutates_args=("kv_cache",))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Write k, v into `kv_cache` (one layer's pages) and attend; see AttentionBackend."""
    if _current is None:
        raise RuntimeError("paged_attention called outside attention_forward(...)")
    return _current.backend.forward(q, k, v, kv_cache, _current.metadata, scale)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)
