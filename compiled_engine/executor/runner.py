"""Runner: owns the model, its attention backend and the KV page pool; runs one step's
`StepInputs` and says what came back (`StepOutput`: the logits of the rows to sample, every
token's hidden states for pooling, or nothing on a rank other than 0). A pipeline stage is a
runner of its own (executor/stage_runner.py).

Construction, in the order the steps depend on each other: choose the attention backend, load
this rank's weights, rewrite the model (executor/prepare.py: shard, kernels, adapters, compile,
and after the forwards the rank runs alone, the stage links). Those forwards: warm up, size and
allocate the KV pool, capture the decode CUDA graphs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from compiled_engine.attention.backend import AttentionBackend, AttentionShape
from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.attention.op import attention_forward
from compiled_engine.attention.selector import get_backend
from compiled_engine.cache.block_manager import PageCopy
from compiled_engine.cache.kv_cache import KVCacheSpec, is_fp8
from compiled_engine.config import EngineConfig
from compiled_engine.executor.compilation import CompiledForward
from compiled_engine.executor.cuda_graphs import MAX_CAPTURE_SIZE, CudaGraphRunner, DecodeBuffers, capture_sizes
from compiled_engine.executor.distributed import StepSender
from compiled_engine.executor.kv_pool import context_limit, kv_budget_bytes, size_kv_pool
from compiled_engine.executor.pipeline import ParallelLayout, StageLinks, stage_layers
from compiled_engine.executor.prepare import AdapterInstall, PreparedModel, PreparePlan, install_no_adapters, prepare
from compiled_engine.executor.step import HiddenStates, Logits, NoOutput, StepInputs, StepOutput, Wants
from compiled_engine.linear.quantized_experts import captures_in_cuda_graphs
from compiled_engine.model.layers import DecoderModel
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.model.shard import NO_SHARD, TPShard
from compiled_engine.profiling import nvtx_range
from compiled_engine.weights.load import load_weights

logger = logging.getLogger(__name__)

WARM_UP_TOKENS = 16


@dataclass(frozen=True)
class SharedPool:
    """A second model that keeps its K/V under the same page ids (a draft model): each page
    costs `bytes_per_page` more, and its weights take `reserved_bytes` of the CUDA budget."""

    bytes_per_page: int = 0
    reserved_bytes: int = 0


class Runner:
    # A pipeline stage (StageRunner) holds only its layers, compiles them one by one and waits on
    # its neighbours each step: no saved traces (made for whole forwards), no CUDA graphs.
    is_stage = False

    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig,
        shard: TPShard = NO_SHARD,
        mesh: DeviceMesh | None = None,
        shared_pool: SharedPool | None = None,
        install_adapters: AdapterInstall = install_no_adapters,
        layout: ParallelLayout | None = None,
    ) -> None:
        """`shard` and `mesh`: this rank's part of a tensor-parallel model (executor/ranks.py).
        `shared_pool`: what a second model under the same page ids adds (a draft model).
        `install_adapters`: puts the adapter products into the model before it is compiled
        (engine/adapters.py). `layout`: this rank's place among the engine's ranks (None: the
        only rank, or a tensor-parallel one as `shard` says)."""
        self.shard = shard
        self.layout = layout or ParallelLayout(shard.rank, 1, shard.size)
        self.answers = self.layout.rank == 0  # rank 0 alone gets a step's logits or hidden states
        self.shared_pool = shared_pool or SharedPool()
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.page_size = config.page_size
        model_config = config_from_model_dir(model_dir)
        limit = context_limit(config, model_config)  # until the KV pool is sized
        self.model_config = model_config.for_context(limit)
        self.stage_layers = stage_layers(self.model_config.num_layers, self.layout.pipeline_size, self.layout.stage)
        self.kv_spec = KVCacheSpec(
            len(self.stage_layers),
            shard.kv_heads(self.model_config)[1],
            self.model_config.head_dim,
            self.page_size,
            config.resolved_kv_cache_dtype(),
        )
        self.backend = self._choose_backend(config)
        self.model = self._load(model_dir, config)
        if shard.size > 1 and mesh is None:
            raise ValueError("a tensor-parallel shard needs its device mesh")
        if config.cpu_activations != "fp32" and self.device.type != "cpu":
            raise ValueError(f"--cpu-activations {config.cpu_activations} runs on the CPU only, not {self.device.type}")
        compiled = not config.resolved_enforce_eager()
        # CPU only for now: saved traces replayed inside CUDA graphs have not run on a GPU yet.
        saved = compiled and config.compile_cache and self.device.type == "cpu" and not self.is_stage
        self.links = StageLinks(self.layout, config.distributed_timeout_s) if self.is_stage else None
        max_tokens = max(config.max_num_batched_tokens, WARM_UP_TOKENS, MAX_CAPTURE_SIZE)
        plan = PreparePlan(
            mesh if shard.size > 1 else None, compiled, config.cpu_activations,
            lambda model: install_adapters(model, self.model_config, max_tokens, self.dtype),
            trace_key=[repr(self.model_config), self.weights_description, str(self.dtype)] if saved else None,
            links=self.links,
        )  # fmt: skip
        prepare(self.model, plan, lambda prepared: self._start(prepared, config, limit))
        self.steps: StepSender | None = None  # rank 0 of several: its steps go to the other ranks
        if self.layout.world_size > 1 and self.layout.rank == 0:
            self.steps = StepSender(config.distributed_timeout_s)

    # -- construction ---------------------------------------------------------------------------

    def _start(self, prepared: PreparedModel, config: EngineConfig, limit: int) -> None:
        """The forwards this rank runs alone once the model is compiled: warm up, size and
        allocate the KV pool (measuring the device's memory), capture the decode CUDA graphs."""
        self.forward, self.adapter_slots = prepared.forward, prepared.adapter_slots
        self.compile_seconds = self._warm_up_compiled() if self.forward.compiled else 0.0
        # With tensor parallelism every rank captures the same sizes in the same order and replays
        # the same padded size each step (`execute`), so the all-reduces match.
        self.use_cuda_graphs = (
            self.forward.compiled
            and not self.is_stage  # a stage's step waits on its neighbours: not graphed
            and config.cuda_graphs
            and self.device.type == "cuda"
            and self.backend.supports_cuda_graphs
            and captures_in_cuda_graphs(self.model)
        )
        pages = self._agreed_pages(config, limit)
        self.pool = size_kv_pool(pages, self.page_size, limit, config.max_model_len is not None)
        self.kv_cache = self._allocate_kv_pool()
        self.graphs = self._capture_graphs(config) if self.use_cuda_graphs else None

    def _choose_backend(self, config: EngineConfig) -> AttentionBackend[Any]:
        model = self.model_config
        heads = self.shard.heads(model)[1]
        # The distinct (window, soft_cap) pairs of the layers: a backend that plans per kind
        # (FlashInfer) plans each once per forward, and the selector refuses one that lacks them.
        layer_kinds = tuple(sorted({(model.window(layer), model.attn_soft_cap) for layer in range(model.num_layers)}))
        shape = AttentionShape(
            heads, self.kv_spec.num_kv_heads, model.head_dim, self.page_size, self.dtype, self.device,
            scale=model.softmax_scale, layer_kinds=layer_kinds, kv_dtype=self.kv_spec.dtype,
            sinks=model.attention_sinks,
        )  # fmt: skip
        return get_backend(config.attention_backend, shape)

    def _load(self, model_dir: Path, config: EngineConfig) -> DecoderModel:
        layers = self.stage_layers if self.is_stage else None  # read and hold no others
        loaded = load_weights(model_dir, self.model_config, config, self.dtype, self.device, self.shard, layers)
        logger.info("weights: %s", loaded.description)
        self.weights_description = loaded.description
        return loaded.model

    def _warm_up_compiled(self) -> float:
        started = time.perf_counter()
        self.warm_up(self._scratch_cache(WARM_UP_TOKENS))
        seconds = time.perf_counter() - started
        assert isinstance(self.forward, CompiledForward)
        sources = ", ".join(
            f"{name} {entry.source}" + (f" in {entry.seconds:.1f} s" if entry.source != "traced" else "")
            for name, entry in self.forward.entries().items()
        )
        logger.info("torch.compile: model compiled and warmed up in %.1f s (%s)", seconds, sources)
        return seconds

    def _agreed_pages(self, config: EngineConfig, limit: int) -> int:
        """The pool's pages: as set, or what the memory budget holds; with several ranks, the
        fewest any can hold (every rank the same page count)."""
        num_pages = config.num_pages
        if num_pages is None:
            extra = self.shared_pool
            budget = kv_budget_bytes(
                config, self.device, lambda: self._measure_cuda(config, limit), extra.reserved_bytes
            )
            num_pages = budget // (self.kv_spec.bytes_per_page + extra.bytes_per_page)
        if self.layout.world_size > 1:
            found = torch.tensor([num_pages], dtype=torch.int64, device=self.device)
            dist.all_reduce(found, op=dist.ReduceOp.MIN)
            num_pages = int(found.item())
        return num_pages

    def _allocate_kv_pool(self) -> torch.Tensor:
        # With CUDA graphs one more page than the scheduler sees: padding rows write into it.
        kv_cache = self.kv_spec.allocate(self.num_pages + (1 if self.use_cuda_graphs else 0), self.device)
        gib = kv_cache.numel() * kv_cache.element_size() / (1 << 30)
        logger.info(
            "KV cache: %d pages of %d tokens (%d tokens, %.2f GiB, %s%s)",
            self.num_pages,
            self.page_size,
            self.num_pages * self.page_size,
            gib,
            str(self.kv_spec.dtype).removeprefix("torch."),
            ", FP8 at a per-tensor scale of 1.0" if is_fp8(self.kv_spec.dtype) else "",
        )
        return kv_cache

    def _capture_graphs(self, config: EngineConfig) -> CudaGraphRunner:
        sizes = capture_sizes(config.max_num_seqs)
        buffers = DecodeBuffers(max(sizes), self.max_pages_per_seq, self.page_size, self.num_pages, self.device)
        graphs = CudaGraphRunner(self.decode_graph_forward(self.kv_cache), buffers, sizes, self.backend)
        with torch.inference_mode():
            graphs.capture()
        return graphs

    def _measure_cuda(self, config: EngineConfig, limit: int) -> tuple[int, int]:
        """(activation bytes of the largest forward, bytes of the largest decode graph's pool),
        measured against a scratch cache before the real pool exists, for the context `limit`
        asked for (before the pool may lower it)."""
        weights = torch.cuda.memory_allocated(self.device)
        tokens = min(config.max_num_batched_tokens, limit)
        scratch = self._scratch_cache(tokens)
        self.warm_up(scratch, tokens)
        activations = torch.cuda.max_memory_allocated(self.device) - weights
        graph_pool = 0
        if self.use_cuda_graphs:
            size = max(capture_sizes(config.max_num_seqs))
            max_pages = -(-limit // self.page_size)
            buffers = DecodeBuffers(size, max_pages, self.page_size, scratch.shape[1] - 1, self.device)
            before = torch.cuda.memory_reserved(self.device)
            probe = CudaGraphRunner(self.decode_graph_forward(scratch), buffers, [size], self.backend)
            with torch.inference_mode():
                probe.capture()
            graph_pool = torch.cuda.memory_reserved(self.device) - before
            del probe
        return activations, graph_pool

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def max_model_len(self) -> int:
        """The context limit, as the KV pool decided it."""
        return self.pool.max_model_len

    @property
    def weight_bytes(self) -> int:
        """The model's tensors (parameters and buffers, each storage once) on this rank."""
        seen: set[int] = set()
        total = 0
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's own shard
            key = local.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += local.untyped_storage().nbytes()
        return total

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    def _scratch_cache(self, tokens: int) -> torch.Tensor:
        """A small KV cache for start-up forwards, before the real pool exists."""
        return self.kv_spec.allocate(self.kv_spec.pages_for_tokens(tokens) + 1, self.device)

    @torch.inference_mode()
    def warm_up(self, kv_cache: torch.Tensor, tokens: int = WARM_UP_TOKENS) -> None:
        """Run the shapes the engine will meet (many tokens, then one) once, so compilation
        happens at start and not in the first requests."""
        table = list(range(self.kv_spec.pages_for_tokens(tokens)))
        for query_len in (tokens, 1):
            metadata = AttentionMetadata.build([query_len], [tokens], [table], self.page_size, self.device)
            ids = torch.zeros(query_len, dtype=torch.int64, device=self.device)
            positions = torch.arange(tokens - query_len, tokens, device=self.device)
            hidden = self._hidden(ids, positions, kv_cache, metadata)
            self.forward.logits(hidden[-1:])

    # -- running a step -------------------------------------------------------------------------

    def _hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        lora_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """`lora_slots`: each sequence's adapter slot (-1 or None: the base model)."""
        with nvtx_range("attention plan"):
            plan = self.backend.prepare(metadata, kv_cache)
            starts = metadata.query_start_loc_cpu
            self.adapter_slots.set_tokens([end - start for start, end in itertools.pairwise(starts)], lora_slots)
        with attention_forward(self.backend, plan):
            return self.forward.hidden(input_ids, positions, kv_cache)

    def decode_graph_forward(self, kv_cache: torch.Tensor) -> Any:
        """What a decode graph runs: the fp32 logits of every row, by the graph's plan."""

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, plan: Any) -> torch.Tensor:
            with attention_forward(self.backend, plan):
                return self.forward.logits(self.forward.hidden(input_ids, positions, kv_cache)).float()

        return forward

    def _tensors(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        metadata = AttentionMetadata.build(
            inputs.query_lens, inputs.seq_lens, inputs.block_tables, self.page_size, self.device
        )
        input_ids = torch.tensor(inputs.token_ids, dtype=torch.int64, device=self.device)
        position_ids = torch.tensor(inputs.positions, dtype=torch.int64, device=self.device)
        return input_ids, position_ids, metadata

    @torch.inference_mode()
    def hidden_states(self, inputs: StepInputs) -> torch.Tensor:
        """The final hidden states of every new token of the step, [tokens, hidden] (what the
        oracle comparisons read; `execute` samples only each sequence's last)."""
        input_ids, positions, metadata = self._tensors(inputs)
        return self._hidden(input_ids, positions, self.kv_cache, metadata, inputs.lora_slots)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> StepOutput:
        """Run one step (pages must already be allocated). Rank 0 of several first sends it to
        the other ranks, which run it here too, the same way: a decode batch that fits a captured
        size replays its CUDA graph (so tensor-parallel ranks issue the same all-reduces), any
        other batch (and any pooling step) runs the model. On rank 0, what the step `wants`: the
        logits after each sequence's last new token, fp32 [num_seqs, vocab] (a sequence with
        `logit_counts` gets rows for its last tokens instead), or every new token's final hidden
        state; nothing on the other ranks."""
        with self.steps.step(inputs) if self.steps is not None else contextlib.nullcontext():
            return self._execute(inputs)

    def _execute(self, inputs: StepInputs) -> StepOutput:
        if inputs.page_copies:
            self.copy_pages(inputs.page_copies)
        answer = inputs.wants if self.answers else Wants.NOTHING
        with nvtx_range("forward"):
            if self.graphs is not None and inputs.decode_only and inputs.wants is not Wants.HIDDEN_STATES:
                # The graphs read each row's adapter slot from the slots' buffer.
                self.adapter_slots.set_tokens(inputs.query_lens, inputs.lora_slots, self.graphs.buffers.max_size)
                replayed = self.graphs.replay(inputs.token_ids, inputs.positions, inputs.block_tables)
                if replayed is not None:  # the graph's output buffer is rewritten by the next replay
                    return Logits(replayed.clone()) if answer is Wants.LOGITS else NoOutput()
            ran = self._step_hidden(inputs)
            if ran is None or answer is Wants.NOTHING:
                return NoOutput()
            hidden, metadata = ran
            if answer is Wants.HIDDEN_STATES:
                return HiddenStates(hidden.float())
            if inputs.logit_counts is not None:  # each sequence's last tokens (drafts verified)
                ends = metadata.query_start_loc_cpu[1:]
                rows = [
                    row for end, count in zip(ends, inputs.logit_counts, strict=True) for row in range(end - count, end)
                ]
                hidden = hidden[torch.tensor(rows, device=hidden.device)]
            elif not metadata.decode_only:  # each sequence's last new token
                hidden = hidden[metadata.query_start_loc[1:].long() - 1]
            return Logits(self.forward.logits(hidden).float())

    def _step_hidden(self, inputs: StepInputs) -> tuple[torch.Tensor, AttentionMetadata] | None:
        """Every new token's final hidden state, with the step's attention metadata (None: this
        rank does not hold them)."""
        input_ids, positions, metadata = self._tensors(inputs)
        return self._hidden(input_ids, positions, self.kv_cache, metadata, inputs.lora_slots), metadata

    def copy_pages(self, copies: list[PageCopy]) -> None:
        """Copy each `PageCopy`'s leading tokens' K/V (every layer, K and V) into its page, in
        order: a page may be read by one copy and written by a later one."""
        for copy in copies:
            self.kv_cache[:, copy.dst, :, : copy.num_tokens] = self.kv_cache[:, copy.src, :, : copy.num_tokens]

    def send_while_idle(self, ranks_alive: Callable[[], bool]) -> None:
        """Rank 0 of several: keep the other ranks from timing out while no step comes
        (executor/distributed.py's StepSender)."""
        assert self.steps is not None, "only rank 0 of several ranks sends steps"
        self.steps.send_while_idle(ranks_alive)

    def stop_workers(self, stop_ranks: bool = True) -> None:
        """No more steps; with `stop_ranks`, the other ranks are told to leave."""
        if self.steps is not None:
            self.steps.close(stop_ranks)
