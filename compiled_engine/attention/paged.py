"""The paged K/V helpers the backends share, and the portable paged-SDPA path.

Every backend writes new K/V into their slots with `write_kv` (at `kv_rows`). The SDPA path
(`TorchPlan`, `prepare_torch_plan`, `paged_forward`) is the torch backend's whole forward and
the CPU backend's path for longer prompts: one SDPA per sequence for batches with prompts (whole
prompts run `is_causal`, chunks after a cached prefix a mask), and for decode-only batches one
batched SDPA over every sequence's pages padded to the widest block table (`decode_rows`), which
reads only device tensors and so can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compiled_engine.attention.metadata import AttentionMetadata


def kv_rows(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The row of each slot's K in one layer's pages viewed flat as [pages * 2 * page_size,
    kv_heads, head_dim] (K then V within a page); its V sits `page_size` rows further."""
    return (slots // page_size) * (2 * page_size) + slots % page_size


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """Store each new token's K and V in its slot; `rows` = kv_rows(slot_mapping), if known."""
    page_size = kv_cache.shape[2]
    rows = kv_rows(slot_mapping, page_size) if rows is None else rows
    flat = kv_cache.view(-1, *kv_cache.shape[3:])
    flat.index_copy_(0, rows, k.to(kv_cache.dtype))
    flat.index_copy_(0, rows + page_size, v.to(kv_cache.dtype))


def decode_rows(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """For decoding sequences: the flat K rows of their pages ([seqs * width]) and the key mask
    ([seqs, 1, 1, width]: 0 for a sequence's keys, -inf past its length)."""
    tables = block_tables.long()
    width = tables.shape[1] * page_size
    in_page = torch.arange(page_size, device=tables.device)
    rows = (tables[:, :, None] * (2 * page_size) + in_page).reshape(-1)
    visible = torch.arange(width, device=tables.device)[None, :] < seq_lens[:, None]
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    return rows, bias[:, None, None, :]


@dataclass(frozen=True)
class DecodeRows:
    """The decoding sequences of a forward, attended in one batched call: the flat K rows of their
    pages and their key mask (`decode_rows`); in a mixed batch also their token positions in the
    flat batch and their sequence indices (None and empty when every sequence decodes)."""

    read_rows: torch.Tensor
    key_bias: torch.Tensor
    tokens: torch.Tensor | None = None
    seqs: frozenset[int] = frozenset()


@dataclass(frozen=True)
class TorchPlan:
    """One forward of the torch backend: where the new K/V go, the decoding sequences' batched
    rows (None when fewer than two decode beside prompts), and the metadata whose host lists the
    per-sequence prompt path loops over (None for a CUDA graph's decode-only plan)."""

    slot_mapping: torch.Tensor
    write_rows: torch.Tensor
    decode: DecodeRows | None
    metadata: AttentionMetadata | None


def prepare_torch_plan(
    metadata: AttentionMetadata, page_size: int, dtype: torch.dtype, batch_decodes: bool = True
) -> TorchPlan:
    """The index tensors and key masks of a forward, built once before its layers run. With
    `batch_decodes`, the decoding sequences of a mixed batch are picked out to run batched too."""
    write_rows = kv_rows(metadata.slot_mapping, page_size)
    decode: DecodeRows | None = None
    if metadata.decode_only:
        decode = DecodeRows(*decode_rows(metadata.block_tables, metadata.seq_lens, page_size, dtype))
    elif batch_decodes:
        starts = metadata.query_start_loc_cpu
        decoding = metadata.decoding_seqs()
        if len(decoding) > 1:
            device = metadata.block_tables.device
            seqs = torch.tensor(decoding, device=device)
            rows, bias = decode_rows(metadata.block_tables[seqs], metadata.seq_lens[seqs], page_size, dtype)
            decode = DecodeRows(
                rows, bias, torch.tensor([starts[i] for i in decoding], device=device), frozenset(decoding)
            )
    return TorchPlan(metadata.slot_mapping, write_rows, decode, None if metadata.decode_only else metadata)


def decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, read_rows: torch.Tensor, key_bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """One new token per sequence. q: [seqs, heads, d]; read_rows: the flat K rows of every
    sequence's pages, padded to the widest block table ([seqs * width]); key_bias: [seqs, 1, 1,
    width], 0 for a sequence's keys and -inf past its length. Slots past a sequence's length are
    read but get zero weight: the pool is zero-initialised and only ever holds finite K/V.

    The query heads that share a KV head are laid out as that head's query rows ([seqs, kv_heads,
    group, d]), so each key is read once per KV head rather than once per query head (faster on
    the CPU than SDPA's own GQA expansion: docs/benchmarks.md)."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    width = key_bias.shape[-1]
    flat = kv_cache.view(-1, num_kv_heads, head_dim)
    keys = flat.index_select(0, read_rows).view(num_seqs, width, num_kv_heads, head_dim).transpose(1, 2)
    values = flat.index_select(0, read_rows + page_size).view(num_seqs, width, num_kv_heads, head_dim).transpose(1, 2)
    attended = F.scaled_dot_product_attention(
        q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=key_bias.to(q.dtype),  # a no-op unless the plan was built for another dtype
        scale=scale,
    )
    return attended.reshape(num_seqs, num_heads, head_dim)


def attend_prompts(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    skip: frozenset[int] = frozenset(),
) -> None:
    """One SDPA per sequence of the batch (except those in `skip`), written into `out`; their
    K/V must already be in the cache. A whole prompt runs `is_causal`; a chunk after a cached
    prefix, or one new token, a mask offset by the prefix."""
    _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    starts = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        if i in skip:
            continue
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        num_pages = -(-seq_len // page_size)
        pages = kv_cache[metadata.block_tables[i, :num_pages]]  # [p, 2, page, kvh, d]
        keys = pages[:, 0].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = pages[:, 1].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        mask = None
        if 1 < q_len < seq_len:
            # A chunk after a cached prefix: query j sits at seq_len - q_len + j.
            query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            key_pos = torch.arange(seq_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]
        # 4-D inputs: with a batch dimension SDPA takes its fused CPU kernel, without one
        # the unfused math path, which is many times slower for long prompts (docs/benchmarks.md).
        attended = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None],  # [1, heads, q_len, d]
            keys.transpose(0, 1).to(q.dtype)[None],
            values.transpose(0, 1).to(q.dtype)[None],
            attn_mask=mask,
            # A whole prompt at once is plain causal attention, which SDPA runs without a mask.
            is_causal=q_len == seq_len and q_len > 1,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[start:end] = attended[0].transpose(0, 1)


def paged_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: TorchPlan, scale: float
) -> torch.Tensor:
    """Write the new K/V, then attend: decoding sequences batched, the others one SDPA each."""
    write_kv(k, v, kv_cache, plan.slot_mapping, plan.write_rows)
    decode = plan.decode
    if plan.metadata is None:  # every sequence decodes
        assert decode is not None
        return decode_attention(q, kv_cache, decode.read_rows, decode.key_bias, scale)
    out = torch.empty_like(q)
    if decode is not None and decode.tokens is not None:  # the decoding sequences of a mixed batch, in one call
        out[decode.tokens] = decode_attention(q[decode.tokens], kv_cache, decode.read_rows, decode.key_bias, scale)
    attend_prompts(q, kv_cache, plan.metadata, scale, out, decode.seqs if decode is not None else frozenset())
    return out
