"""The portable reference backend: scatter new K/V into their slots, gather each sequence's pages,
and run scaled-dot-product attention with a causal mask offset by the cached prefix."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiled_engine.attention.metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    page_size = kv_cache.shape[2]
    pages = slot_mapping // page_size
    offsets = slot_mapping % page_size
    kv_cache[pages, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[pages, 1, offsets] = v.to(kv_cache.dtype)


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, metadata.slot_mapping)
        _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = q.shape[1]
        out = torch.empty_like(q)
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            start, end = starts[i], starts[i + 1]
            q_len = end - start
            num_pages = -(-seq_len // page_size)
            pages = kv_cache[metadata.block_tables[i, :num_pages]]  # [p, 2, page, kvh, d]
            keys = pages[:, 0].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            values = pages[:, 1].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            # Query j sits at position seq_len - q_len + j and sees keys 0..that position.
            mask = None
            if 1 < q_len < seq_len:
                # A chunk after a cached prefix: query j sits at seq_len - q_len + j.
                query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                key_pos = torch.arange(seq_len, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]
            attended = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),  # [heads, q_len, d]
                keys.transpose(0, 1).to(q.dtype),
                values.transpose(0, 1).to(q.dtype),
                attn_mask=mask,
                # A whole prompt at once is plain causal attention, which SDPA runs without a mask.
                is_causal=q_len == seq_len and q_len > 1,
                scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )
            out[start:end] = attended.transpose(0, 1)
        return out
