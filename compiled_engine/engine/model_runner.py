"""ModelRunner: owns the model, its attention backend and the KV page pool; turns a scheduled batch
of (sequence, new-token count) into input tensors and the backend's plan, runs the forward, and
returns each sequence's next-token logits.

Construction is a sequence of named steps, in the order they depend on each other: choose the
attention backend, load (and with tensor parallelism shard) the weights, install the products'
kernels and the LoRA slots (linear/install.py), compile and warm up, size and allocate the KV
pool, capture the decode CUDA graphs.
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
from compiled_engine.cache_paths import compiled_dir, inductor_dir
from compiled_engine.config import EngineConfig
from compiled_engine.engine.adapters import AdapterInstall, install_no_adapters
from compiled_engine.engine.compilation import CompiledForward, ModelForward, model_forward, use_compile_cache
from compiled_engine.engine.cuda_graphs import MAX_CAPTURE_SIZE, CudaGraphRunner, DecodeBuffers, capture_sizes
from compiled_engine.engine.frame_arena import install_frame_arena
from compiled_engine.engine.memory_budget import kv_budget_bytes
from compiled_engine.engine.precompiled import artifact_dir, model_signature
from compiled_engine.engine.step_inputs import ScheduledBatch, StepInputs
from compiled_engine.errors import ModelConfigError
from compiled_engine.linear.install import install_kernels
from compiled_engine.linear.tensor_parallel import parallelize
from compiled_engine.model.layers import DecoderModel
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.model.shard import NO_SHARD, TPShard
from compiled_engine.parallel.distributed import StepSender
from compiled_engine.parallel.pipeline import ParallelLayout, StageLinks, link_stage, stage_layers
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


class ModelRunner:
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
        """`shard` and `mesh`: this rank's part of a tensor-parallel model (parallel/).
        `shared_pool`: what a second model under the same page ids adds (a draft model).
        `install_adapters`: puts the adapter products into the model before it is compiled
        (engine/adapters.py). `layout`: this rank's place among the engine's ranks (its pipeline
        stage; None: the only rank, or a tensor-parallel one as `shard` says)."""
        install_frame_arena()  # a step's Python calls stay off mmap at any stack depth
        self.shard = shard
        self.layout = layout or ParallelLayout(shard.rank, 1, shard.size)
        self.links: StageLinks | None = None  # a pipeline stage's sends and receives (linked last)
        self.micro_batches = config.pipeline_micro_batches or self.layout.pipeline_size
        self.shared_pool = shared_pool or SharedPool()
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.model_config = config_from_model_dir(model_dir)
        self.page_size = config.page_size
        self.max_model_len = self._context_limit(config)
        self.model_config = self.model_config.for_context(self.max_model_len)
        self.stage_layers = stage_layers(self.model_config.num_layers, self.layout.pipeline_size, self.layout.stage)
        self.kv_spec = KVCacheSpec(
            len(self.stage_layers),
            shard.kv_heads(self.model_config)[1],
            self.model_config.head_dim,
            self.page_size,
            config.resolved_kv_cache_dtype(),
        )
        self.backend = self._choose_backend(config)
        self.model = self._load(model_dir, config, mesh)
        if config.cpu_activations != "fp32" and self.device.type != "cpu":
            raise ValueError(f"--cpu-activations {config.cpu_activations} runs on the CPU only, not {self.device.type}")
        install_kernels(self.model, not config.resolved_enforce_eager(), config.cpu_activations)
        max_tokens = max(config.max_num_batched_tokens, WARM_UP_TOKENS, MAX_CAPTURE_SIZE)
        self.adapter_slots = install_adapters(self.model, self.model_config, max_tokens, self.dtype)
        self.forward, self.compile_seconds = self._compile_and_warm_up(config)
        # With tensor parallelism every rank captures the same sizes in the same order and replays
        # the same padded size each step (`execute`), so the all-reduces match.
        self.use_cuda_graphs = (
            self.forward.compiled
            and self.layout.pipeline_size == 1  # a stage's step waits on its neighbours: not graphed
            and config.cuda_graphs
            and self.device.type == "cuda"
            and self.backend.supports_cuda_graphs
        )
        self.num_pages = self._size_kv_pool(config)
        self.kv_cache = self._allocate_kv_pool()
        self.graphs = self._capture_graphs(config) if self.use_cuda_graphs else None
        if self.layout.pipeline_size > 1:  # each stage compiled and warmed up alone; now linked
            self.links = StageLinks(self.layout, config.distributed_timeout_s)
            link_stage(self.model, self.links)
        self.steps: StepSender | None = None  # rank 0 of several: its steps go to the other ranks
        if self.layout.world_size > 1 and self.layout.rank == 0:
            self.steps = StepSender(config.distributed_timeout_s)

    # -- construction ---------------------------------------------------------------------------

    def _context_limit(self, config: EngineConfig) -> int:
        limit = config.max_model_len or self.model_config.max_position_embeddings
        if limit > self.model_config.max_position_embeddings:
            raise ModelConfigError(
                f"max_model_len={limit} exceeds the model's max_position_embeddings={self.model_config.max_position_embeddings}"
            )
        return limit

    def _choose_backend(self, config: EngineConfig) -> AttentionBackend[Any]:
        model = self.model_config
        heads = self.shard.heads(model)[1]
        # The distinct (window, soft_cap) pairs of the layers: a backend that plans per kind
        # (FlashInfer) plans each once per forward, and the selector refuses one that lacks them.
        layer_kinds = tuple(sorted({(model.window(layer), model.attn_soft_cap) for layer in range(model.num_layers)}))
        shape = AttentionShape(
            heads, self.kv_spec.num_kv_heads, model.head_dim, self.page_size, self.dtype, self.device,
            scale=model.softmax_scale, layer_kinds=layer_kinds, kv_dtype=self.kv_spec.dtype,
        )  # fmt: skip
        return get_backend(config.attention_backend, shape)

    def _load(self, model_dir: Path, config: EngineConfig, mesh: DeviceMesh | None) -> DecoderModel:
        layers = self.stage_layers if self.layout.pipeline_size > 1 else None  # read and hold no others
        loaded = load_weights(model_dir, self.model_config, config, self.dtype, self.device, self.shard, layers)
        logger.info("weights: %s", loaded.description)
        self.weights_description = loaded.description
        model = loaded.model
        if self.shard.size > 1:
            if mesh is None:
                raise ValueError("a tensor-parallel shard needs its device mesh")
            parallelize(model, mesh)
        return model

    def _compile_and_warm_up(self, config: EngineConfig) -> tuple[ModelForward, float]:
        compiled = not config.resolved_enforce_eager()
        if not compiled:
            return model_forward(self.model, compiled=False), 0.0
        use_compile_cache(inductor_dir())
        saved_dir = None
        # CPU only for now: saved traces replayed inside CUDA graphs have not run on a GPU yet.
        # Not for a pipeline stage: its one-token steps run the layers one by one, which the
        # saved layer trace (made for steps of several tokens) does not take.
        if config.compile_cache and self.device.type == "cpu" and self.layout.pipeline_size == 1:
            key = [*model_signature(self.model), repr(self.model_config), self.weights_description, str(self.dtype)]
            saved_dir = artifact_dir(compiled_dir(), key)
        whole = self.layout.pipeline_size == 1
        forward = model_forward(self.model, compiled=True, saved_dir=saved_dir, whole_forward=whole)
        self.forward = forward
        started = time.perf_counter()
        self.warm_up(self._scratch_cache(WARM_UP_TOKENS))
        seconds = time.perf_counter() - started
        assert isinstance(forward, CompiledForward)
        sources = ", ".join(
            f"{name} {entry.source}" + (f" in {entry.seconds:.1f} s" if entry.source != "traced" else "")
            for name, entry in forward.entries().items()
        )
        logger.info("torch.compile: model compiled and warmed up in %.1f s (%s)", seconds, sources)
        return forward, seconds

    def _size_kv_pool(self, config: EngineConfig) -> int:
        """The pages the scheduler may hand out; lowers max_model_len (with a warning) to what
        they hold, unless the user set it, in which case it must fit."""
        num_pages = config.num_pages
        if num_pages is None:
            extra = self.shared_pool
            budget = kv_budget_bytes(config, self.device, lambda: self._measure_cuda(config), extra.reserved_bytes)
            num_pages = budget // (self.kv_spec.bytes_per_page + extra.bytes_per_page)
        if self.layout.world_size > 1:  # every rank the same page count: the fewest any can hold
            found = torch.tensor([num_pages], dtype=torch.int64, device=self.device)
            dist.all_reduce(found, op=dist.ReduceOp.MIN)
            num_pages = int(found.item())
        capacity = num_pages * self.page_size
        if capacity < self.max_model_len:
            if config.max_model_len is not None:
                raise ModelConfigError(
                    f"max_model_len={self.max_model_len} needs {self.max_model_len} tokens of KV cache, but "
                    f"{num_pages} pages of {self.page_size} hold {capacity}: raise --kv-cache-memory-gib "
                    f"or --num-pages, or lower --max-model-len"
                )
            # One sequence as long as the context must fit, or requests the model accepts would fail.
            logger.warning(
                "max_model_len lowered from %d to %d: the KV cache holds %d tokens",
                self.max_model_len,
                capacity,
                capacity,
            )
            self.max_model_len = capacity
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

    def _measure_cuda(self, config: EngineConfig) -> tuple[int, int]:
        """(activation bytes of the largest forward, bytes of the largest decode graph's pool),
        measured against a scratch cache before the real pool exists."""
        weights = torch.cuda.memory_allocated(self.device)
        tokens = min(config.max_num_batched_tokens, self.max_model_len)
        scratch = self._scratch_cache(tokens)
        self.warm_up(scratch, tokens)
        activations = torch.cuda.max_memory_allocated(self.device) - weights
        graph_pool = 0
        if self.use_cuda_graphs:
            size = max(capture_sizes(config.max_num_seqs))
            buffers = DecodeBuffers(size, self.max_pages_per_seq, self.page_size, scratch.shape[1] - 1, self.device)
            before = torch.cuda.memory_reserved(self.device)
            probe = CudaGraphRunner(self.decode_graph_forward(scratch), buffers, [size], self.backend)
            with torch.inference_mode():
                probe.capture()
            graph_pool = torch.cuda.memory_reserved(self.device) - before
            del probe
        return activations, graph_pool

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
        oracle comparisons read; `run` keeps only each sequence's last)."""
        input_ids, positions, metadata = self._tensors(inputs)
        return self._hidden(input_ids, positions, self.kv_cache, metadata, inputs.lora_slots)

    @torch.inference_mode()
    def run(
        self,
        batch: ScheduledBatch,
        lora_slots: list[int] | None = None,
        page_copies: list[PageCopy] | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Run the new tokens of every sequence in `batch` (pages must already be allocated) and
        return the logits after each sequence's last new token, fp32 [num_seqs, vocab]; a
        sequence with draft tokens gets rows for its last 1 + drafts tokens instead. `hidden`
        (pooling): every new token's final hidden state instead, fp32 [num_tokens, hidden]. The
        one way to run a scheduled batch; tensor-parallel ranks receive the same step (`execute`)."""
        with nvtx_range("prepare inputs"):
            inputs = StepInputs.from_batch(batch, lora_slots, page_copies, hidden_states=hidden)
        with self.steps.step(inputs) if self.steps is not None else contextlib.nullcontext():
            out = self.execute(inputs)
        assert out is not None
        return out

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, logits: bool = True) -> torch.Tensor | None:
        """Every rank runs each step here, the same way: a decode batch that fits a captured
        size replays its CUDA graph (so tensor-parallel ranks issue the same all-reduces), any
        other batch (and any pooling step, `inputs.hidden_states`) runs the model. Only rank 0
        asks for the logits of eager steps, or the hidden states of a pooling one."""
        if inputs.page_copies:
            self.copy_pages(inputs.page_copies)
        with nvtx_range("forward"):
            if self.graphs is not None and inputs.decode_only and not inputs.hidden_states:
                # The graphs read each row's adapter slot from the slots' buffer.
                self.adapter_slots.set_tokens(inputs.query_lens, inputs.lora_slots, self.graphs.buffers.max_size)
                replayed = self.graphs.replay(inputs.token_ids, inputs.positions, inputs.block_tables)
                if replayed is not None:
                    return replayed.clone()  # the graph's output buffer is rewritten by the next replay
            if self.links is not None:
                staged = self._pipeline_hidden(inputs)
                if staged is None or not logits:  # a rank other than 0
                    return None
                hidden = staged
                metadata = AttentionMetadata.build(  # the whole step's, for the rows to sample
                    inputs.query_lens, inputs.seq_lens, inputs.block_tables, self.page_size, self.device
                )
            else:
                input_ids, positions, metadata = self._tensors(inputs)
                hidden = self._hidden(input_ids, positions, self.kv_cache, metadata, inputs.lora_slots)
                if not logits:
                    return None
            if inputs.hidden_states:
                return hidden.float()
            if inputs.logit_counts is not None:  # each sequence's last tokens (drafts verified)
                ends = metadata.query_start_loc_cpu[1:]
                rows = [
                    row for end, count in zip(ends, inputs.logit_counts, strict=True) for row in range(end - count, end)
                ]
                hidden = hidden[torch.tensor(rows, device=hidden.device)]
            elif not metadata.decode_only:  # each sequence's last new token
                hidden = hidden[metadata.query_start_loc[1:].long() - 1]
            return self.forward.logits(hidden).float()

    def _pipeline_hidden(self, inputs: StepInputs) -> torch.Tensor | None:
        """A pipeline stage's part of a step: the step in micro-batches of whole sequences (one
        per stage unless --pipeline-micro-batches says otherwise), each run through this stage's
        layers (receiving from the stage before, sending to the one after) as soon as the last is
        sent on, so that the stages work on different micro-batches at once. On rank 0, the
        final hidden states of every token, as the last stage sent them back; None elsewhere."""
        assert self.links is not None
        sent = []
        for part in inputs.micro_batches(self.micro_batches):
            input_ids, positions, metadata = self._tensors(part)
            hidden = self._hidden(input_ids, positions, self.kv_cache, metadata, part.lora_slots)
            self.links.send_final(hidden)
            sent.append(hidden)
        final = None
        if self.layout.rank == 0:
            final = torch.cat([self.links.receive_final(hidden) for hidden in sent])
        self.links.finish()
        return final

    def copy_pages(self, copies: list[PageCopy]) -> None:
        """Copy each `PageCopy`'s leading tokens' K/V (every layer, K and V) into its page, in
        order: a page may be read by one copy and written by a later one."""
        for copy in copies:
            self.kv_cache[:, copy.dst, :, : copy.num_tokens] = self.kv_cache[:, copy.src, :, : copy.num_tokens]

    def send_while_idle(self, ranks_alive: Callable[[], bool]) -> None:
        """Rank 0 of several: keep the other ranks from timing out while no step comes
        (parallel/distributed.py's StepSender)."""
        assert self.steps is not None, "only rank 0 of several ranks sends steps"
        self.steps.send_while_idle(ranks_alive)

    def stop_workers(self, stop_ranks: bool = True) -> None:
        """No more steps; with `stop_ranks`, the other ranks are told to leave."""
        if self.steps is not None:
            self.steps.close(stop_ranks)
