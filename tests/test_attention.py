"""AttentionMetadata.build and the torch reference backend, checked against a dense float64
causal attention written here from the definition, with and without a sliding window, a logit
soft-cap and attention sinks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiled_engine.attention import paged, selector
from compiled_engine.attention.backend import AttentionShape
from compiled_engine.attention.metadata import AttentionMetadata, GraphMetadata
from compiled_engine.attention.paged import write_kv
from compiled_engine.attention.selector import get_backend, layer_kinds_reason
from compiled_engine.attention.torch_backend import TorchAttentionBackend

CPU = torch.device("cpu")


def slot(table: list[int], pos: int, page_size: int) -> int:
    return table[pos // page_size] * page_size + pos % page_size


def dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [q_len, H, d] for the last q_len positions; k, v: [seq_len, KVH, d] of the whole
    sequence. Plain causal softmax attention in float64; with a window W a query at p sees only
    keys j with p - W < j <= p; with a soft-cap c the logits s become c * tanh(s / c) first; with
    sinks [H], head h's weights are exp(s_j) / (sum_j exp(s_j) + exp(sinks[h]))."""
    q, k, v = q.double(), k.double(), v.double()
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    hidden = key_pos > query_pos
    if window:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    exps = scores.exp()  # the test logits are small: no shift needed in float64
    denominator = exps.sum(dim=-1, keepdim=True) + sinks.double().exp()[:, None, None]
    return torch.einsum("hqk,khd->qhd", exps / denominator, v)


# ---------------------------------------------------------------------------------------------
# metadata


def test_build_slot_mapping_non_contiguous_pages() -> None:
    md = AttentionMetadata.build(
        query_lens=[10, 3, 1],
        seq_lens=[10, 10, 5],
        block_tables=[[7, 2, 9], [4, 0, 11], [5, 6]],
        page_size=4,
        device=CPU,
    )
    expected = [
        *[28, 29, 30, 31, 8, 9, 10, 11, 36, 37],  # positions 0..9 over pages 7, 2, 9
        *[3, 44, 45],  # positions 7, 8, 9: end of page 0, then into page 11
        24,  # position 4: first slot of the second page (6)
    ]
    assert md.slot_mapping.tolist() == expected
    assert md.slot_mapping.dtype == torch.int64
    assert md.query_start_loc.tolist() == md.query_start_loc_cpu == [0, 10, 13, 14]
    assert md.query_start_loc.dtype == torch.int32
    assert md.seq_lens.tolist() == md.seq_lens_cpu == [10, 10, 5]
    assert md.seq_lens.dtype == torch.int32
    assert md.block_tables.tolist() == [[7, 2, 9], [4, 0, 11], [5, 6, 0]]
    assert md.block_tables.dtype == torch.int32
    assert (md.num_seqs, md.num_tokens) == (3, 14)


def test_build_page_size_one_and_exact_fit() -> None:
    md = AttentionMetadata.build([2], [3], [[9, 4, 7]], page_size=1, device=CPU)
    assert md.slot_mapping.tolist() == [4, 7]
    md = AttentionMetadata.build([8], [8], [[3, 1]], page_size=4, device=CPU)
    assert md.slot_mapping.tolist() == [12, 13, 14, 15, 4, 5, 6, 7]


def test_build_empty_batch() -> None:
    md = AttentionMetadata.build([], [], [], page_size=4, device=CPU)
    assert md.num_seqs == 0 and md.num_tokens == 0
    assert md.block_tables.shape == (0, 0)
    assert md.slot_mapping.shape == (0,)


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_build_slot_mapping_property(data: st.DataObject) -> None:
    page_size = data.draw(st.integers(1, 8))
    num_seqs = data.draw(st.integers(1, 4))
    seq_lens = [data.draw(st.integers(1, 30)) for _ in range(num_seqs)]
    query_lens = [data.draw(st.integers(1, s)) for s in seq_lens]
    pages_needed = [math.ceil(s / page_size) for s in seq_lens]
    extra = [data.draw(st.integers(0, 2)) for _ in range(num_seqs)]  # tables may hold spare pages
    pool = data.draw(st.permutations(range(sum(pages_needed) + sum(extra))))
    tables, at = [], 0
    for n in (p + e for p, e in zip(pages_needed, extra, strict=True)):
        tables.append(list(pool[at : at + n]))
        at += n
    md = AttentionMetadata.build(query_lens, seq_lens, tables, page_size, CPU)
    expected = [
        slot(table, pos, page_size)
        for q, s, table in zip(query_lens, seq_lens, tables, strict=True)
        for pos in range(s - q, s)
    ]
    assert md.slot_mapping.tolist() == expected
    assert len(set(expected)) == len(expected)
    assert md.num_tokens == sum(query_lens)
    assert md.block_tables.shape == (num_seqs, max(len(t) for t in tables))


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "tables", "message"),
    [
        (
            [1, 1],
            [1],
            [[0]],
            "query_lens, seq_lens and block_tables must have one entry per sequence",
        ),
        (
            [1],
            [1, 1],
            [[0]],
            "query_lens, seq_lens and block_tables must have one entry per sequence",
        ),
        (
            [1],
            [1],
            [[0], [1]],
            "query_lens, seq_lens and block_tables must have one entry per sequence",
        ),
        ([5], [4], [[0]], r"query length 5 must be in 1\.\.4"),
        ([0], [4], [[0]], r"query length 0 must be in 1\.\.4"),
        ([-1], [4], [[0]], r"query length -1 must be in 1\.\.4"),
        ([1], [9], [[0, 1]], "2 pages cannot hold 9 tokens"),
        ([1, 1], [4, 5], [[0], [1]], "1 pages cannot hold 5 tokens"),
        ([1], [1], [[]], "0 pages cannot hold 1 tokens"),
    ],
)
def test_build_errors(query_lens: list[int], seq_lens: list[int], tables: list[list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(query_lens, seq_lens, tables, page_size=4, device=CPU)


def test_get_backend() -> None:
    assert isinstance(get_backend("torch"), TorchAttentionBackend)
    assert get_backend("torch").name == "torch"
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash' \(available: torch, cpu, flashinfer\)"):
        get_backend("flash")
    # on CPU the default is the cpu backend (tests/test_cpu_attention.py); an explicit
    # flashinfer falls back to torch
    shape = AttentionShape(4, 2, 64, 16, torch.float32, CPU)
    assert get_backend("flashinfer", shape).name == "torch"


# ---------------------------------------------------------------------------------------------
# write_kv


def test_write_kv_lands_in_slots() -> None:
    torch.manual_seed(0)
    num_pages, page_size, kvh, d = 5, 4, 2, 3
    cache = torch.full((num_pages, 2, page_size, kvh, d), float("nan"), dtype=torch.float64)
    slots = [17, 3, 4, 19, 0]
    k = torch.randn(len(slots), kvh, d, dtype=torch.float32)
    v = torch.randn(len(slots), kvh, d, dtype=torch.float32)
    write_kv(k, v, cache, torch.tensor(slots, dtype=torch.int64))
    written = set()
    for t, s in enumerate(slots):
        page, off = divmod(s, page_size)
        assert torch.equal(cache[page, 0, off], k[t].double())
        assert torch.equal(cache[page, 1, off], v[t].double())
        written.add((page, off))
    for page in range(num_pages):
        for off in range(page_size):
            if (page, off) not in written:
                assert torch.isnan(cache[page, :, off]).all()


def test_write_kv_casts_to_cache_dtype() -> None:
    cache = torch.zeros(2, 2, 2, 1, 2, dtype=torch.bfloat16)
    k = torch.tensor([[[1.0 + 2**-12, -3.0]]])
    v = torch.tensor([[[0.5, 7.0]]])
    write_kv(k, v, cache, torch.tensor([3]))
    assert cache.dtype == torch.bfloat16
    assert cache[1, 0, 1].tolist() == [[1.0, -3.0]]
    assert cache[1, 1, 1].tolist() == [[0.5, 7.0]]
    assert cache[0].abs().sum() == 0


# ---------------------------------------------------------------------------------------------
# backend against the dense reference

PAGE_SIZE = 4
NUM_HEADS = 4
HEAD_DIM = 8
# Fills slots nobody wrote. Decoding rows read whole pages and give the slots past a sequence's
# end zero weight, which needs finite values (the real pool is zero-initialised), so the tests
# poison with a huge finite value: read with any weight, it would dominate the output.
GARBAGE = 1e4


class Sequence:
    def __init__(self, cached: int, new: int, num_kv_heads: int, gen: torch.Generator) -> None:
        self.cached, self.new = cached, new
        self.seq_len = cached + new
        self.q = torch.randn(new, NUM_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
        self.k = torch.randn(self.seq_len, num_kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64)
        self.v = torch.randn(self.seq_len, num_kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64)
        self.table: list[int] = []


def place_prefix(cache: torch.Tensor, seq: Sequence) -> None:
    """Put the cached prefix's K/V in its pages by hand (independently of write_kv)."""
    for pos in range(seq.cached):
        page, off = seq.table[pos // PAGE_SIZE], pos % PAGE_SIZE
        cache[page, 0, off] = seq.k[pos].to(cache.dtype)
        cache[page, 1, off] = seq.v[pos].to(cache.dtype)


def run_batch(seqs: list[Sequence], cache: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    md = AttentionMetadata.build(
        [s.new for s in seqs], [s.seq_len for s in seqs], [s.table for s in seqs], PAGE_SIZE, CPU
    )
    q = torch.cat([s.q for s in seqs]).to(dtype)
    k = torch.cat([s.k[s.cached :] for s in seqs]).to(dtype)
    v = torch.cat([s.v[s.cached :] for s in seqs]).to(dtype)
    out = TorchAttentionBackend().attend(q, k, v, cache, md, scale)
    assert out.shape == q.shape and out.dtype == dtype
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # GQA ratios 1, 2, 4
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_matches_dense_reference(num_kv_heads: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    seqs = [
        Sequence(cached=6, new=5, num_kv_heads=num_kv_heads, gen=gen),  # prefill over a cached prefix
        Sequence(cached=9, new=1, num_kv_heads=num_kv_heads, gen=gen),  # decode
        Sequence(cached=0, new=7, num_kv_heads=num_kv_heads, gen=gen),  # fresh prefill
        Sequence(cached=0, new=1, num_kv_heads=num_kv_heads, gen=gen),  # one-token prompt
    ]
    needed = [math.ceil(s.seq_len / PAGE_SIZE) for s in seqs]
    num_pages = sum(needed) + 3  # spare pages that nobody owns
    perm = torch.randperm(num_pages, generator=gen).tolist()
    at = 0
    for s, n in zip(seqs, needed, strict=True):
        s.table, at = perm[at : at + n], at + n
    # Garbage everywhere no sequence writes: reading a wrong slot with any weight poisons the output.
    cache = torch.full((num_pages, 2, PAGE_SIZE, num_kv_heads, HEAD_DIM), GARBAGE, dtype=dtype)
    for s in seqs:
        place_prefix(cache, s)
    scale = 1 / math.sqrt(HEAD_DIM)

    out = run_batch(seqs, cache, dtype, scale)

    start = 0
    for s in seqs:
        expected = dense_reference(s.q, s.k, s.v, scale)
        got = out[start : start + s.new].double()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        start += s.new
    # Every K/V is in its slot; every other slot is untouched.
    touched = torch.zeros(num_pages, PAGE_SIZE, dtype=torch.bool)
    for s in seqs:
        for pos in range(s.seq_len):
            page, off = s.table[pos // PAGE_SIZE], pos % PAGE_SIZE
            torch.testing.assert_close(cache[page, 0, off].double(), s.k[pos], atol=1e-6, rtol=0)
            torch.testing.assert_close(cache[page, 1, off].double(), s.v[pos], atol=1e-6, rtol=0)
            touched[page, off] = True
    assert (cache.permute(0, 2, 1, 3, 4)[~touched] == GARBAGE).all()


def test_reference_is_not_trivially_satisfied() -> None:
    # The check above must be able to fail: a wrong GQA grouping or a missing causal mask
    # gives outputs far from the reference.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(5, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(5, 2, 8, generator=gen, dtype=torch.float64)
    ref = dense_reference(q, k, v, 0.35)
    tiled = dense_reference(q, k.repeat(1, 2, 1), v.repeat(1, 2, 1), 0.35)  # heads grouped wrongly
    assert (ref - tiled).abs().max() > 1e-2
    # Without the mask the first query would see all five keys.
    scores = torch.einsum("hd,khd->hk", q[0], k.repeat_interleave(2, 1)) * 0.35
    unmasked = torch.einsum("hk,khd->hd", scores.softmax(-1), v.repeat_interleave(2, 1))
    assert (ref[0] - unmasked).abs().max() > 1e-2
    # The first query sees only the first key: its output is that key's value.
    torch.testing.assert_close(ref[0], v[0].repeat_interleave(2, 0))


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_chunked_prefill_matches_single_pass(num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(7)
    total = 10
    seq = Sequence(cached=0, new=total, num_kv_heads=num_kv_heads, gen=gen)
    table = [5, 1, 3]  # non-contiguous, 3 pages of 4 hold 10 tokens
    scale = 0.3

    whole_cache = torch.full((6, 2, PAGE_SIZE, num_kv_heads, HEAD_DIM), GARBAGE, dtype=torch.float64)
    seq.table = table
    whole = run_batch([seq], whole_cache, torch.float64, scale)

    chunk_cache = torch.full_like(whole_cache, GARBAGE)
    outs, done = [], 0
    for size in (5, 3, 1, 1):
        part = Sequence.__new__(Sequence)
        part.cached, part.new, part.seq_len = done, size, done + size
        part.q = seq.q[done : done + size]
        part.k, part.v = seq.k[: done + size], seq.v[: done + size]
        part.table = table[: math.ceil((done + size) / PAGE_SIZE)]  # grows with the sequence
        outs.append(run_batch([part], chunk_cache, torch.float64, scale))
        done += size

    chunked = torch.cat(outs)
    torch.testing.assert_close(chunked, whole, atol=1e-12, rtol=0)
    torch.testing.assert_close(whole, dense_reference(seq.q, seq.k, seq.v, scale), atol=1e-10, rtol=0)
    assert torch.equal(chunk_cache.isnan(), whole_cache.isnan())
    torch.testing.assert_close(chunk_cache.nan_to_num(), whole_cache.nan_to_num(), atol=0, rtol=0)


def test_decode_steps_match_reference_one_by_one() -> None:
    """Token-by-token generation: each decode step sees exactly the tokens before it."""
    gen = torch.Generator().manual_seed(11)
    seq = Sequence(cached=0, new=9, num_kv_heads=2, gen=gen)
    table = [2, 0, 4]
    cache = torch.full((5, 2, PAGE_SIZE, 2, HEAD_DIM), GARBAGE, dtype=torch.float64)
    for pos in range(9):
        step = Sequence.__new__(Sequence)
        step.cached, step.new, step.seq_len = pos, 1, pos + 1
        step.q, step.k, step.v = seq.q[pos : pos + 1], seq.k[: pos + 1], seq.v[: pos + 1]
        step.table = table
        out = run_batch([step], cache, torch.float64, 0.5)
        expected = dense_reference(step.q, step.k, step.v, 0.5)
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_decode_only_batch_uses_the_batched_path_and_matches_reference(num_kv_heads: int) -> None:
    """Decode-only batches take one batched SDPA over padded block tables; contexts of different
    lengths, across page boundaries, in a cache filled with large garbage where nobody wrote (read
    with any weight, it would dominate the output)."""
    gen = torch.Generator().manual_seed(11)
    seqs = [Sequence(cached=c, new=1, num_kv_heads=num_kv_heads, gen=gen) for c in (0, 3, 4, 9, 14)]
    needed = [math.ceil(s.seq_len / PAGE_SIZE) for s in seqs]
    num_pages = sum(needed) + 2
    perm = torch.randperm(num_pages, generator=gen).tolist()
    at = 0
    for s, n in zip(seqs, needed, strict=True):
        s.table, at = perm[at : at + n], at + n
    cache = torch.full((num_pages, 2, PAGE_SIZE, num_kv_heads, HEAD_DIM), GARBAGE, dtype=torch.float64)
    for s in seqs:
        place_prefix(cache, s)
    md = AttentionMetadata.build([1] * len(seqs), [s.seq_len for s in seqs], [s.table for s in seqs], PAGE_SIZE, CPU)
    assert md.decode_only
    out = run_batch(seqs, cache, torch.float64, 0.3)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[i : i + 1], dense_reference(s.q, s.k, s.v, 0.3), atol=1e-10, rtol=0)
    assert not AttentionMetadata.build([2, 1], [5, 5], [[0, 1], [2, 3]], PAGE_SIZE, CPU).decode_only


# ---------------------------------------------------------------------------------------------
# sliding windows and logit soft-caps against the dense reference

# A soft-cap small enough to bite: with SCALE the raw logits spread well past it.
SOFT_CAP = 5.0
SCALE = 0.9


def place_batch(seqs: list[Sequence], num_kv_heads: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Give the sequences shuffled pages (and spare ones nobody owns) in a cache of garbage, with
    their cached prefixes in place."""
    needed = [math.ceil(s.seq_len / PAGE_SIZE) for s in seqs]
    num_pages = sum(needed) + 2
    perm = torch.randperm(num_pages, generator=gen).tolist()
    at = 0
    for s, n in zip(seqs, needed, strict=True):
        s.table, at = perm[at : at + n], at + n
    cache = torch.full((num_pages, 2, PAGE_SIZE, num_kv_heads, HEAD_DIM), GARBAGE, dtype=dtype)
    for s in seqs:
        place_prefix(cache, s)
    return cache


# (cached, new) per sequence; PAGE_SIZE 4, so the windows below cross page boundaries.
WINDOW_BATCHES = {
    # contexts shorter than, equal to and far longer than the windows: one batched call
    "decode": [(0, 1), (2, 1), (5, 1), (9, 1), (16, 1), (30, 1)],
    # a chunk after a cached prefix, decodes (batched beside the prompts), a whole prompt longer
    # than the windows, a one-token prompt and a short chunk
    "mixed": [(6, 5), (9, 1), (0, 13), (20, 1), (0, 1), (13, 3)],
    # one chunk whose queries' windows start on both sides of a page boundary
    "chunk": [(25, 9)],
}


@pytest.mark.parametrize("soft_cap", [0.0, SOFT_CAP])
@pytest.mark.parametrize("window", [0, 1, 3, 6, 17])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("kind", sorted(WINDOW_BATCHES))
def test_window_and_soft_cap_match_dense_reference(kind: str, num_kv_heads: int, window: int, soft_cap: float) -> None:
    gen = torch.Generator().manual_seed(5)
    seqs = [Sequence(cached=c, new=n, num_kv_heads=num_kv_heads, gen=gen) for c, n in WINDOW_BATCHES[kind]]
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        cache = place_batch(seqs, num_kv_heads, dtype, gen)
        md = AttentionMetadata.build(
            [s.new for s in seqs], [s.seq_len for s in seqs], [s.table for s in seqs], PAGE_SIZE, CPU
        )
        q = torch.cat([s.q for s in seqs]).to(dtype)
        k = torch.cat([s.k[s.cached :] for s in seqs]).to(dtype)
        v = torch.cat([s.v[s.cached :] for s in seqs]).to(dtype)
        out = TorchAttentionBackend(dtype).attend(q, k, v, cache, md, SCALE, window, soft_cap)
        assert out.dtype == dtype
        start = 0
        for s in seqs:
            expected = dense_reference(s.q, s.k, s.v, SCALE, window, soft_cap)
            torch.testing.assert_close(out[start : start + s.new].double(), expected, atol=tolerance, rtol=0)
            start += s.new


@pytest.mark.parametrize(("window", "soft_cap"), [(3, 0.0), (6, SOFT_CAP), (0, SOFT_CAP)])
def test_a_graph_plan_applies_window_and_soft_cap(window: int, soft_cap: float) -> None:
    """The CUDA-graph decode plan (device tensors only) masks each row's window from its length."""
    gen = torch.Generator().manual_seed(13)
    seqs = [Sequence(cached=c, new=1, num_kv_heads=2, gen=gen) for c in (0, 4, 7, 18)]
    cache = place_batch(seqs, 2, torch.float64, gen)
    md = AttentionMetadata.build([1] * len(seqs), [s.seq_len for s in seqs], [s.table for s in seqs], PAGE_SIZE, CPU)
    graph = GraphMetadata(md.seq_lens, md.block_tables, md.slot_mapping, PAGE_SIZE)
    backend = TorchAttentionBackend(torch.float64)
    q = torch.cat([s.q for s in seqs])
    k = torch.cat([s.k[s.cached :] for s in seqs])
    v = torch.cat([s.v[s.cached :] for s in seqs])
    out = backend.forward(q, k, v, cache, backend.prepare_graph(graph), SCALE, window, soft_cap)
    for i, s in enumerate(seqs):
        expected = dense_reference(s.q, s.k, s.v, SCALE, window, soft_cap)
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-10, rtol=0)


def test_window_and_soft_cap_references_are_not_trivially_satisfied() -> None:
    # The checks above must be able to fail: over these contexts the window and the cap each
    # change the result, and a window as long as the context changes nothing.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(9, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(30, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(30, 2, 8, generator=gen, dtype=torch.float64)
    full = dense_reference(q, k, v, SCALE)
    assert (dense_reference(q, k, v, SCALE, window=6) - full).abs().max() > 1e-2
    assert (dense_reference(q, k, v, SCALE, window=29) - full).abs().max() > 1e-2  # only the first query differs
    assert (dense_reference(q, k, v, SCALE, soft_cap=SOFT_CAP) - full).abs().max() > 1e-2
    torch.testing.assert_close(dense_reference(q, k, v, SCALE, window=30), full, atol=0, rtol=0)
    # A window of one key: each query sees only itself, its output that key's value.
    torch.testing.assert_close(dense_reference(q, k, v, SCALE, window=1), v[21:].repeat_interleave(2, 1))


def test_layer_kinds_and_the_selector() -> None:
    """A backend that lacks a layer kind the model uses is refused (never silently wrong)."""
    sliding = AttentionShape(4, 2, 64, 16, torch.float32, CPU, layer_kinds=((0, 0.0), (4096, 50.0)))
    assert AttentionShape(4, 2, 64, 16, torch.float32, CPU).layer_kinds == ((0, 0.0),)
    assert get_backend("torch", sliding).name == "torch"

    class NoWindows(TorchAttentionBackend):
        name = "no-windows"
        supports_sliding_window = False

    assert layer_kinds_reason(NoWindows, sliding) == (
        "the no-windows backend has no sliding-window attention (the model's layers slide over [4096] tokens)"
    )
    assert layer_kinds_reason(NoWindows, AttentionShape(4, 2, 64, 16, torch.float32, CPU)) is None
    capped = AttentionShape(4, 2, 64, 16, torch.float32, CPU, layer_kinds=((0, 30.0),))
    assert layer_kinds_reason(NoWindows, capped) is None
    assert "cannot soft-cap attention logits (the model caps them at [30.0])" in str(
        layer_kinds_reason(type("NoCap", (TorchAttentionBackend,), {"supports_soft_cap": False}), capped)
    )


def test_the_selector_refuses_a_model_no_backend_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoWindows(TorchAttentionBackend):
        supports_sliding_window = False

    monkeypatch.setitem(selector.REGISTRY, "torch", NoWindows)
    monkeypatch.setattr(selector, "FALLBACK", NoWindows)
    sliding = AttentionShape(4, 2, 64, 16, torch.float32, CPU, layer_kinds=((0, 0.0), (512, 0.0)))
    with pytest.raises(ValueError, match=r"no attention backend can run this model: .* slide over \[512\] tokens"):
        get_backend("torch", sliding)
    assert get_backend("torch", AttentionShape(4, 2, 64, 16, torch.float32, CPU)).name == "torch"


# ---------------------------------------------------------------------------------------------
# attention sinks (gpt-oss): one learned logit per query head in each softmax's denominator


def sink_logits(gen: torch.Generator) -> torch.Tensor:
    # Spread around the scores' own size, so some heads give the sink most of their weight.
    return (torch.randn(NUM_HEADS, generator=gen, dtype=torch.float64) * 2.0).float()


@pytest.mark.parametrize(("window", "soft_cap"), [(0, 0.0), (3, 0.0), (6, SOFT_CAP)])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
@pytest.mark.parametrize("kind", sorted(WINDOW_BATCHES))
def test_sinks_match_dense_reference(kind: str, num_kv_heads: int, window: int, soft_cap: float) -> None:
    gen = torch.Generator().manual_seed(21)
    seqs = [Sequence(cached=c, new=n, num_kv_heads=num_kv_heads, gen=gen) for c, n in WINDOW_BATCHES[kind]]
    sinks = sink_logits(gen)
    for dtype, tolerance in ((torch.float64, 1e-6), (torch.float32, 2e-5)):
        cache = place_batch(seqs, num_kv_heads, dtype, gen)
        md = AttentionMetadata.build(
            [s.new for s in seqs], [s.seq_len for s in seqs], [s.table for s in seqs], PAGE_SIZE, CPU
        )
        q = torch.cat([s.q for s in seqs]).to(dtype)
        k = torch.cat([s.k[s.cached :] for s in seqs]).to(dtype)
        v = torch.cat([s.v[s.cached :] for s in seqs]).to(dtype)
        out = TorchAttentionBackend(dtype).attend(q, k, v, cache, md, SCALE, window, soft_cap, sinks)
        assert out.dtype == dtype
        start = 0
        for s in seqs:
            expected = dense_reference(s.q, s.k, s.v, SCALE, window, soft_cap, sinks)
            torch.testing.assert_close(out[start : start + s.new].double(), expected, atol=tolerance, rtol=0)
            start += s.new


def test_a_graph_plan_applies_sinks() -> None:
    gen = torch.Generator().manual_seed(17)
    seqs = [Sequence(cached=c, new=1, num_kv_heads=2, gen=gen) for c in (0, 4, 7, 18)]
    sinks = sink_logits(gen)
    cache = place_batch(seqs, 2, torch.float64, gen)
    md = AttentionMetadata.build([1] * len(seqs), [s.seq_len for s in seqs], [s.table for s in seqs], PAGE_SIZE, CPU)
    graph = GraphMetadata(md.seq_lens, md.block_tables, md.slot_mapping, PAGE_SIZE)
    backend = TorchAttentionBackend(torch.float64)
    q = torch.cat([s.q for s in seqs])
    k = torch.cat([s.k[s.cached :] for s in seqs])
    v = torch.cat([s.v[s.cached :] for s in seqs])
    out = backend.forward(q, k, v, cache, backend.prepare_graph(graph), SCALE, 3, 0.0, sinks)
    for i, s in enumerate(seqs):
        expected = dense_reference(s.q, s.k, s.v, SCALE, 3, sinks=sinks)
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-6, rtol=0)


def test_sink_reference_is_not_trivially_satisfied() -> None:
    # A sink takes weight from the keys: the output shrinks toward zero, more the larger the sink.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(9, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(30, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(30, 2, 8, generator=gen, dtype=torch.float64)
    full = dense_reference(q, k, v, SCALE)
    assert (dense_reference(q, k, v, SCALE, sinks=torch.zeros(4)) - full).abs().max() > 1e-2
    far_below = dense_reference(q, k, v, SCALE, sinks=torch.full((4,), -60.0))
    torch.testing.assert_close(far_below, full, atol=1e-12, rtol=0)
    far_above = dense_reference(q, k, v, SCALE, sinks=torch.full((4,), 60.0))
    assert far_above.abs().max() < 1e-12


def test_the_selector_refuses_a_backend_without_sinks() -> None:
    with_sinks = AttentionShape(4, 2, 64, 16, torch.float32, CPU, sinks=True)
    assert layer_kinds_reason(TorchAttentionBackend, with_sinks) is None
    no_sinks = type("NoSinks", (TorchAttentionBackend,), {"name": "no-sinks", "supports_sinks": False})
    assert layer_kinds_reason(no_sinks, with_sinks) == (
        "the no-sinks backend has no attention sinks (the model's layers have them)"
    )
    assert layer_kinds_reason(no_sinks, AttentionShape(4, 2, 64, 16, torch.float32, CPU)) is None
    assert not selector.REGISTRY["flashinfer"].supports_sinks  # not wired to FlashInfer: refused, never ignored


def test_a_long_prompt_takes_its_written_out_scores_a_slice_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for only a few queries' scores at once, the same result, slice by slice."""
    gen = torch.Generator().manual_seed(23)
    seqs = [Sequence(cached=c, new=n, num_kv_heads=2, gen=gen) for c, n in ((6, 13), (0, 9))]
    sinks = sink_logits(gen)
    cache = place_batch(seqs, 2, torch.float64, gen)
    md = AttentionMetadata.build(
        [s.new for s in seqs], [s.seq_len for s in seqs], [s.table for s in seqs], PAGE_SIZE, CPU
    )
    q = torch.cat([s.q for s in seqs])
    k = torch.cat([s.k[s.cached :] for s in seqs])
    v = torch.cat([s.v[s.cached :] for s in seqs])
    monkeypatch.setattr(paged, "WRITTEN_SCORES", NUM_HEADS * 19 * 3)  # three queries of the longer prompt
    out = TorchAttentionBackend(torch.float64).attend(q, k, v, cache, md, SCALE, 5, SOFT_CAP, sinks)
    start = 0
    for s in seqs:
        expected = dense_reference(s.q, s.k, s.v, SCALE, 5, SOFT_CAP, sinks)
        torch.testing.assert_close(out[start : start + s.new], expected, atol=1e-6, rtol=0)
        start += s.new
