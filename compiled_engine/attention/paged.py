"""The paged K/V helpers the backends share, and the portable paged-SDPA path.

Every backend writes new K/V into their slots with `write_kv` (at `kv_rows`). The SDPA path
(`TorchPlan`, `prepare_torch_plan`, `paged_forward`) is the torch backend's whole forward and
the CPU backend's path for longer prompts: one SDPA per sequence for batches with prompts (whole
prompts run `is_causal`, chunks after a cached prefix a mask), and for decode-only batches one
batched SDPA over every sequence's pages padded to the widest block table (`decode_rows`), which
reads only device tensors and so can be captured in a CUDA graph.

A layer's sliding window and logit soft-cap (`LayerKind`, attention/backend.py) arrive with each
call. Full attention without a cap runs exactly as above. A window adds the keys before it to the
mask (for decoding rows on the device, from their lengths, so graphs stay capturable); a soft-cap
needs tanh between the product and the softmax, and attention sinks a term in the softmax's
denominator, which SDPA cannot do, so such layers compute the attention written out
(`written_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.cache.kv_cache import is_fp8

# The most scores (heads x queries x keys) the written-out attention of one prompt holds at once.
WRITTEN_SCORES = 1 << 24


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
    keys, values = stored(k, kv_cache.dtype), stored(v, kv_cache.dtype)
    if is_fp8(flat.dtype):  # no index_copy_ for FP8: copy the bytes
        flat, keys, values = flat.view(torch.uint8), keys.view(torch.uint8), values.view(torch.uint8)
    flat.index_copy_(0, rows, keys)
    flat.index_copy_(0, rows + page_size, values)


def stored(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V as the pages hold them: cast to `dtype`; an FP8 type (a per-tensor scale of 1.0)
    saturates to its finite range first, since a plain cast turns what it cannot hold into NaN."""
    if is_fp8(dtype):
        limit = torch.finfo(dtype).max
        values = values.clamp(-limit, limit)
    return values.to(dtype)


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


def window_bias(key_bias: torch.Tensor, seq_lens: torch.Tensor, window: int) -> torch.Tensor:
    """`decode_rows`' key mask with the keys before each sequence's window masked too: the new
    token of sequence s sits at seq_lens[s] - 1 and sees keys j >= seq_lens[s] - window. Built
    from device tensors only, so a CUDA graph recomputes it at every replay."""
    width = key_bias.shape[-1]
    too_old = torch.arange(width, device=key_bias.device)[None, :] < (seq_lens[:, None] - window)
    return key_bias.masked_fill(too_old[:, None, None, :], float("-inf"))


@dataclass(frozen=True)
class DecodeRows:
    """The decoding sequences of a forward, attended in one batched call: the flat K rows of their
    pages, their key mask (`decode_rows`) and their lengths (for a window's mask); in a mixed
    batch also their token positions in the flat batch and their sequence indices (None and empty
    when every sequence decodes)."""

    read_rows: torch.Tensor
    key_bias: torch.Tensor
    seq_lens: torch.Tensor
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
        rows, bias = decode_rows(metadata.block_tables, metadata.seq_lens, page_size, dtype)
        decode = DecodeRows(rows, bias, metadata.seq_lens)
    elif batch_decodes:
        starts = metadata.query_start_loc_cpu
        decoding = metadata.decoding_seqs()
        if len(decoding) > 1:
            device = metadata.block_tables.device
            seqs = torch.tensor(decoding, device=device)
            seq_lens = metadata.seq_lens[seqs]
            rows, bias = decode_rows(metadata.block_tables[seqs], seq_lens, page_size, dtype)
            decode = DecodeRows(
                rows, bias, seq_lens, torch.tensor([starts[i] for i in decoding], device=device), frozenset(decoding)
            )
    return TorchPlan(metadata.slot_mapping, write_rows, decode, None if metadata.decode_only else metadata)


def written_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention written out, for what SDPA cannot do: the scores scale * q.k become
    soft_cap * tanh(scores / soft_cap) (soft_cap 0: as they are), then the mask (a float bias to
    add, or booleans, True where a key is visible), the softmax, with each query row's sink
    logit as one more score whose value is zero (sinks None: none), and the weighted sum of the
    values. q: [..., q_rows, d]; k, v: [..., keys, d], batch dimensions broadcast as in matmul;
    sinks broadcasts to [..., q_rows, 1]. Computed in at least fp32, returned in q's dtype."""
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(compute)
    if sinks is None:
        weights = scores.softmax(dim=-1)
    else:
        sink = sinks.to(compute).expand(*scores.shape[:-1], 1)
        weights = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(weights, v.to(compute)).to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    read_rows: torch.Tensor,
    key_bias: torch.Tensor,
    scale: float,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence. q: [seqs, heads, d]; read_rows: the flat K rows of every
    sequence's pages, padded to the widest block table ([seqs * width]); key_bias: [seqs, 1, 1,
    width], 0 for a sequence's keys and -inf past its length. Slots past a sequence's length are
    read but get zero weight: the pool is zero-initialised and only ever holds finite K/V.

    The query heads that share a KV head are laid out as that head's query rows ([seqs, kv_heads,
    group, d]), so each key is read once per KV head rather than once per query head (faster on
    the CPU than SDPA's own GQA expansion: docs/benchmarks.md). A window is in `key_bias`
    (`window_bias`); a soft-cap or sinks take `written_attention`."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    width = key_bias.shape[-1]
    flat = kv_cache.view(-1, num_kv_heads, head_dim)
    keys = flat.index_select(0, read_rows).view(num_seqs, width, num_kv_heads, head_dim).transpose(1, 2)
    values = flat.index_select(0, read_rows + page_size).view(num_seqs, width, num_kv_heads, head_dim).transpose(1, 2)
    group = num_heads // num_kv_heads
    queries = q.view(num_seqs, num_kv_heads, group, head_dim)
    if soft_cap or sinks is not None:
        # A sequence's query rows are the group's heads: head h's sink sits at [h // group, h % group].
        head_sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1)
        attended = written_attention(queries, keys, values, key_bias, scale, soft_cap, head_sinks)
    else:
        attended = F.scaled_dot_product_attention(
            queries,
            keys.to(q.dtype),
            values.to(q.dtype),
            attn_mask=key_bias.to(q.dtype),  # a no-op unless the plan was built for another dtype
            scale=scale,
        )
    return attended.reshape(num_seqs, num_heads, head_dim)


def attend_decodes(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    decode: DecodeRows,
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention` over a plan's decoding rows, their mask narrowed to the layer's window."""
    bias = window_bias(decode.key_bias, decode.seq_lens, window) if window else decode.key_bias
    return decode_attention(q, kv_cache, decode.read_rows, bias, scale, soft_cap, sinks)


def attend_prompts(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    skip: frozenset[int] = frozenset(),
    window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """One SDPA per sequence of the batch (except those in `skip`), written into `out`; their
    K/V must already be in the cache. A whole prompt runs `is_causal`; a chunk after a cached
    prefix, or one new token, a mask offset by the prefix. A layer with a window, a soft-cap or
    sinks takes `attend_masked` instead, with its mask written out."""
    _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    starts = metadata.query_start_loc_cpu
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        if i in skip:
            continue
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if window or soft_cap or sinks is not None:
            out[start:end] = attend_masked(
                q[start:end], kv_cache, metadata.block_tables[i], seq_len, scale, window, soft_cap, sinks
            )
            continue
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


def attend_masked(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    window: int,
    soft_cap: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's new tokens, q: [q_len, heads, d] at the last q_len of its seq_len
    positions, with the mask written out: causal, and with a window each query at p sees only
    keys j with p - window < j <= p. Only the keys some query can see are gathered (from the
    first query's window on), so a chunk after a long prefix reads a window's worth of pages."""
    _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    q_len, num_heads, _ = q.shape
    first_query = seq_len - q_len
    first_key = max(0, first_query - window + 1) if window else 0
    first_page, num_pages = first_key // page_size, -(-seq_len // page_size)
    pages = kv_cache[block_table[first_page:num_pages]]  # [p, 2, page, kvh, d]
    skipped = first_page * page_size  # the keys of the pages not read
    keys = pages[:, 0].reshape(-1, num_kv_heads, head_dim)[first_key - skipped : seq_len - skipped]
    values = pages[:, 1].reshape(-1, num_kv_heads, head_dim)[first_key - skipped : seq_len - skipped]
    query_pos = torch.arange(first_query, seq_len, device=q.device)[:, None]
    key_pos = torch.arange(first_key, seq_len, device=q.device)[None, :]
    visible = key_pos <= query_pos
    if window:
        visible &= key_pos > query_pos - window
    if soft_cap or sinks is not None:
        # Query head h reads KV head h // group: the group's query rows face their KV head's keys.
        group = num_heads // num_kv_heads
        queries = q.transpose(0, 1).reshape(num_kv_heads, group, q_len, head_dim)
        head_sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1, 1)
        # The scores are written out: a long prompt takes its queries a slice at a time, so that
        # they never hold more than WRITTEN_SCORES at once.
        step = max(1, WRITTEN_SCORES // (num_heads * keys.shape[0]))
        attended = torch.cat(
            [
                written_attention(
                    queries[:, :, first : first + step],
                    keys.transpose(0, 1)[:, None],  # [kvh, 1, keys, d]
                    values.transpose(0, 1)[:, None],
                    visible[first : first + step],
                    scale,
                    soft_cap,
                    head_sinks,
                )
                for first in range(0, q_len, step)
            ],
            dim=2,
        )
    else:
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, heads, q_len, d]
            keys.transpose(0, 1).to(q.dtype)[None],
            values.transpose(0, 1).to(q.dtype)[None],
            attn_mask=visible,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
    return attended.reshape(num_heads, q_len, head_dim).transpose(0, 1)


def paged_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: TorchPlan,
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the new K/V, then attend: decoding sequences batched, the others one SDPA each."""
    write_kv(k, v, kv_cache, plan.slot_mapping, plan.write_rows)
    decode = plan.decode
    if plan.metadata is None:  # every sequence decodes
        assert decode is not None
        return attend_decodes(q, kv_cache, decode, scale, window, soft_cap, sinks)
    out = torch.empty_like(q)
    if decode is not None and decode.tokens is not None:  # the decoding sequences of a mixed batch, in one call
        out[decode.tokens] = attend_decodes(q[decode.tokens], kv_cache, decode, scale, window, soft_cap, sinks)
    skip = decode.seqs if decode is not None else frozenset()
    attend_prompts(q, kv_cache, plan.metadata, scale, out, skip, window, soft_cap, sinks)
    return out
