"""The CPU backend: the torch backend with decode attention in a native kernel.

Decoding sequences (one new token each) go through `native_decode` (stores their K/V, then
attends over their pages in place: no gather of the pages, no mask, no SDPA call per layer);
prompts and prompt chunks take the torch backend's SDPA path. The torch backend stays the
reference this one is tested against.
"""

from __future__ import annotations

import torch

from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.attention.native_decode import DecodePlan, NativeDecode
from compiled_engine.attention.torch_backend import TorchAttentionBackend, attend_prompts, write_kv


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self, kernel: NativeDecode) -> None:
        self.kernel = kernel
        self.reference = TorchAttentionBackend()  # prompts only, and what the kernel cannot run (not fp32)

    def _plan(self, metadata: AttentionMetadata, num_heads: int, kv_cache: torch.Tensor) -> tuple[DecodePlan, torch.Tensor | None, frozenset[int]] | None:
        """The decoding sequences' plan, built by the first layer of a forward: with, in a mixed
        batch, their token positions and sequence indices (None and empty when all decode)."""
        cached = metadata.per_forward
        if "native_plan" in cached:
            return cached["native_plan"]
        plan: tuple[DecodePlan, torch.Tensor | None, frozenset[int]] | None = None
        if metadata.decode_only:
            # Decode-only metadata may describe static buffers whose host lists are placeholders
            # (cuda_graphs.DecodeBuffers): read the lengths from the tensor, which is on the CPU.
            max_len = int(metadata.seq_lens.max())
            plan = (self.kernel.plan(metadata.slot_mapping, metadata.block_tables, metadata.seq_lens, max_len, num_heads, tuple(kv_cache.shape)), None, frozenset())
        else:
            starts = metadata.query_start_loc_cpu
            decoding = metadata.decoding_seqs()
            if decoding:
                device = metadata.block_tables.device
                seqs = torch.tensor(decoding, device=device)
                tokens = torch.tensor([starts[i] for i in decoding], device=device)
                kernel_plan = self.kernel.plan(
                    metadata.slot_mapping[tokens], metadata.block_tables[seqs], metadata.seq_lens[seqs],
                    max(metadata.seq_lens_cpu[i] for i in decoding), num_heads, tuple(kv_cache.shape),
                )  # fmt: skip
                plan = (kernel_plan, tokens, frozenset(decoding))
        cached["native_plan"] = plan
        return plan

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if kv_cache.dtype != torch.float32:
            return self.reference.forward(q, k, v, kv_cache, metadata, scale)
        planned = self._plan(metadata, q.shape[1], kv_cache)
        if planned is None:  # prompts only: exactly the torch backend
            return self.reference.forward(q, k, v, kv_cache, metadata, scale)
        plan, tokens, skip = planned
        if tokens is None:  # decode only
            return plan.run(q, k, v, kv_cache, scale)
        write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        out[tokens] = plan.run(q[tokens], k[tokens], v[tokens], kv_cache, scale)
        attend_prompts(q, kv_cache, metadata, scale, out, skip)
        return out
