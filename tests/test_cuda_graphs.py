"""The CUDA-graph decode runner's bookkeeping, checked without a GPU: which sizes are captured,
which size a batch pads to, that a padded batch in the static buffers computes the same
logits as the batch alone, and that a pooling step never replays a graph on any rank. The capture
and replay themselves run on CUDA only (marked gpu)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from compiled_engine.attention.cpu_backend import CpuAttentionBackend
from compiled_engine.attention.metadata import GraphMetadata
from compiled_engine.attention.native_decode import load_native_decode
from compiled_engine.attention.paged import TorchPlan
from compiled_engine.attention.torch_backend import TorchAttentionBackend
from compiled_engine.config import EngineConfig
from compiled_engine.executor.cuda_graphs import (
    CudaGraphRunner,
    DecodeBuffers,
    capture_sizes,
    padded_size,
)
from compiled_engine.executor.runner import Runner
from compiled_engine.executor.step import NoOutput, StepInputs, Wants
from tests.cuda_graph_stand_ins import RecordingGraph, use_stand_ins

CPU = torch.device("cpu")


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert capture_sizes(1000) == capture_sizes(256)  # capped: bigger batches run uncaptured
    with pytest.raises(ValueError, match="at least 1"):
        capture_sizes(0)


def test_padded_size_is_the_smallest_that_fits() -> None:
    sizes = capture_sizes(30)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 24, 25, 30)] == [1, 2, 4, 8, 8, 16, 24, 24, 30, 30]
    assert padded_size(31, sizes) is None


def test_fill_writes_the_batch_then_padding_rows_on_the_scratch_page() -> None:
    buffers = DecodeBuffers(max_size=8, max_pages=4, page_size=4, scratch_page=9, device=CPU)
    buffers.fill([11, 12, 13], positions=[0, 5, 9], block_tables=[[3], [1, 7], [2, 4, 6]], size=4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [0, 5, 9, 0]
    assert buffers.slot_mapping[:4].tolist() == [12, 29, 25, 36]  # page * 4 + offset; pad -> page 9
    assert buffers.seq_lens[:4].tolist() == [1, 6, 10, 1]
    assert buffers.block_tables[:4].tolist() == [[3, 9, 9, 9], [1, 7, 9, 9], [2, 4, 6, 9], [9, 9, 9, 9]]
    # A smaller batch afterwards leaves no trace of the larger one in its rows.
    buffers.fill([5], positions=[2], block_tables=[[8]], size=2)
    assert buffers.block_tables[:2].tolist() == [[8, 9, 9, 9], [9, 9, 9, 9]]
    assert buffers.seq_lens[:2].tolist() == [3, 1]
    md = buffers.metadata(2)
    assert md.num_seqs == 2 and md.page_size == 4 and md.block_tables.data_ptr() == buffers.block_tables.data_ptr()


@pytest.mark.parametrize(
    ("tokens", "positions", "tables", "size", "message"),
    [
        ([1], [0], [[0]], 5, "does not fit"),  # larger than the buffers
        ([1, 2, 3], [0, 0, 0], [[0], [1], [2]], 2, "does not fit"),  # batch larger than the size
        ([1, 2], [0], [[0], [1]], 2, "does not fit"),  # one position for two tokens
        ([1], [0], [[0, 1, 2, 3, 4]], 1, "exceeds the 4"),  # more pages than a row holds
    ],
)
def test_fill_rejects_what_does_not_fit(
    tokens: list[int], positions: list[int], tables: list[list[int]], size: int, message: str
) -> None:
    buffers = DecodeBuffers(max_size=4, max_pages=4, page_size=4, scratch_page=9, device=CPU)
    with pytest.raises(ValueError, match=message):
        buffers.fill(tokens, positions, tables, size)


@torch.inference_mode()
def test_padded_decode_batch_in_static_buffers_matches_the_batch_alone(tiny_model_factory: Callable[..., Path]) -> None:
    """What a graph replays, run eagerly on CPU: 3 sequences padded to 4 rows give the logits of
    the 3 sequences run without padding, and the padding writes only the scratch page."""
    model_dir = tiny_model_factory("llama")
    runner = Runner(
        model_dir,
        EngineConfig(model=str(model_dir), enforce_eager=True, num_pages=12, page_size=4, attention_backend="torch"),
    )
    gen = torch.Generator().manual_seed(0)
    lens = [3, 6, 9]
    tables = [[0], [1, 2], [3, 4, 5]]
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in lens]
    # prefill everything but each sequence's last token
    ids = [t for p in prompts for t in p[:-1]]
    positions = [i for n in lens for i in range(n - 1)]
    runner.execute(StepInputs(ids, positions, [n - 1 for n in lens], [n - 1 for n in lens], tables))
    before = runner.kv_cache.clone()

    last = [p[-1] for p in prompts]
    alone = runner.execute(StepInputs(last, [n - 1 for n in lens], [1] * 3, lens, tables)).rows
    after_alone = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)

    scratch = 11
    buffers = DecodeBuffers(
        max_size=8, max_pages=runner.max_pages_per_seq, page_size=4, scratch_page=scratch, device=CPU
    )
    buffers.fill(last, [n - 1 for n in lens], tables, size=4)
    graph_forward = runner.decode_graph_forward(runner.kv_cache)
    padded = graph_forward(
        buffers.input_ids[:4], buffers.positions[:4], runner.backend.prepare_graph(buffers.metadata(4))
    )
    assert alone is not None
    torch.testing.assert_close(padded[:3], alone, atol=1e-5, rtol=1e-5)
    # same cache as the unpadded run everywhere but the scratch page
    keep = torch.ones(runner.kv_cache.shape[1], dtype=torch.bool)
    keep[scratch] = False
    torch.testing.assert_close(runner.kv_cache[:, keep], after_alone[:, keep], atol=1e-5, rtol=1e-5)
    assert runner.kv_cache[:, scratch].abs().sum() > 0


class RecordingBackend(TorchAttentionBackend):
    """The torch backend, recording whether each graph plan is built inside a capture."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[tuple[bool, TorchPlan]] = []

    def prepare_graph(self, metadata: GraphMetadata) -> TorchPlan:
        plan = super().prepare_graph(metadata)
        self.prepared.append((RecordingGraph.capturing, plan))
        return plan


def test_capture_builds_each_graph_plan_inside_the_graph_and_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's plan of a graph (index rows, key masks) must be built during the capture,
    so that replays recompute it from the buffers: the warm-up's copy is stale (and freed), and
    the captured one must stay alive with its graph. Checked on CPU with stand-ins for the CUDA
    graph API."""
    use_stand_ins(monkeypatch)
    backend = RecordingBackend()
    runs: list[tuple[bool, TorchPlan]] = []

    def forward(ids: torch.Tensor, positions: torch.Tensor, plan: TorchPlan) -> torch.Tensor:
        runs.append((RecordingGraph.capturing, plan))
        return torch.zeros(ids.shape[0], 8)

    buffers = DecodeBuffers(max_size=8, max_pages=4, page_size=4, scratch_page=9, device=torch.device("cpu"))
    runner = CudaGraphRunner(forward, buffers, [1, 2, 4, 8], backend)
    runner.capture()
    assert [capturing for capturing, _ in backend.prepared] == [False, True] * 4  # warm-up, then capture, per size
    assert [(c, p) for c, p in runs] == backend.prepared  # each forward runs by the plan built for it
    captured = [plan for capturing, plan in backend.prepared if capturing]
    assert [runner.plans[size] for size in (8, 4, 2, 1)] == captured  # kept alive
    assert all(plan.decode is not None and plan.metadata is None for plan in captured)  # device tensors only
    logits = runner.replay([5, 6, 7], [3, 4, 5], [[0, 1], [2, 3], [5, 6]])
    assert logits is not None and logits.shape == (3, 8)
    assert isinstance(runner.graphs[4], RecordingGraph) and runner.graphs[4].replays == 1


def test_a_backend_without_graph_support_is_refused() -> None:
    buffers = DecodeBuffers(max_size=2, max_pages=4, page_size=4, scratch_page=9, device=CPU)
    backend = CpuAttentionBackend(load_native_decode(), 4)
    with pytest.raises(ValueError, match="does not support CUDA graphs"):
        CudaGraphRunner(lambda ids, positions, plan: ids, buffers, [1, 2], backend)
    with pytest.raises(NotImplementedError, match="cannot be captured"):
        backend.prepare_graph(buffers.metadata(2))


def relative_row_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    got, want = got.float(), want.float()
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "dtype"), [("torch", "float32"), ("flashinfer", "bfloat16")])
@torch.inference_mode()
def test_every_captured_size_replays_like_eager_on_cuda(
    tiny_model_factory: Callable[..., Path], backend: str, dtype: str
) -> None:
    """Graphed decode (compiled, with this backend) against eager decode with the torch backend.

    float32 is compared element by element (1e-3). In bf16 this random model moves some rows by up to
    13% from their float32 values (seen on an H200 and on the CPU alike), so no fixed tolerance
    separates rounding from a wrong replay. Each graphed row must instead be as close to the eager
    bf16 row as twice what bf16 itself costs that row (eager bf16 against eager float32), plus 0.02;
    a replay that read another sequence's token, length or pages would move a row by about as much
    as two different rows differ, which the test checks is beyond that bound.
    """
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    model_dir = tiny_model_factory(
        "llama", hidden_size=256, num_attention_heads=4
    )  # head_dim 64, which FlashInfer runs
    config = dict(model=str(model_dir), device="cuda", kv_cache_memory_gib=0.05, max_num_seqs=20)
    graphed = Runner(model_dir, EngineConfig(**config, dtype=dtype, enforce_eager=False, attention_backend=backend))  # type: ignore[arg-type]  # the tests default to eager
    eager = Runner(model_dir, EngineConfig(**config, dtype=dtype, enforce_eager=True, attention_backend="torch"))  # type: ignore[arg-type]
    reference = Runner(
        model_dir, EngineConfig(**config, dtype="float32", enforce_eager=True, attention_backend="torch")
    )  # type: ignore[arg-type]
    assert graphed.backend.name == backend
    assert graphed.graphs is not None and sorted(graphed.graphs.graphs) == capture_sizes(20)
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 21):
        lens = torch.randint(1, 40, (n,), generator=gen).tolist()
        tables = [[i * 3 + j for j in range(3)] for i in range(n)]
        tokens = torch.randint(3, 320, (n,), generator=gen).tolist()
        positions = [length - 1 for length in lens]
        used_tables = [t[: -(-length // graphed.page_size)] for t, length in zip(tables, lens, strict=True)]
        inputs = StepInputs(tokens, positions, [1] * n, lens, used_tables)
        want = eager.execute(inputs).rows
        got = graphed.graphs.replay(tokens, positions, used_tables)
        assert got is not None
        if dtype == "float32":
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
            continue
        allowed = 2 * relative_row_error(want, reference.execute(inputs).rows) + 0.02
        error = relative_row_error(got, want)
        assert (error < allowed).all(), f"batch {n}: row errors {error.tolist()}, allowed {allowed.tolist()}"
        if n > 1:  # the bound still catches a mix-up between rows
            swapped = relative_row_error(want.roll(1, dims=0), want)
            assert (swapped > allowed).all(), f"batch {n}: rows too alike {swapped.tolist()}"


class _GraphsThatMustNotReplay:
    """In place of a runner's CUDA graphs: any replay fails the test."""

    buffers = DecodeBuffers(max_size=8, max_pages=2, page_size=4, scratch_page=7, device=CPU)

    def replay(self, *args: object) -> None:
        raise AssertionError("a pooling step replayed a CUDA graph")


def test_a_pooling_step_runs_eagerly_on_every_rank(tiny_model_factory: Callable[..., Path]) -> None:
    """A one-token-per-sequence pooling step never replays a graph, on rank 0 (which asks for the
    hidden states) or on any other rank (which asks for nothing): the step says it pools, so
    tensor-parallel ranks all run the same eager forward and its all-reduces."""
    model_dir = tiny_model_factory("llama")
    runner = Runner(model_dir, EngineConfig(model=str(model_dir), enforce_eager=True, num_pages=8, page_size=4))
    runner.graphs = _GraphsThatMustNotReplay()  # type: ignore[assignment]
    step = StepInputs([5, 9], [0, 0], [1, 1], [1, 1], [[0], [1]], wants=Wants.HIDDEN_STATES)
    assert step.decode_only
    hidden = runner.execute(step).rows
    assert hidden is not None and hidden.shape == (2, runner.model_config.hidden_size)
    runner.answers = False  # another rank's part
    assert isinstance(runner.execute(step), NoOutput)
