"""The interface every attention backend implements, and what it is asked to run (`AttentionShape`).

Which backend runs is chosen in `attention/selector.py`; this module knows no implementation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, Self, TypeVar

import torch

from compiled_engine.attention.metadata import AttentionMetadata, GraphMetadata

if TYPE_CHECKING:
    from compiled_engine.attention.native_decode import DecodePlan

Plan = TypeVar("Plan")
# What one layer's attention asks for: (window, soft_cap). window 0 attends to every earlier
# token; W > 0 to the last W positions including the query's own (transformers'
# `sliding_window`). soft_cap 0.0 leaves the logits as they are; c > 0 turns each logit s into
# c * tanh(s / c) before masking and softmax (Gemma 2's attn_logit_softcapping).
LayerKind = tuple[int, float]
FULL_ATTENTION: LayerKind = (0, 0.0)


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
    # The distinct (window, soft_cap) pairs of the model's layers (LayerKind). A backend that
    # plans per kind (FlashInfer) plans one wrapper for each; the others only check that they
    # support them.
    layer_kinds: tuple[LayerKind, ...] = (FULL_ATTENTION,)
    kv_dtype: torch.dtype | None = None  # the KV pages' storage type; None: `dtype`
    sinks: bool = False  # whether the model's layers pass attention sinks (gpt-oss)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale


class BackendUnavailableError(Exception):
    """Raised by a backend's `create` when it cannot run after all (its kernel failed to build);
    the message says why."""


class AttentionBackend(Generic[Plan]):
    """Writes the new K/V into the paged cache, then attends causally over each sequence's context.

    A forward asks its backend once, before the model runs and outside any compiled region, to
    `prepare` what this batch needs (index rows, key masks, a native kernel's checked plan,
    FlashInfer's scheduled wrapper): the backend's own typed plan. Every layer's `forward` then
    reads that plan and never writes it.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    kv_cache: one layer's pages, [num_pages, 2, page_size, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim].

    `window` and `soft_cap` are the layer's (see LayerKind); every layer passes its own at every
    call, since they differ between layers (Gemma alternates sliding and full layers). A backend
    declares that it honours them with `supports_sliding_window` and `supports_soft_cap`; the
    selector never gives a model a backend that would ignore what its layers ask for. So with
    `sinks` ([heads] fp32 or None) and `supports_sinks`: a sink is a learned logit per query head
    that joins each query's softmax denominator as exp(sink) with no value, so a query may give
    less than all of its weight to the keys (gpt-oss).

    What the runner may ask besides, with the defaults here:
    - `supports_cuda_graphs`: decode may be captured (the plan of a graph reads device tensors
      only, or is planned on the host by `plan_graph`);
    - `plan_graph(size, metadata, seq_lens, block_tables)`: host-side work before a graph of
      `size` rows is captured and before each replay (FlashInfer schedules its wrapper);
    - `prepare_graph(metadata)`: the plan of a graph, built inside the capture from its static
      buffers so that a replay recomputes it;
    - `scale`: the softmax scale the backend was built for, when it must know it before the
      first forward (graph plans); None when it takes the model's at every call.

    What the selector asks of the class before building one:
    - `unsupported_reason(shape)`: why it cannot run this model here (device, dtype, head size),
      or None when it can;
    - `create(shape)`: the backend for this model; raises `BackendUnavailableError` when it
      cannot run after all.
    """

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False
    supports_soft_cap: ClassVar[bool] = False
    supports_sinks: ClassVar[bool] = False
    scale: float | None = None

    @classmethod
    def unsupported_reason(cls, shape: AttentionShape) -> str | None:
        """Why this backend cannot run `shape` here, or None when it can (the default: anywhere)."""
        return None

    @classmethod
    def create(cls, shape: AttentionShape) -> Self:
        raise NotImplementedError

    def prepare(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> Plan:
        """This forward's plan; `kv_cache` is the whole pool, [layers, pages, 2, page_size,
        kv_heads, head_dim] (its shape bounds the page ids)."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: Plan,
        scale: float,
        window: int = 0,
        soft_cap: float = 0.0,
        sinks: torch.Tensor | None = None,
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
        window: int = 0,
        soft_cap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`prepare` then `forward`, for one layer's call on its own (tests, kernel benchmarks)."""
        plan = self.prepare(metadata, kv_cache)
        return self.forward(q, k, v, kv_cache, plan, scale, window, soft_cap, sinks)

    def native_plan(self, plan: Plan) -> DecodePlan | None:
        """The plan as the CPU's native `paged_attention` kernel runs it, when every call of this
        forward can run there (attention/op.py installs it); None: every call asks `forward`."""
        return None

    def plan_graph(
        self, size: int, metadata: GraphMetadata, seq_lens: list[int], block_tables: list[list[int]]
    ) -> None:
        """Nothing to do on the host unless the backend schedules there."""

    def prepare_graph(self, metadata: GraphMetadata) -> Plan:
        raise NotImplementedError(f"the {self.name} attention backend cannot be captured in a CUDA graph")
