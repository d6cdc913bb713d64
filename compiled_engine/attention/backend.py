"""The interface every attention backend implements, and the lookup by name."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from compiled_engine.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


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


BACKENDS = ("torch", "flashinfer")


@dataclass(frozen=True)
class AttentionShape:
    """What a backend needs to know of the model on this rank."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    device: torch.device


def get_backend(name: str | None, shape: AttentionShape | None = None) -> AttentionBackend:
    """`name` None picks FlashInfer on CUDA when it can run this model and the torch backend
    otherwise (with one warning saying why, on CUDA). An explicit "flashinfer" that cannot run
    falls back to torch with a warning: never a silently wrong result."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(BACKENDS)})")
    if name == "torch" or shape is None or (name is None and shape.device.type != "cuda"):
        from compiled_engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    from compiled_engine.attention.flashinfer_backend import (
        FlashInferAttentionBackend,
        flashinfer_unsupported_reason,
    )

    reason = flashinfer_unsupported_reason(shape.head_dim, shape.dtype, shape.device)
    if reason is not None:
        logger.warning("attention backend: torch, because %s", reason)
        return get_backend("torch")
    return FlashInferAttentionBackend(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size, shape.dtype, shape.device)
