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


# The operator is declared with a schema and a plain kernel (torch.library.define / impl) rather
# than torch.library.custom_op: custom_op wraps each call in Python autograd and aliasing checks,
# about 25 us a call here, paid once per layer per step.
torch.library.define(
    "compiled_engine::paged_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, float scale) -> Tensor",
)


@torch.library.impl("compiled_engine::paged_attention", "CompositeExplicitAutograd")
def _paged_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
    if _current is None:
        raise RuntimeError("paged_attention called outside attention_forward(...)")
    return _current.backend.forward(q, k, v, kv_cache, _current.metadata, scale)


@torch.library.register_fake("compiled_engine::paged_attention")
def _paged_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Write k, v into `kv_cache` (one layer's pages) and attend; see AttentionBackend.
    q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]; returns q's shape."""
    return torch.ops.compiled_engine.paged_attention(q, k, v, kv_cache, scale)
