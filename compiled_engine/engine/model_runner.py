"""ModelRunner: owns the model and the KV page pool, turns a batch of (sequence, new-token count)
into input tensors and attention metadata, and returns each sequence's next-token logits."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import msgspec
import torch
from torch.distributed.device_mesh import DeviceMesh

from compiled_engine.attention.backend import AttentionShape, get_backend
from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.cache.kv_cache import allocate_kv_cache, pages_for_budget
from compiled_engine.config import EngineConfig
from compiled_engine.engine.compilation import compile_layers, use_compile_cache
from compiled_engine.engine.cuda_graphs import CudaGraphRunner, DecodeBuffers, capture_sizes
from compiled_engine.engine.sequence import Sequence
from compiled_engine.errors import ModelConfigError, RequestError
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.default_model import cache_root
from compiled_engine.model.loader import load_model
from compiled_engine.parallel.distributed import StepInputs, broadcast_step
from compiled_engine.parallel.plan import parallelize
from compiled_engine.parallel.shard import NO_SHARD, TPShard
from compiled_engine.profiling import nvtx_range

logger = logging.getLogger(__name__)

WARM_UP_TOKENS = 16
DEFAULT_CPU_KV_CACHE_GIB = 1.0
ScheduledBatch = list[tuple[Sequence, int]]  # each sequence with how many new tokens it runs


class ModelRunner:
    def __init__(self, model_dir: Path, config: EngineConfig, shard: TPShard = NO_SHARD, mesh: DeviceMesh | None = None) -> None:
        """`shard` and `mesh`: this rank's part of a tensor-parallel model (parallel/)."""
        self.shard = shard
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.model_config = ModelConfig.from_model_dir(model_dir)
        self.page_size = config.page_size
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ModelConfigError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={self.model_config.max_position_embeddings}"
            )
        shape = AttentionShape(
            shard.heads(self.model_config)[1], shard.kv_heads(self.model_config)[1], self.model_config.head_dim,
            self.page_size, self.dtype, self.device,
        )
        backend = get_backend(config.attention_backend, shape)
        self.model = load_model(model_dir, self.model_config, backend, self.dtype, self.device, shard)
        # The KV pool holds this rank's KV heads only.
        self.kv_config = msgspec.structs.replace(self.model_config, num_kv_heads=shard.kv_heads(self.model_config)[1])
        if shard.size > 1:
            if mesh is None:
                raise ValueError("a tensor-parallel shard needs its device mesh")
            parallelize(self.model, mesh)
        self.compiled = not config.resolved_enforce_eager()
        # The torch backend's decode reads device tensors only; FlashInfer plans each graph's
        # wrapper on the host before capture and replay (plan_graph). With tensor parallelism every rank captures the same sizes in the same order and
        # replays the same padded size each step (`execute`), so the all-reduces match.
        self.use_cuda_graphs = self.compiled and config.cuda_graphs and self.device.type == "cuda" and backend.name in ("torch", "flashinfer")
        self.compile_seconds = 0.0
        if self.compiled:
            use_compile_cache(cache_root() / "inductor")
            compile_layers(self.model)
            started = time.perf_counter()
            self.warm_up(self._scratch_cache(WARM_UP_TOKENS))
            self.compile_seconds = time.perf_counter() - started
            logger.info("torch.compile: decoder layer compiled and warmed up in %.1f s", self.compile_seconds)
        self.num_pages = config.num_pages or pages_for_budget(
            self.kv_config, self.page_size, self.dtype, self._kv_budget_bytes(config)
        )
        capacity = self.num_pages * self.page_size
        if capacity < self.max_model_len:
            if config.max_model_len is not None:
                raise ModelConfigError(
                    f"max_model_len={self.max_model_len} needs {self.max_model_len} tokens of KV cache, but "
                    f"{self.num_pages} pages of {self.page_size} hold {capacity}: raise --kv-cache-memory-gib "
                    f"or --num-pages, or lower --max-model-len"
                )
            # One sequence as long as the context must fit, or requests the model accepts would fail.
            logger.warning(
                "max_model_len lowered from %d to %d: the KV cache holds %d tokens",
                self.max_model_len, capacity, capacity,
            )
            self.max_model_len = capacity
        # With CUDA graphs one more page than the scheduler sees: padding rows write into it.
        total_pages = self.num_pages + (1 if self.use_cuda_graphs else 0)
        self.kv_cache = allocate_kv_cache(self.kv_config, total_pages, self.page_size, self.dtype, self.device)
        logger.info(
            "KV cache: %d pages of %d tokens (%.2f GiB)",
            self.num_pages, self.page_size, self.kv_cache.numel() * self.kv_cache.element_size() / (1 << 30),
        )
        self.graphs: CudaGraphRunner | None = None
        if self.use_cuda_graphs:
            sizes = capture_sizes(config.max_num_seqs)
            buffers = DecodeBuffers(max(sizes), self.max_pages_per_seq, self.page_size, self.num_pages, self.device)
            self.graphs = CudaGraphRunner(self.decode_logits, buffers, sizes, getattr(self.model.backend, "plan_graph", None))
            with torch.inference_mode():
                self.graphs.capture()

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    def _scratch_cache(self, tokens: int) -> torch.Tensor:
        """A small KV cache for start-up forwards, before the real pool exists."""
        return allocate_kv_cache(self.kv_config, -(-tokens // self.page_size) + 1, self.page_size, self.dtype, self.device)

    @torch.inference_mode()
    def warm_up(self, kv_cache: torch.Tensor, tokens: int = WARM_UP_TOKENS) -> None:
        """Run the shapes the engine will meet (many tokens, then one) once, so compilation
        happens at start and not in the first requests."""
        table = list(range(-(-tokens // self.page_size)))
        for query_len in (tokens, 1):
            metadata = AttentionMetadata.build([query_len], [tokens], [table], self.page_size, self.device)
            ids = torch.zeros(query_len, dtype=torch.int64, device=self.device)
            positions = torch.arange(tokens - query_len, tokens, device=self.device)
            hidden = self.model(ids, positions, kv_cache, metadata)
            self.model.compute_logits(hidden[-1:])

    def _kv_budget_bytes(self, config: EngineConfig) -> int:
        if config.kv_cache_memory_gib is not None:
            return int(config.kv_cache_memory_gib * (1 << 30))
        if self.device.type != "cuda":
            return int(DEFAULT_CPU_KV_CACHE_GIB * (1 << 30))
        return self._cuda_kv_budget_bytes(config)

    def _cuda_kv_budget_bytes(self, config: EngineConfig) -> int:
        """--gpu-memory-utilization of the device, less the weights, the activations of the
        largest forward (measured by running it) and the CUDA-graph pool (measured by capturing
        the largest decode graph once against a scratch cache)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        tokens = min(config.max_num_batched_tokens, self.max_model_len)
        scratch = self._scratch_cache(tokens)
        self.warm_up(scratch, tokens)
        activations = torch.cuda.max_memory_allocated(self.device) - weights
        graph_pool = 0
        if self.use_cuda_graphs:
            size = max(capture_sizes(config.max_num_seqs))
            scratch_page = scratch.shape[1] - 1
            buffers = DecodeBuffers(size, self.max_pages_per_seq, self.page_size, scratch_page, self.device)
            before = torch.cuda.memory_reserved(self.device)
            probe = CudaGraphRunner(functools.partial(self._logits, kv_cache=scratch), buffers, [size], getattr(self.model.backend, "plan_graph", None))
            with torch.inference_mode():
                probe.capture()
            graph_pool = torch.cuda.memory_reserved(self.device) - before
            del probe
        del scratch
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(config.gpu_memory_utilization * total) - weights - activations - graph_pool
        logger.info(
            "GPU memory: %.1f GiB total x %.2f; weights %.2f GiB, activations %.2f GiB, CUDA graphs %.2f GiB; KV cache gets %.2f GiB",
            total / 2**30, config.gpu_memory_utilization, weights / 2**30, activations / 2**30, graph_pool / 2**30, budget / 2**30,
        )
        if budget <= 0:
            raise ModelConfigError(
                f"no GPU memory is left for the KV cache at --gpu-memory-utilization {config.gpu_memory_utilization}: "
                "raise it, or lower --max-num-batched-tokens / --max-num-seqs"
            )
        return budget

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """fp32 logits of every token (for decode batches: of every sequence)."""
        return self.model.compute_logits(self.model(input_ids, positions, kv_cache, metadata)).float()

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self._logits(input_ids, positions, metadata, self.kv_cache)

    def check_prompt(self, prompt_ids: list[int], max_tokens: int) -> None:
        """A RequestError unless the prompt is non-empty, in the vocabulary, and fits the context
        together with `max_tokens`."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        total = len(prompt_ids) + max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}: "
                f"{total} exceeds the context length {self.max_model_len}"
            )

    def step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """The step as plain lists: what tensor-parallel workers receive."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens = [], []
        for seq, num_new in batch:
            start = seq.num_computed_tokens
            end = start + num_new
            token_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
        return StepInputs(token_ids, positions, query_lens, seq_lens, [list(seq.block_table) for seq, _ in batch])

    def tensors(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        metadata = AttentionMetadata.build(inputs.query_lens, inputs.seq_lens, inputs.block_tables, self.page_size, self.device)
        input_ids = torch.tensor(inputs.token_ids, dtype=torch.int64, device=self.device)
        position_ids = torch.tensor(inputs.positions, dtype=torch.int64, device=self.device)
        return input_ids, position_ids, metadata

    def prepare_inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return self.tensors(self.step_inputs(batch))

    @torch.inference_mode()
    def forward_step(self, inputs: StepInputs) -> torch.Tensor:
        """Every rank's part of a step: the forward (whose row-parallel layers all-reduce);
        returns the final hidden states of each sequence's last new token."""
        input_ids, positions, metadata = self.tensors(inputs)
        hidden = self.model(input_ids, positions, self.kv_cache, metadata)
        last = torch.tensor(metadata.query_start_loc_cpu[1:], device=self.device) - 1
        return hidden[last]

    def serve_as_worker(self) -> None:
        """A tensor-parallel rank other than 0: run each step rank 0 broadcasts, until it says stop."""
        while (inputs := broadcast_step(None)) is not None:
            self.execute(inputs, logits=False)

    def stop_workers(self) -> None:
        if self.shard.size > 1 and self.shard.rank == 0:
            broadcast_step(None)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the new tokens of every sequence in `batch` (pages must already be allocated) and
        return the logits after each sequence's last new token, fp32 [num_seqs, vocab]."""
        with nvtx_range("prepare inputs"):
            inputs = self.step_inputs(batch)
            if self.shard.size > 1:
                broadcast_step(inputs)
        logits = self.execute(inputs)
        assert logits is not None
        return logits

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, logits: bool = True) -> torch.Tensor | None:
        """Every rank runs each step here, the same way: a decode batch that fits a captured
        size replays its CUDA graph (so tensor-parallel ranks issue the same all-reduces), any
        other batch runs the model. Only rank 0 asks for the logits of eager steps."""
        with nvtx_range("forward"):
            if self.graphs is not None and all(q == 1 for q in inputs.query_lens):
                replayed = self.graphs.replay(inputs.token_ids, inputs.positions, inputs.block_tables)
                if replayed is not None:
                    return replayed.clone()  # the graph's output buffer is rewritten by the next replay
            hidden = self.forward_step(inputs)
            return self.model.compute_logits(hidden).float() if logits else None
