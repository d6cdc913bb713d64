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


BACKENDS = ("torch", "cpu", "flashinfer")


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
    """`name` None picks FlashInfer on CUDA and the CPU backend (native decode kernel) on the CPU
    when they can run this model, else the torch backend, with one warning saying why. An
    explicit "cpu" or "flashinfer" that cannot run falls back to torch with a warning: never a
    silently wrong result."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(BACKENDS)})")
    if name == "torch" or shape is None:
        return _torch_backend()
    if name == "cpu" or (name is None and shape.device.type != "cuda"):
        return _cpu_backend(shape)
    from compiled_engine.attention.flashinfer_backend import (
        FlashInferAttentionBackend,
        flashinfer_unsupported_reason,
    )

    reason = flashinfer_unsupported_reason(shape.head_dim, shape.dtype, shape.device)
    if reason is not None:
        logger.warning("attention backend: torch, because %s", reason)
        return _torch_backend()
    return FlashInferAttentionBackend(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size, shape.dtype, shape.device)


def _torch_backend() -> AttentionBackend:
    from compiled_engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _cpu_backend(shape: AttentionShape) -> AttentionBackend:
    from compiled_engine.attention.cpu_backend import CpuAttentionBackend
    from compiled_engine.attention.native_decode import (
        KernelBuildError,
        load_native_decode,
        unsupported_reason,
    )

    if shape.device.type != "cpu":
        reason: str | None = f"the cpu backend runs on the CPU, not {shape.device.type}"
    else:
        reason = unsupported_reason(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size, shape.dtype)
    if reason is None:
        try:
            return CpuAttentionBackend(load_native_decode())
        except KernelBuildError as error:
            reason = str(error)
    logger.warning("attention backend: torch, because %s", reason)
    return _torch_backend()
