"""The CPU backend: the torch backend with decode attention in a native kernel.

Decoding sequences (one new token each) go through `native_decode` (stores their K/V, then
attends over their pages in place: no gather of the pages, no mask, no SDPA call per layer);
prompts and prompt chunks take the torch backend's SDPA path. The torch backend stays the
reference this one is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled_engine.attention.backend import AttentionBackend
from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.attention.native_decode import DecodePlan, NativeDecode
from compiled_engine.attention.torch_backend import (
    TorchAttentionBackend,
    TorchPlan,
    attend_prompts,
    prepare_torch_plan,
    write_kv,
)


@dataclass(frozen=True)
class CpuPlan:
    """One forward: the native kernel's checked plan for the decoding sequences (None when none
    decode, or the cache is not fp32), with their token positions in a mixed batch (None when
    every sequence decodes); the torch plan for the prompts (None when every sequence decodes)."""

    native: DecodePlan | None
    decode_tokens: torch.Tensor | None
    decode_seqs: frozenset[int]
    prompts: TorchPlan | None


class CpuAttentionBackend(AttentionBackend[CpuPlan]):
    name = "cpu"

    def __init__(self, kernel: NativeDecode, num_heads: int) -> None:
        self.kernel = kernel
        self.num_heads = num_heads  # this rank's query heads
        self.reference = TorchAttentionBackend()

    def prepare(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> CpuPlan:
        layer_shape = tuple(kv_cache.shape[-5:])
        page_size = layer_shape[2]
        if kv_cache.dtype != torch.float32:  # what the kernel cannot run: exactly the torch backend
            return CpuPlan(None, None, frozenset(), prepare_torch_plan(metadata, page_size, kv_cache.dtype))
        if metadata.decode_only:
            native = self.kernel.plan(
                metadata.slot_mapping,
                metadata.block_tables,
                metadata.seq_lens,
                max(metadata.seq_lens_cpu),
                self.num_heads,
                layer_shape,
            )
            return CpuPlan(native, None, frozenset(), None)
        decoding = metadata.decoding_seqs()
        prompts = prepare_torch_plan(metadata, page_size, kv_cache.dtype, batch_decodes=False)
        if not decoding:  # prompts only: exactly the torch backend
            return CpuPlan(None, None, frozenset(), prompts)
        starts = metadata.query_start_loc_cpu
        device = metadata.block_tables.device
        seqs = torch.tensor(decoding, device=device)
        tokens = torch.tensor([starts[i] for i in decoding], device=device)
        native = self.kernel.plan(
            metadata.slot_mapping[tokens], metadata.block_tables[seqs], metadata.seq_lens[seqs],
            max(metadata.seq_lens_cpu[i] for i in decoding), self.num_heads, layer_shape,
        )  # fmt: skip
        return CpuPlan(native, tokens, frozenset(decoding), prompts)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: CpuPlan, scale: float
    ) -> torch.Tensor:
        native, prompts = plan.native, plan.prompts
        if prompts is None:  # decode only
            assert native is not None
            return native.run(q, k, v, kv_cache, scale)
        if native is None:  # prompts only, or not fp32
            return self.reference.forward(q, k, v, kv_cache, prompts, scale)
        write_kv(k, v, kv_cache, prompts.slot_mapping, prompts.write_rows)
        out = torch.empty_like(q)
        tokens = plan.decode_tokens
        assert tokens is not None
        out[tokens] = native.run(q[tokens], k[tokens], v[tokens], kv_cache, scale)
        assert prompts.metadata is not None
        attend_prompts(q, kv_cache, prompts.metadata, scale, out, plan.decode_seqs)
        return out
