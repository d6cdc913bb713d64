"""The CUDA-graph decode runner's bookkeeping, checked without a GPU: which sizes are captured,
which size a batch pads to, and that a padded batch in the static buffers computes the same
logits as the batch alone. The capture and replay themselves run on CUDA only (marked gpu)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.config import EngineConfig
from compiled_engine.engine.cuda_graphs import (
    CudaGraphRunner,
    DecodeBuffers,
    capture_sizes,
    padded_size,
)
from compiled_engine.engine.model_runner import ModelRunner
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
    assert md.decode_only and md.block_tables.data_ptr() == buffers.block_tables.data_ptr()


@pytest.mark.parametrize(
    ("tokens", "positions", "tables", "size", "message"),
    [
        ([1], [0], [[0]], 5, "does not fit"),  # larger than the buffers
        ([1, 2, 3], [0, 0, 0], [[0], [1], [2]], 2, "does not fit"),  # batch larger than the size
        ([1, 2], [0], [[0], [1]], 2, "does not fit"),  # one position for two tokens
        ([1], [0], [[0, 1, 2, 3, 4]], 1, "exceeds the 4"),  # more pages than a row holds
    ],
)
def test_fill_rejects_what_does_not_fit(tokens: list[int], positions: list[int], tables: list[list[int]], size: int, message: str) -> None:
    buffers = DecodeBuffers(max_size=4, max_pages=4, page_size=4, scratch_page=9, device=CPU)
    with pytest.raises(ValueError, match=message):
        buffers.fill(tokens, positions, tables, size)


@torch.inference_mode()
def test_padded_decode_batch_in_static_buffers_matches_the_batch_alone(tiny_model_factory: Callable[..., Path]) -> None:
    """What a graph replays, run eagerly on CPU: 3 sequences padded to 4 rows give the logits of
    the 3 sequences run without padding, and the padding writes only the scratch page."""
    model_dir = tiny_model_factory("llama")
    runner = ModelRunner(model_dir, EngineConfig(model=str(model_dir), enforce_eager=True, num_pages=12, page_size=4))
    gen = torch.Generator().manual_seed(0)
    lens = [3, 6, 9]
    tables = [[0], [1, 2], [3, 4, 5]]
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in lens]
    # prefill everything but each sequence's last token
    md = AttentionMetadata.build([n - 1 for n in lens], [n - 1 for n in lens], tables, 4, CPU)
    ids = torch.tensor([t for p in prompts for t in p[:-1]])
    positions = torch.tensor([i for n in lens for i in range(n - 1)])
    runner.decode_logits(ids, positions, md)
    before = runner.kv_cache.clone()

    last = [p[-1] for p in prompts]
    alone = runner.decode_logits(torch.tensor(last), torch.tensor([n - 1 for n in lens]), AttentionMetadata.build([1] * 3, lens, tables, 4, CPU))
    after_alone = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)

    scratch = 11
    buffers = DecodeBuffers(max_size=8, max_pages=runner.max_pages_per_seq, page_size=4, scratch_page=scratch, device=CPU)
    buffers.fill(last, [n - 1 for n in lens], tables, size=4)
    padded = runner.decode_logits(buffers.input_ids[:4], buffers.positions[:4], buffers.metadata(4))
    torch.testing.assert_close(padded[:3], alone, atol=1e-5, rtol=1e-5)
    # same cache as the unpadded run everywhere but the scratch page
    keep = torch.ones(runner.kv_cache.shape[1], dtype=torch.bool)
    keep[scratch] = False
    torch.testing.assert_close(runner.kv_cache[:, keep], after_alone[:, keep], atol=1e-5, rtol=1e-5)
    assert runner.kv_cache[:, scratch].abs().sum() > 0


def test_capture_derives_per_forward_tensors_inside_the_graph_and_keeps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a backend derives once per forward (metadata.per_forward) must be computed during the
    capture, so that replays recompute it from the buffers: the warm-up's copy is stale (and
    freed). Checked on CPU with stand-ins for the CUDA graph API."""
    use_stand_ins(monkeypatch)
    seen: list[tuple[bool, int, AttentionMetadata]] = []

    def forward(ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        seen.append((RecordingGraph.capturing, len(metadata.per_forward), metadata))
        metadata.per_forward.setdefault("rows", metadata.slot_mapping * 2)
        return torch.zeros(ids.shape[0], 8)

    buffers = DecodeBuffers(max_size=8, max_pages=4, page_size=4, scratch_page=9, device=torch.device("cpu"))
    runner = CudaGraphRunner(forward, buffers, [1, 2, 4, 8])
    runner.capture()
    captured = [(per_forward, metadata) for capturing, per_forward, metadata in seen if capturing]
    warm_ups = [metadata for capturing, _, metadata in seen if not capturing]
    assert len(captured) == len(warm_ups) == 4
    assert all(per_forward == 0 for per_forward, _ in captured)  # nothing carried over from the warm-up
    assert all(c is not w for (_, c), w in zip(captured, warm_ups, strict=True))
    assert [runner.metadata[size] for size in (8, 4, 2, 1)] == [m for _, m in captured]
    assert all("rows" in runner.metadata[size].per_forward for size in (1, 2, 4, 8))  # kept alive
    logits = runner.replay([5, 6, 7], [3, 4, 5], [[0, 1], [2, 3], [5, 6]])
    assert logits is not None and logits.shape == (3, 8)
    assert isinstance(runner.graphs[4], RecordingGraph) and runner.graphs[4].replays == 1


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("backend", "dtype", "tolerance"),
    [("torch", "float32", 1e-3), ("flashinfer", "bfloat16", 5e-2)],
)
@torch.inference_mode()
def test_every_captured_size_replays_like_eager_on_cuda(tiny_model_factory: Callable[..., Path], backend: str, dtype: str, tolerance: float) -> None:
    """Graphed decode (compiled, with this backend) against eager decode with the torch backend."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    model_dir = tiny_model_factory("llama", hidden_size=256, num_attention_heads=4)  # head_dim 64, which FlashInfer runs
    config = dict(model=str(model_dir), device="cuda", dtype=dtype, kv_cache_memory_gib=0.05, max_num_seqs=20)
    graphed = ModelRunner(model_dir, EngineConfig(**config, enforce_eager=False, attention_backend=backend))  # type: ignore[arg-type]  # the tests default to eager
    eager = ModelRunner(model_dir, EngineConfig(**config, enforce_eager=True, attention_backend="torch"))  # type: ignore[arg-type]
    assert graphed.model.backend.name == backend
    assert graphed.graphs is not None and sorted(graphed.graphs.graphs) == capture_sizes(20)
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 21):
        lens = torch.randint(1, 40, (n,), generator=gen).tolist()
        tables = [[i * 3 + j for j in range(3)] for i in range(n)]
        tokens = torch.randint(3, 320, (n,), generator=gen).tolist()
        positions = [length - 1 for length in lens]
        want = eager.decode_logits(
            torch.tensor(tokens, device="cuda"), torch.tensor(positions, device="cuda"),
            AttentionMetadata.build([1] * n, lens, [t[: -(-length // graphed.page_size)] for t, length in zip(tables, lens, strict=True)], graphed.page_size, torch.device("cuda")),
        )
        got = graphed.graphs.replay(tokens, positions, [t[: -(-length // graphed.page_size)] for t, length in zip(tables, lens, strict=True)])
        assert got is not None
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
