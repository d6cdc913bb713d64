"""FlashInfer paged attention on CUDA, behind the same interface as the torch backend.

Per forward, `prepare` plans (host-side scheduling of the batch over the GPU) before the model
runs, and every layer runs: a paged prefill wrapper (causal, over each sequence's cached prefix
plus its new tokens) for batches with prompt tokens, a decode wrapper (tensor cores, for
grouped-query attention) for decode-only batches. New K/V are written with the same scatter as
the torch backend (`attention/paged.py`). The page layout [pages, 2, page_size, kv_heads,
head_dim] per layer is FlashInfer's NHD layout. The calls sit inside the `paged_attention` custom
op, so torch.compile never traces into FlashInfer.

CUDA graphs: one decode wrapper per captured batch size, built with `use_cuda_graph=True` over
fixed int32 index buffers. `plan_graph` plans it on the host before the graph is captured and
before every replay, never inside; inside, `prepare_graph` picks that wrapper and only the K/V
scatter and `run()` are recorded (see docs/backends.md).

Sliding windows and logit soft-caps: FlashInfer takes them per plan (`window_left`,
`logits_soft_cap`), not per run, so every wrapper above exists once per layer kind of the model
(`AttentionShape.layer_kinds`, the distinct (window, soft_cap) pairs of its layers), each planned
for its kind, and a layer's call runs its kind's wrapper. A window of W keys is
`window_left = W - 1` (the keys left of the query's own). This part has not run on a GPU yet:
`tests/test_flashinfer.py::test_flashinfer_layer_kinds_match_torch_backend` (marked gpu) checks
it against the torch backend; on the CPU only the planning and the choice of wrapper are checked,
against a stand-in (tests/test_flashinfer_graphs.py).

Attention sinks (gpt-oss) are not passed to FlashInfer (`supports_sinks` is False): its paged
wrappers used here take no sink tensor, and a sink path could not be checked without a GPU, so
the selector gives such a model the torch backend, with a warning saying why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch

from compiled_engine.attention.backend import AttentionBackend, AttentionShape, LayerKind
from compiled_engine.attention.metadata import AttentionMetadata, GraphMetadata
from compiled_engine.attention.paged import kv_rows, write_kv

WORKSPACE_BYTES = 128 << 20
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def _page_counts(seq_lens: list[int], page_size: int) -> tuple[list[int], list[int], list[int]]:
    """Pages per sequence, their running total (FlashInfer's indptr) and each last page's length."""
    pages = [-(-n // page_size) for n in seq_lens]
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    return pages, indptr, [(n - 1) % page_size + 1 for n in seq_lens]


def window_left(window: int) -> int:
    """FlashInfer's `window_left` for a window of `window` keys: the keys left of the query's own
    that it sees (window - 1), or -1 for every earlier key."""
    return window - 1 if window else -1


def paged_kv_layout(metadata: AttentionMetadata, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's page table: (indptr [seqs + 1], indices [pages in use], last_page_len
    [seqs]), int32, built from the host copies of the sequence lengths."""
    pages, indptr, last = _page_counts(metadata.seq_lens_cpu, page_size)
    device = metadata.block_tables.device
    width = metadata.block_tables.shape[1]
    keep = torch.arange(width, device=device)[None, :] < torch.tensor(pages, device=device)[:, None]
    indices = metadata.block_tables[keep].to(torch.int32)
    return (
        torch.tensor(indptr, dtype=torch.int32, device=device),
        indices,
        torch.tensor(last, dtype=torch.int32, device=device),
    )


def host_page_layout(
    seq_lens: list[int], block_tables: list[list[int]], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same page table as `paged_kv_layout`, built on the host from lists (for a graph's
    plan, which must not wait on the device)."""
    pages, indptr, last = _page_counts(seq_lens, page_size)
    if any(len(table) < p for table, p in zip(block_tables, pages, strict=True)):
        raise ValueError("a block table holds fewer pages than its sequence length needs")
    indices = [page for table, p in zip(block_tables, pages, strict=True) for page in table[:p]]
    return (
        torch.tensor(indptr, dtype=torch.int32),
        torch.tensor(indices, dtype=torch.int32),
        torch.tensor(last, dtype=torch.int32),
    )


@dataclass(frozen=True)
class FlashInferPlan:
    """One forward: the planned wrapper of each layer kind (a layer runs its kind's), and where
    the new K/V go."""

    wrappers: dict[LayerKind, Any]
    slot_mapping: torch.Tensor
    write_rows: torch.Tensor


class FlashInferAttentionBackend(AttentionBackend[FlashInferPlan]):
    name = "flashinfer"
    supports_cuda_graphs = True
    # Unverified on a GPU so far (see the module's docstring).
    supports_sliding_window = True
    supports_soft_cap = True

    def __init__(self, shape: AttentionShape) -> None:
        import flashinfer

        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.page_size, self.dtype = shape.page_size, shape.dtype
        self.flashinfer = flashinfer
        self.device = shape.device
        self.scale = shape.softmax_scale  # graph plans need it before the first forward
        self.layer_kinds = shape.layer_kinds
        # The wrappers share the float workspace: it is scratch during run() only, and the layers
        # run one after another on one stream. Each keeps its own plan (its int workspace).
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = {
            kind: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD") for kind in self.layer_kinds
        }
        self.decode = {
            kind: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.num_heads != self.num_kv_heads
            )
            for kind in self.layer_kinds
        }
        # captured batch size -> its decode wrapper per layer kind
        self.graph_wrappers: dict[int, dict[LayerKind, Any]] = {}

    @classmethod
    def unsupported_reason(cls, shape: AttentionShape) -> str | None:
        if shape.device.type != "cuda":
            return "FlashInfer needs a CUDA device"
        if shape.kv_cache_dtype != shape.dtype:
            # FlashInfer's FP8 pages (kv_data_type, k_scale / v_scale) are not wired here yet.
            return f"the KV cache dtype {shape.kv_cache_dtype} differs from the activations' {shape.dtype}"
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            return "flashinfer is not installed (pip install 'compiled_engine[cuda]')"
        if shape.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {shape.head_dim} is not one of FlashInfer's {SUPPORTED_HEAD_DIMS}"
        if shape.dtype not in SUPPORTED_DTYPES:
            return f"dtype {shape.dtype} is not float16 or bfloat16"
        return None

    @classmethod
    def create(cls, shape: AttentionShape) -> Self:
        return cls(shape)

    def plan_graph(
        self, size: int, metadata: GraphMetadata, seq_lens: list[int], block_tables: list[list[int]]
    ) -> None:
        """Outside any graph, before the decode graph of `size` rows is captured or replayed:
        plan that size's wrapper for this batch (padding rows included: one page, length 1).
        `metadata.block_tables` is the static buffer the graph reads; its width bounds the pages
        a row may hold."""
        if not len(seq_lens) == len(block_tables) == size == metadata.num_seqs:
            raise ValueError(
                f"a graph of {size} rows needs {size} sequence lengths and block tables, got {len(seq_lens)} and {len(block_tables)}"
            )
        wrappers = self.graph_wrappers.get(size)
        if wrappers is None:
            width = metadata.block_tables.shape[1]
            wrappers = {kind: self._graph_wrapper(size, width) for kind in self.layer_kinds}
            self.graph_wrappers[size] = wrappers
        indptr, indices, last = host_page_layout(seq_lens, block_tables, self.page_size)
        if self.device.type == "cuda":
            # plan() stages through pinned host memory: let the last replay's copies land first.
            torch.cuda.current_stream(self.device).synchronize()
        for kind, wrapper in wrappers.items():
            self._plan_decode(wrapper, kind, indptr, indices, last)

    def _graph_wrapper(self, size: int, width: int) -> Any:
        """A decode wrapper for a graph of `size` rows, over its own fixed index buffers."""
        return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.num_heads != self.num_kv_heads,
            paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=torch.zeros(size * width, dtype=torch.int32, device=self.device),
            paged_kv_last_page_len_buffer=torch.ones(size, dtype=torch.int32, device=self.device),
        )  # fmt: skip

    def prepare_graph(self, metadata: GraphMetadata) -> FlashInferPlan:
        """Inside the capture: the size's wrappers, planned by `plan_graph` beforehand."""
        wrappers = self.graph_wrappers.get(metadata.num_seqs)
        if wrappers is None:
            raise RuntimeError(
                f"the decode graph of {metadata.num_seqs} rows was not planned (plan_graph) before its capture"
            )
        return FlashInferPlan(wrappers, metadata.slot_mapping, kv_rows(metadata.slot_mapping, self.page_size))

    def _plan_decode(
        self, wrapper: Any, kind: LayerKind, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor
    ) -> None:
        window, soft_cap = kind
        wrapper.plan(
            indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            pos_encoding_mode="NONE", window_left=window_left(window), logits_soft_cap=soft_cap,
            sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
        )  # fmt: skip

    def prepare(self, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> FlashInferPlan:
        indptr, indices, last = paged_kv_layout(metadata, self.page_size)
        if metadata.decode_only:
            for kind, wrapper in self.decode.items():
                self._plan_decode(wrapper, kind, indptr, indices, last)
            wrappers = self.decode
        else:
            for (window, soft_cap), wrapper in self.prefill.items():
                wrapper.plan(
                    metadata.query_start_loc,
                    indptr,
                    indices,
                    last,
                    self.num_heads,
                    self.num_kv_heads,
                    self.head_dim,
                    self.page_size,
                    causal=True,
                    window_left=window_left(window),
                    logits_soft_cap=soft_cap,
                    sm_scale=self.scale,
                    q_data_type=self.dtype,
                    kv_data_type=self.dtype,
                )
            wrappers = self.prefill
        return FlashInferPlan(wrappers, metadata.slot_mapping, kv_rows(metadata.slot_mapping, self.page_size))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: FlashInferPlan,
        scale: float,
        window: int = 0,
        soft_cap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:  # never chosen for such a model (supports_sinks): the selector says why
            raise ValueError("the flashinfer attention backend has no attention sinks (gpt-oss's); use cpu or torch")
        if scale != self.scale:
            raise ValueError(f"FlashInfer was planned with scale {self.scale}, the model attends with {scale}")
        wrapper = plan.wrappers.get((window, soft_cap))
        if wrapper is None:
            raise ValueError(
                f"FlashInfer was planned for the layer kinds (window, soft_cap) {sorted(plan.wrappers)}, "
                f"a layer attends with ({window}, {soft_cap}) (AttentionShape.layer_kinds)"
            )
        write_kv(k, v, kv_cache, plan.slot_mapping, plan.write_rows)
        out: torch.Tensor = wrapper.run(q.contiguous(), kv_cache)
        return out
