"""The CPU backend: the torch backend with decode attention in a native kernel.

Decoding sequences (one new token each) go through `native_decode` (stores their K/V, then
attends over their pages in place: no gather of the pages, no mask, no SDPA call per layer), and
so do sequences of a few new tokens (`SHORT_QUERY`: a speculative draft being verified, a short
prompt): each of their tokens is one row of the kernel, attending over the sequence's pages up to
its own position. The kernel stores every row's K/V before any row attends, so a row sees the
tokens before it in the same forward. Longer prompts and prompt chunks take the torch backend's
SDPA path (`attention/paged.py`). A layer's sliding window and soft-cap reach both: the kernel
reads only the pages of each row's window and caps each score with tanhf; attention sinks join
each query head's softmax where the kernel merges its chunks. The kernel keeps KV
pages of fp32, fp16, bf16 and FP8 (e4m3, e5m2), converting as it reads and writes them, with q, k
and v in fp32; other activations, or a cache of another type, run exactly the torch backend. The torch backend stays
the reference this one is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

import torch

import compiled_engine.attention.op  # noqa: F401  (the operator schemas the native operator implements)
from compiled_engine.attention.backend import AttentionBackend, AttentionShape, BackendUnavailableError
from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.attention.native_decode import (
    DecodePlan,
    KernelBuildError,
    NativeDecode,
    load_native_decode,
    load_native_operator,
    unsupported_kv_dtype,
)
from compiled_engine.attention.native_decode import (
    unsupported_reason as kernel_unsupported_reason,
)
from compiled_engine.attention.paged import TorchPlan, attend_prompts, paged_forward, prepare_torch_plan, write_kv

SHORT_QUERY = 8  # new tokens of a sequence up to which its tokens run as rows of the native kernel


@dataclass(frozen=True)
class CpuPlan:
    """One forward: the native kernel's checked plan for the decoding and other short sequences
    (None when there are none, or the kernel cannot keep the cache's type), with their tokens'
    rows in a mixed batch (None when every sequence is short); the torch plan for the longer
    prompts (None when there are none)."""

    native: DecodePlan | None
    decode_tokens: torch.Tensor | None
    decode_seqs: frozenset[int]
    prompts: TorchPlan | None


class CpuAttentionBackend(AttentionBackend[CpuPlan]):
    name = "cpu"
    supports_sliding_window = True  # the kernel starts each row at its window; prompts mask it
    supports_soft_cap = True
    supports_sinks = True

    def __init__(
        self, kernel: NativeDecode, num_heads: int, native_operator: bool = False, dtype: torch.dtype = torch.float32
    ) -> None:
        self.kernel = kernel
        self.num_heads = num_heads  # this rank's query heads
        self.dtype = dtype  # the activations' (q, k, v): the kernel takes fp32 only
        # Whether the model's operator has its native CPU kernel (op.py): then a plan of short
        # sequences only runs every layer there, without Python.
        self.native_operator = native_operator

    @classmethod
    def unsupported_reason(cls, shape: AttentionShape) -> str | None:
        if shape.device.type != "cpu":
            return f"the cpu backend runs on the CPU, not {shape.device.type}"
        return kernel_unsupported_reason(
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size, shape.dtype, shape.kv_dtype
        )

    @classmethod
    def create(cls, shape: AttentionShape) -> Self:
        try:
            return cls(load_native_decode(), shape.num_heads, load_native_operator(), shape.dtype)
        except KernelBuildError as error:
            raise BackendUnavailableError(str(error)) from error

    def prepare(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> CpuPlan:
        layer_shape = tuple(kv_cache.shape[-5:])
        page_size = layer_shape[2]
        if self.dtype != torch.float32 or unsupported_kv_dtype(kv_cache.dtype) is not None:
            # What the kernel cannot run: exactly the torch backend.
            return CpuPlan(None, None, frozenset(), prepare_torch_plan(metadata, page_size, self.dtype))
        if metadata.decode_only:
            native = self.kernel.plan(
                metadata.slot_mapping,
                metadata.block_tables,
                metadata.seq_lens,
                max(metadata.seq_lens_cpu),
                self.num_heads,
                layer_shape,
                kv_cache.dtype,
            )
            return CpuPlan(native, None, frozenset(), None)
        starts = metadata.query_start_loc_cpu
        short = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] <= SHORT_QUERY]
        everything = len(short) == metadata.num_seqs
        prompts = None if everything else prepare_torch_plan(metadata, page_size, self.dtype, batch_decodes=False)
        if not short:  # long prompts only: exactly the torch backend
            return CpuPlan(None, None, frozenset(), prompts)
        # One kernel row per token of a short sequence: its seq's table, and the keys up to itself.
        rows: list[int] = []
        seq_of_row: list[int] = []
        lens: list[int] = []
        for i in short:
            end = metadata.seq_lens_cpu[i]
            count = starts[i + 1] - starts[i]
            rows.extend(range(starts[i], starts[i + 1]))
            seq_of_row.extend([i] * count)
            lens.extend(range(end - count + 1, end + 1))
        device = metadata.block_tables.device
        tokens = None if everything else torch.tensor(rows, device=device)
        native = self.kernel.plan(
            metadata.slot_mapping if tokens is None else metadata.slot_mapping[tokens],
            metadata.block_tables[torch.tensor(seq_of_row, device=device)],
            torch.tensor(lens, dtype=torch.int32, device=device),
            max(lens), self.num_heads, layer_shape, kv_cache.dtype,
        )  # fmt: skip
        return CpuPlan(native, tokens, frozenset(short), prompts)

    def native_plan(self, plan: CpuPlan) -> DecodePlan | None:
        return plan.native if self.native_operator and plan.prompts is None else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: CpuPlan,
        scale: float,
        window: int = 0,
        soft_cap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        native, prompts = plan.native, plan.prompts
        if prompts is None:  # short sequences only
            assert native is not None
            return native.run(q, k, v, kv_cache, scale, window, soft_cap, sinks)
        if native is None:  # prompts only, or what the kernel cannot run
            return paged_forward(q, k, v, kv_cache, prompts, scale, window, soft_cap, sinks)
        write_kv(k, v, kv_cache, prompts.slot_mapping, prompts.write_rows)
        out = torch.empty_like(q)
        tokens = plan.decode_tokens
        assert tokens is not None
        out[tokens] = native.run(q[tokens], k[tokens], v[tokens], kv_cache, scale, window, soft_cap, sinks)
        assert prompts.metadata is not None
        attend_prompts(q, kv_cache, prompts.metadata, scale, out, plan.decode_seqs, window, soft_cap, sinks)
        return out
