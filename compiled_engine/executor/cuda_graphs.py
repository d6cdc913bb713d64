"""Decode through CUDA graphs: one graph per padded batch size, replayed with its inputs rewritten
in place.

A decode batch of n sequences runs as the smallest captured size >= n. The padding rows are
harmless: token 0 at position 0, writing its K/V into a scratch page that no sequence owns and
attending over that page alone. Graphs are captured largest first into one shared memory pool
(a smaller graph's activations fit in the larger one's blocks). Inputs (token ids, positions,
slots, sequence lengths, block tables) live in static buffers; the GraphMetadata of each size is a
view of those buffers, so writing the buffers is all a replay needs, plus, for a backend that
schedules on the host (FlashInfer), its `plan_graph` for the batch, run before the replay. The
backend's plan of a graph (`prepare_graph`) is built inside the capture, so every replay
recomputes it from the buffers. The logits are computed inside the graph; sampling stays outside
(per-request generators are host state).

`DecodeBuffers` is plain tensor bookkeeping and runs on any device (the CPU tests replay the
padded batch eagerly); `CudaGraphRunner` captures and replays on CUDA.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from compiled_engine.attention.backend import AttentionBackend
from compiled_engine.attention.metadata import GraphMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to min(max_num_seqs, cap); that limit itself is
    always included so the largest decode batch the scheduler makes has a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    limit = min(max_num_seqs, cap)
    sizes = [s for s in (1, 2, 4, 8) if s <= limit] + list(range(16, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs`, or None (then the batch runs eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeBuffers:
    """Static inputs for decode batches of up to `max_size` sequences, each with up to
    `max_pages` pages, plus the scratch page that padding rows write into."""

    def __init__(self, max_size: int, max_pages: int, page_size: int, scratch_page: int, device: torch.device) -> None:
        self.max_size = max_size
        self.page_size = page_size
        self.scratch_page = scratch_page
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_size,), scratch_page * page_size, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_size, max_pages), scratch_page, dtype=torch.int32, device=device)
        # Staged on the host, then copied in one transfer per buffer.
        self._host_tables = torch.full((max_size, max_pages), scratch_page, dtype=torch.int32)

    def metadata(self, size: int) -> GraphMetadata:
        """Metadata over the first `size` rows: views, valid for every later `fill`."""
        return GraphMetadata(self.seq_lens[:size], self.block_tables[:size], self.slot_mapping[:size], self.page_size)

    def fill(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], size: int) -> None:
        """Write a decode batch (one new token per sequence at `positions[i]`) into the first
        `size` rows; rows past the batch become padding."""
        n = len(token_ids)
        if not (len(positions) == len(block_tables) == n) or not 0 < n <= size <= self.max_size:
            raise ValueError(f"a batch of {n} rows does not fit a padded size {size} (max {self.max_size})")
        pad = size - n
        slots = [
            table[pos // self.page_size] * self.page_size + pos % self.page_size
            for pos, table in zip(positions, block_tables, strict=True)
        ]
        host = self._host_tables[:size]
        host.fill_(self.scratch_page)
        for row, table in enumerate(block_tables):
            if len(table) > host.shape[1]:
                raise ValueError(f"a block table of {len(table)} pages exceeds the {host.shape[1]} the buffers hold")
            host[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        device = self.input_ids.device
        self.input_ids[:size].copy_(torch.tensor(token_ids + [0] * pad))
        self.positions[:size].copy_(torch.tensor(positions + [0] * pad))
        self.slot_mapping[:size].copy_(torch.tensor(slots + [self.scratch_page * self.page_size] * pad))
        self.seq_lens[:size].copy_(torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32))
        self.block_tables[:size].copy_(host.to(device))

    def host_batch(
        self, positions: list[int], block_tables: list[list[int]], size: int
    ) -> tuple[list[int], list[list[int]]]:
        """The sequence lengths and block tables of `size` rows as `fill` lays them out, on the
        host: the batch, then padding rows of one token on the scratch page."""
        pad = size - len(positions)
        return [p + 1 for p in positions] + [1] * pad, list(block_tables) + [[self.scratch_page]] * pad


# The logits of a decode batch: (input ids, positions, the backend's plan of the graph).
ForwardFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


class CudaGraphRunner:
    """Captures `forward(input_ids, positions, plan) -> logits` once per size and replays it.
    The backend plans on the host (`plan_graph`) before each capture and each replay, and builds
    the graph's plan (`prepare_graph`) inside the capture."""

    def __init__(
        self, forward: ForwardFn, buffers: DecodeBuffers, sizes: list[int], backend: AttentionBackend[Any]
    ) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name} attention backend does not support CUDA graphs")
        self.forward = forward
        self.buffers = buffers
        self.sizes = sizes
        self.backend = backend
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # The plan each graph was captured with, kept alive with it: its tensors (index rows, key
        # masks) were allocated in the graph's pool and are rewritten by every replay.
        self.plans: dict[int, Any] = {}
        self.metadata: dict[int, GraphMetadata] = {}  # each size's views of the buffers
        self.capture_seconds = 0.0

    def capture(self) -> None:
        started = time.perf_counter()
        pool = None
        b = self.buffers
        for size in sorted(self.sizes, reverse=True):  # largest first: the pool fits the rest
            ids, positions = b.input_ids[:size], b.positions[:size]
            metadata = self._planned(size)
            self.forward(
                ids, positions, self.backend.prepare_graph(metadata)
            )  # warm-up outside capture (lazy inits, autotuning)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                # Built inside the capture, so a replay recomputes it from the buffers.
                plan = self.backend.prepare_graph(metadata)
                self.outputs[size] = self.forward(ids, positions, plan)
            self.plans[size] = plan
            self.metadata[size] = metadata
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started
        logger.info(
            "CUDA graphs: %d decode sizes (1..%d) captured in %.1f s",
            len(self.sizes),
            max(self.sizes),
            self.capture_seconds,
        )

    def _planned(self, size: int) -> GraphMetadata:
        """The metadata over the buffers' first `size` rows, planned on the host for a batch of
        padding rows only: what the buffers hold before the first fill."""
        metadata = self.buffers.metadata(size)
        self.backend.plan_graph(size, metadata, *self.buffers.host_batch([], [], size))
        return metadata

    def replay(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor | None:
        """The logits of a decode batch, or None when no captured size holds it."""
        size = padded_size(len(token_ids), self.sizes)
        if size is None or size not in self.graphs:
            return None
        self.buffers.fill(token_ids, positions, block_tables, size)
        self.backend.plan_graph(size, self.metadata[size], *self.buffers.host_batch(positions, block_tables, size))
        self.graphs[size].replay()
        return self.outputs[size][: len(token_ids)]
