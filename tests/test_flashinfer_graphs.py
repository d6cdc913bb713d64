"""The FlashInfer CUDA-graph protocol, checked on the CPU with a stand-in for flashinfer: one
decode wrapper per captured size over fixed index buffers, planned from host lists (padding rows
one page of length 1 on the scratch page, indptr non-decreasing) before each capture and replay
and never inside a capture, and what the planned wrapper computes equal to the torch backend.

Also the layer kinds (sliding window, logit soft-cap): one wrapper per kind, eager and per
captured size, each planned with its kind's `window_left` and `logits_soft_cap`, and each
layer's call running its kind's wrapper. The stand-ins apply those two options as FlashInfer's
documentation describes them; whether FlashInfer itself does is for the GPU test
(tests/test_flashinfer.py)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from compiled_engine.attention.backend import FULL_ATTENTION, AttentionShape, LayerKind
from compiled_engine.attention.metadata import AttentionMetadata, GraphMetadata
from compiled_engine.attention.torch_backend import TorchAttentionBackend
from compiled_engine.executor.cuda_graphs import CudaGraphRunner, DecodeBuffers
from tests.cuda_graph_stand_ins import RecordingGraph, use_stand_ins

CPU = torch.device("cpu")
PAGE = 4


def stand_in_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window_left: int, soft_cap: float
) -> torch.Tensor:
    """One sequence's q: [q_len, heads, d], the last q_len of its len(keys) positions, causal;
    `window_left` >= 0 keys left of each query's own (-1: all), logits capped when soft_cap > 0."""
    group = q.shape[1] // keys.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(group, 1)) * scale
    if soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    query_pos = torch.arange(len(keys) - len(q), len(keys))[:, None]
    key_pos = torch.arange(len(keys))[None, :]
    hidden = key_pos > query_pos
    if window_left >= 0:
        hidden |= key_pos < query_pos - window_left
    weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, values.repeat_interleave(group, 1))


def stand_in_pages(
    cache: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, seq: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `seq`'s keys and values, read through FlashInfer's page table."""
    pages = indices[int(indptr[seq]) : int(indptr[seq + 1])]
    length = (len(pages) - 1) * page_size + int(last[seq])
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    keys = cache[pages, 0].reshape(-1, kv_heads, head_dim)[:length]
    return keys, cache[pages, 1].reshape(-1, kv_heads, head_dim)[:length]


class StandInDecodeWrapper:
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper's contract in plain torch: plan() copies
    the page table into the fixed buffers (graph mode) and run() reads them, as a replayed
    kernel would."""

    def __init__(
        self,
        workspace: torch.Tensor,
        layout: str,
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
    ) -> None:
        assert layout == "NHD"
        self.graph = use_cuda_graph
        self.indptr, self.indices, self.last = (
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )
        if use_cuda_graph:
            assert self.indptr is not None and self.indices is not None and self.last is not None
            assert self.indptr.dtype == self.indices.dtype == self.last.dtype == torch.int32
        self.plans = 0

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **options: Any,
    ) -> None:
        assert not RecordingGraph.capturing, "plan() inside a graph capture"
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32
        assert bool((indptr[1:] >= indptr[:-1]).all()), "indptr must not decrease"
        assert bool(((last >= 1) & (last <= page_size)).all())
        if self.graph:
            assert self.last is not None and self.indptr is not None and self.indices is not None
            assert len(last) == len(self.last), "the batch size is fixed in graph mode"
            self.indptr.copy_(indptr)
            self.last.copy_(last)
            self.indices[: len(indices)].copy_(indices)
        else:
            self.indptr, self.indices, self.last = indptr, indices, last
        self.heads, self.scale, self.page_size = num_qo_heads, options["sm_scale"], page_size
        self.window_left, self.soft_cap = options.get("window_left", -1), options.get("logits_soft_cap") or 0.0
        self.plans += 1

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        assert self.indptr is not None and self.indices is not None and self.last is not None
        out = torch.empty_like(q)
        for row in range(q.shape[0]):
            keys, values = stand_in_pages(kv_cache, self.indptr, self.indices, self.last, row, self.page_size)
            out[row] = stand_in_attention(q[row : row + 1], keys, values, self.scale, self.window_left, self.soft_cap)[
                0
            ]
        return out


class StandInPrefillWrapper:
    """flashinfer.BatchPrefillWithPagedKVCacheWrapper's contract in plain torch: each sequence's
    new tokens (qo_indptr) attend causally over its pages."""

    def __init__(self, workspace: torch.Tensor, layout: str) -> None:
        assert layout == "NHD"

    def plan(
        self,
        qo_indptr: torch.Tensor,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **options: Any,
    ) -> None:
        assert options["causal"] is True
        self.qo_indptr, self.indptr, self.indices, self.last = qo_indptr, indptr, indices, last
        self.scale, self.page_size = options["sm_scale"], page_size
        self.window_left, self.soft_cap = options.get("window_left", -1), options.get("logits_soft_cap") or 0.0

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for seq in range(len(self.last)):
            start, end = int(self.qo_indptr[seq]), int(self.qo_indptr[seq + 1])
            keys, values = stand_in_pages(kv_cache, self.indptr, self.indices, self.last, seq, self.page_size)
            out[start:end] = stand_in_attention(q[start:end], keys, values, self.scale, self.window_left, self.soft_cap)
        return out


def stand_in_backend(monkeypatch: pytest.MonkeyPatch, layer_kinds: tuple[LayerKind, ...] = (FULL_ATTENTION,)) -> Any:
    stand_in = types.ModuleType("flashinfer")
    stand_in.BatchDecodeWithPagedKVCacheWrapper = StandInDecodeWrapper  # type: ignore[attr-defined]
    stand_in.BatchPrefillWithPagedKVCacheWrapper = StandInPrefillWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    monkeypatch.setattr("compiled_engine.attention.flashinfer_backend.WORKSPACE_BYTES", 1024)
    from compiled_engine.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(AttentionShape(8, 2, 16, PAGE, torch.float32, CPU, layer_kinds=layer_kinds))


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    return stand_in_backend(monkeypatch)


def test_a_planned_graph_wrapper_attends_like_the_torch_backend(backend: Any) -> None:
    torch.manual_seed(0)
    scratch, size = 30, 8
    buffers = DecodeBuffers(max_size=size, max_pages=5, page_size=PAGE, scratch_page=scratch, device=CPU)
    lens = [1, 4, 5, 17, 9]  # one token, a full page, one past it, several pages
    tables = [[0], [1], [2, 3], [4, 5, 6, 7, 8], [9, 10, 11]]
    positions = [n - 1 for n in lens]
    buffers.fill([7] * 5, positions, tables, size)
    metadata = buffers.metadata(size)
    backend.plan_graph(size, metadata, *buffers.host_batch(positions, tables, size))
    q, k, v = torch.randn(size, 8, 16), torch.randn(size, 2, 16), torch.randn(size, 2, 16)
    cache = torch.randn(scratch + 1, 2, PAGE, 2, 16)
    reference_cache = cache.clone()
    got = backend.forward(q, k, v, cache, backend.prepare_graph(metadata), 16**-0.5)
    alone = AttentionMetadata.build([1] * 5, lens, tables, PAGE, CPU)
    want = TorchAttentionBackend().attend(q[:5], k[:5], v[:5], reference_cache, alone, 16**-0.5)
    torch.testing.assert_close(got[:5], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache[:scratch], reference_cache[:scratch])  # padding wrote only the scratch page
    assert list(backend.graph_wrappers[size]) == [FULL_ATTENTION]  # the model's one layer kind
    wrapper = backend.graph_wrappers[size][FULL_ATTENTION]
    assert wrapper.indptr.tolist() == [0, 1, 2, 4, 9, 12, 13, 14, 15]
    assert wrapper.last.tolist() == [1, 4, 1, 1, 1, 1, 1, 1]
    assert wrapper.indices[:15].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, scratch, scratch, scratch]
    # the next batch of the same size reuses the wrapper and its buffers
    backend.plan_graph(size, buffers.metadata(size), *buffers.host_batch([2], [[3]], size))
    assert (
        backend.graph_wrappers[size][FULL_ATTENTION] is wrapper
        and wrapper.plans == 2
        and wrapper.indptr.tolist() == list(range(9))
    )


def test_plan_graph_refuses_inconsistent_batches(backend: Any) -> None:
    buffers = DecodeBuffers(max_size=4, max_pages=3, page_size=PAGE, scratch_page=20, device=CPU)
    metadata = buffers.metadata(4)
    with pytest.raises(ValueError, match="a graph of 4 rows needs 4"):
        backend.plan_graph(4, metadata, [1, 2], [[0], [1]])
    with pytest.raises(ValueError, match="fewer pages than its sequence length needs"):
        backend.plan_graph(4, metadata, [9, 1, 1, 1], [[0], [20], [20], [20]])
    backend.plan_graph(4, metadata, *buffers.host_batch([], [], 4))
    q = torch.randn(4, 8, 16)
    kv = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match="planned with scale"):
        backend.forward(q, kv, kv, torch.zeros(21, 2, PAGE, 2, 16), backend.prepare_graph(metadata), 0.5)


def test_a_graph_plan_needs_its_size_planned_first(backend: Any) -> None:
    buffers = DecodeBuffers(max_size=4, max_pages=3, page_size=PAGE, scratch_page=20, device=CPU)
    with pytest.raises(RuntimeError, match="was not planned"):
        backend.prepare_graph(buffers.metadata(2))


def test_the_graph_runner_plans_before_each_capture_and_replay_never_inside(
    monkeypatch: pytest.MonkeyPatch, backend: Any
) -> None:
    use_stand_ins(monkeypatch)
    plans: list[tuple[bool, int, list[int], list[list[int]]]] = []
    runs: list[tuple[bool, Any]] = []
    plan_graph = backend.plan_graph

    def recording_plan_graph(size: int, metadata: GraphMetadata, seq_lens: list[int], tables: list[list[int]]) -> None:
        plans.append((RecordingGraph.capturing, size, seq_lens, tables))
        plan_graph(size, metadata, seq_lens, tables)

    monkeypatch.setattr(backend, "plan_graph", recording_plan_graph)

    def forward(ids: torch.Tensor, positions: torch.Tensor, plan: Any) -> torch.Tensor:
        runs.append((RecordingGraph.capturing, plan))
        assert plan.wrappers is backend.graph_wrappers[ids.shape[0]]  # the size's wrappers, planned before this forward
        return torch.zeros(ids.shape[0], 3)

    buffers = DecodeBuffers(max_size=4, max_pages=3, page_size=PAGE, scratch_page=20, device=CPU)
    runner = CudaGraphRunner(forward, buffers, [1, 2, 4], backend)
    runner.capture()
    assert [(inside, size) for inside, size, _, _ in plans] == [(False, 4), (False, 2), (False, 1)]
    assert all(lens == [1] * size and tables == [[20]] * size for _, size, lens, tables in plans)
    assert [inside for inside, _ in runs] == [False, True] * 3  # warm-up, then capture, per size
    assert sorted(backend.graph_wrappers) == [1, 2, 4]
    plans.clear()
    logits = runner.replay([5, 6, 7], [3, 9, 0], [[0], [1, 2, 3], [4]])
    assert logits is not None and logits.shape == (3, 3)
    assert plans == [(False, 4, [4, 10, 1, 1], [[0], [1, 2, 3], [4], [20]])]
    assert runner.graphs[4].replays == 1  # type: ignore[attr-defined]
    wrapper = backend.graph_wrappers[4][FULL_ATTENTION]
    assert wrapper.indptr.tolist() == [0, 1, 4, 5, 6] and wrapper.last.tolist() == [4, 2, 1, 1]


# ---------------------------------------------------------------------------------------------
# layer kinds: one wrapper per (window, soft_cap), each layer running its own

SOFT_CAP = 5.0
KINDS: tuple[LayerKind, ...] = (FULL_ATTENTION, (3, 0.0), (6, SOFT_CAP), (0, SOFT_CAP))


def test_every_layer_kind_has_its_own_planned_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = stand_in_backend(monkeypatch, KINDS)
    md = AttentionMetadata.build([1, 1], [5, 9], [[0, 1], [2, 3, 4]], PAGE, CPU)
    plan = backend.prepare(md, torch.zeros(5, 2, PAGE, 2, 16))
    assert sorted(plan.wrappers) == sorted(KINDS)
    # A window of W keys is FlashInfer's window_left = W - 1; no window is -1.
    planned = {kind: (wrapper.window_left, wrapper.soft_cap) for kind, wrapper in plan.wrappers.items()}
    assert planned == {
        FULL_ATTENTION: (-1, 0.0),
        (3, 0.0): (2, 0.0),
        (6, SOFT_CAP): (5, SOFT_CAP),
        (0, SOFT_CAP): (-1, SOFT_CAP),
    }
    prompts = backend.prepare(AttentionMetadata.build([4, 1], [5, 9], [[0, 1], [2, 3, 4]], PAGE, CPU), torch.zeros(5))
    assert {kind: wrapper.window_left for kind, wrapper in prompts.wrappers.items()} == {
        FULL_ATTENTION: -1, (3, 0.0): 2, (6, SOFT_CAP): 5, (0, SOFT_CAP): -1
    }  # fmt: skip
    assert all(isinstance(wrapper, StandInPrefillWrapper) for wrapper in prompts.wrappers.values())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1, 1], [1, 3, 7, 18]), ([1, 6, 1, 9], [11, 6, 2, 20])],
    ids=["decode", "mixed"],
)
def test_each_layer_kind_attends_like_the_torch_backend(
    monkeypatch: pytest.MonkeyPatch, kind: LayerKind, query_lens: list[int], seq_lens: list[int]
) -> None:
    backend = stand_in_backend(monkeypatch, KINDS)
    torch.manual_seed(1)
    tables = [[i * 5 + p for p in range(-(-n // PAGE))] for i, n in enumerate(seq_lens)]
    tokens = sum(query_lens)
    q, k, v = torch.randn(tokens, 8, 16), torch.randn(tokens, 2, 16), torch.randn(tokens, 2, 16)
    cache = torch.randn(20, 2, PAGE, 2, 16)
    reference_cache = cache.clone()
    scale = 2 * 16**-0.5  # with the cap biting
    monkeypatch.setattr(backend, "scale", scale)
    window, soft_cap = kind
    md = AttentionMetadata.build(query_lens, seq_lens, tables, PAGE, CPU)
    got = backend.attend(q, k, v, cache, md, scale, window, soft_cap)
    want = TorchAttentionBackend().attend(q, k, v, reference_cache, md, scale, window, soft_cap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, reference_cache)


def test_captured_sizes_plan_every_layer_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = stand_in_backend(monkeypatch, KINDS)
    torch.manual_seed(2)
    scratch, size = 30, 4
    buffers = DecodeBuffers(max_size=size, max_pages=5, page_size=PAGE, scratch_page=scratch, device=CPU)
    lens, tables = [3, 9, 17], [[0], [1, 2, 3], [4, 5, 6, 7, 8]]
    positions = [n - 1 for n in lens]
    buffers.fill([7] * 3, positions, tables, size)
    metadata = buffers.metadata(size)
    backend.plan_graph(size, metadata, *buffers.host_batch(positions, tables, size))
    assert sorted(backend.graph_wrappers[size]) == sorted(KINDS)
    wrappers = backend.graph_wrappers[size].values()
    assert all(w.graph and w.plans == 1 and w.indptr.tolist() == [0, 1, 4, 9, 10] for w in wrappers)
    plan = backend.prepare_graph(metadata)
    q, k, v = torch.randn(size, 8, 16), torch.randn(size, 2, 16), torch.randn(size, 2, 16)
    cache = torch.randn(scratch + 1, 2, PAGE, 2, 16)
    alone = AttentionMetadata.build([1] * 3, lens, tables, PAGE, CPU)
    for window, soft_cap in KINDS:
        reference_cache = cache.clone()
        got = backend.forward(q, k, v, cache, plan, 16**-0.5, window, soft_cap)
        want = TorchAttentionBackend().attend(q[:3], k[:3], v[:3], reference_cache, alone, 16**-0.5, window, soft_cap)
        torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)


def test_a_layer_kind_not_planned_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = stand_in_backend(monkeypatch, (FULL_ATTENTION, (3, 0.0)))
    md = AttentionMetadata.build([1], [5], [[0, 1]], PAGE, CPU)
    cache = torch.zeros(2, 2, PAGE, 2, 16)
    plan = backend.prepare(md, cache)
    q, kv = torch.randn(1, 8, 16), torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match=r"planned for the layer kinds .* a layer attends with \(4, 0.0\)"):
        backend.forward(q, kv, kv, cache, plan, 16**-0.5, 4, 0.0)
    assert not cache.any()  # refused before writing anything
