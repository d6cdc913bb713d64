"""The interface every attention backend implements, and the lookup by name."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from compiled_engine.attention.metadata import AttentionMetadata, GraphMetadata

logger = logging.getLogger(__name__)

Plan = TypeVar("Plan")


class AttentionBackend(Generic[Plan]):
    """Writes the new K/V into the paged cache, then attends causally over each sequence's context.

    A forward asks its backend once, before the model runs and outside any compiled region, to
    `prepare` what this batch needs (index rows, key masks, a native kernel's checked plan,
    FlashInfer's scheduled wrapper): the backend's own typed plan. Every layer's `forward` then
    reads that plan and never writes it.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    kv_cache: one layer's pages, [num_pages, 2, page_size, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim].

    What the runner may ask besides, with the defaults here:
    - `supports_cuda_graphs`: decode may be captured (the plan of a graph reads device tensors
      only, or is planned on the host by `plan_graph`);
    - `plan_graph(size, metadata, seq_lens, block_tables)`: host-side work before a graph of
      `size` rows is captured and before each replay (FlashInfer schedules its wrapper);
    - `prepare_graph(metadata)`: the plan of a graph, built inside the capture from its static
      buffers so that a replay recomputes it;
    - `scale`: the softmax scale the backend was built for, when it must know it before the
      first forward (graph plans); None when it takes the model's at every call.
    """

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    scale: float | None = None

    def prepare(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> Plan:
        """This forward's plan; `kv_cache` is the whole pool, [layers, pages, 2, page_size,
        kv_heads, head_dim] (its shape bounds the page ids)."""
        raise NotImplementedError

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: Plan, scale: float
    ) -> torch.Tensor:
        raise NotImplementedError

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """`prepare` then `forward`, for one layer's call on its own (tests, kernel benchmarks)."""
        return self.forward(q, k, v, kv_cache, self.prepare(metadata, kv_cache), scale)

    def plan_graph(
        self, size: int, metadata: GraphMetadata, seq_lens: list[int], block_tables: list[list[int]]
    ) -> None:
        """Nothing to do on the host unless the backend schedules there."""

    def prepare_graph(self, metadata: GraphMetadata) -> Plan:
        raise NotImplementedError(f"the {self.name} attention backend cannot be captured in a CUDA graph")


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
    scale: float | None = None  # None = head_dim ** -0.5, the Llama family's

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale


def get_backend(name: str | None, shape: AttentionShape | None = None) -> AttentionBackend[Any]:
    """`name` None picks FlashInfer on CUDA and the CPU backend (native decode kernel) on the CPU
    when they can run this model, else the torch backend, with one warning saying why. An
    explicit "cpu" or "flashinfer" that cannot run falls back to torch with a warning: never a
    silently wrong result."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(BACKENDS)})")
    if name == "torch" or shape is None:
        return _torch_backend(shape)
    if name == "cpu" or (name is None and shape.device.type != "cuda"):
        return _cpu_backend(shape)
    from compiled_engine.attention.flashinfer_backend import (
        FlashInferAttentionBackend,
        flashinfer_unsupported_reason,
    )

    reason = flashinfer_unsupported_reason(shape.head_dim, shape.dtype, shape.device)
    if reason is not None:
        logger.warning("attention backend: torch, because %s", reason)
        return _torch_backend(shape)
    return FlashInferAttentionBackend(shape)


def _torch_backend(shape: AttentionShape | None) -> AttentionBackend[Any]:
    from compiled_engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(shape.dtype if shape is not None else torch.float32)


def _cpu_backend(shape: AttentionShape) -> AttentionBackend[Any]:
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
            return CpuAttentionBackend(load_native_decode(), shape.num_heads)
        except KernelBuildError as error:
            reason = str(error)
    logger.warning("attention backend: torch, because %s", reason)
    return _torch_backend(shape)
