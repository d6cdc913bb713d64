"""The portable reference backend: scatter new K/V into their slots, gather each sequence's pages,
and run scaled-dot-product attention with a causal mask offset by the cached prefix.

Two paths: one SDPA per sequence for batches with prompts (whole prompts run `is_causal`, chunks
after a cached prefix a mask), and for decode-only batches one batched SDPA over every
sequence's pages padded to the widest block table, which reads only device tensors and so can be
captured in a CUDA graph.
"""

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


def decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """One new token per sequence. q: [seqs, heads, d]; block_tables: [seqs, width] (rows padded
    with any valid page); seq_lens: [seqs]. Keys past a sequence's length are masked out."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    width = block_tables.shape[1] * page_size
    pages = kv_cache[block_tables.long()]  # [seqs, width / page, 2, page, kvh, d]
    keys = pages[:, :, 0].reshape(num_seqs, width, num_kv_heads, head_dim).transpose(1, 2)
    values = pages[:, :, 1].reshape(num_seqs, width, num_kv_heads, head_dim).transpose(1, 2)
    visible = torch.arange(width, device=q.device)[None, :] < seq_lens[:, None]  # [seqs, width]
    # Masked slots hold whatever an earlier owner left; a non-finite key or value there would
    # still poison the result (NaN + -inf is NaN, 0 * NaN is NaN), so they are zeroed.
    hidden = ~visible[:, None, :, None]
    keys, values = keys.masked_fill(hidden, 0), values.masked_fill(hidden, 0)
    attended = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [seqs, heads, 1, d]
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return attended[:, :, 0, :]


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
        if metadata.decode_only:
            return decode_attention(q, kv_cache, metadata.block_tables, metadata.seq_lens, scale)
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
