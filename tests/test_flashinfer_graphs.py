"""The FlashInfer CUDA-graph protocol, checked on the CPU with a stand-in for flashinfer: one
decode wrapper per captured size over fixed index buffers, planned from host lists (padding rows
one page of length 1 on the scratch page, indptr non-decreasing) before each capture and replay
and never inside a capture, and what the planned wrapper computes equal to the torch backend."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from compiled_engine.attention.backend import AttentionShape
from compiled_engine.attention.metadata import AttentionMetadata, GraphMetadata
from compiled_engine.attention.torch_backend import TorchAttentionBackend
from compiled_engine.engine.cuda_graphs import CudaGraphRunner, DecodeBuffers
from tests.cuda_graph_stand_ins import RecordingGraph, use_stand_ins

CPU = torch.device("cpu")
PAGE = 4


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
        self.plans += 1

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        assert self.indptr is not None and self.indices is not None and self.last is not None
        out = torch.empty_like(q)
        kv_heads = kv_cache.shape[3]
        for row in range(q.shape[0]):
            pages = self.indices[int(self.indptr[row]) : int(self.indptr[row + 1])]
            length = (len(pages) - 1) * self.page_size + int(self.last[row])
            keys = kv_cache[pages, 0].reshape(-1, kv_heads, q.shape[-1])[:length]
            values = kv_cache[pages, 1].reshape(-1, kv_heads, q.shape[-1])[:length]
            group = q.shape[1] // kv_heads
            scores = torch.einsum("hd,khd->hk", q[row], keys.repeat_interleave(group, 1)) * self.scale
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), values.repeat_interleave(group, 1))
        return out


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    stand_in = types.ModuleType("flashinfer")
    stand_in.BatchDecodeWithPagedKVCacheWrapper = StandInDecodeWrapper  # type: ignore[attr-defined]
    stand_in.BatchPrefillWithPagedKVCacheWrapper = lambda workspace, layout: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    monkeypatch.setattr("compiled_engine.attention.flashinfer_backend.WORKSPACE_BYTES", 1024)
    from compiled_engine.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(AttentionShape(8, 2, 16, PAGE, torch.float32, CPU))


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
    wrapper = backend.graph_wrappers[size]
    assert wrapper.indptr.tolist() == [0, 1, 2, 4, 9, 12, 13, 14, 15]
    assert wrapper.last.tolist() == [1, 4, 1, 1, 1, 1, 1, 1]
    assert wrapper.indices[:15].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, scratch, scratch, scratch]
    # the next batch of the same size reuses the wrapper and its buffers
    backend.plan_graph(size, buffers.metadata(size), *buffers.host_batch([2], [[3]], size))
    assert backend.graph_wrappers[size] is wrapper and wrapper.plans == 2 and wrapper.indptr.tolist() == list(range(9))


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
        assert plan.wrapper is backend.graph_wrappers[ids.shape[0]]  # the size's wrapper, planned before this forward
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
    wrapper = backend.graph_wrappers[4]
    assert wrapper.indptr.tolist() == [0, 1, 4, 5, 6] and wrapper.last.tolist() == [4, 2, 1, 1]
