"""ModelRunner: owns the model and the KV page pool, turns a batch of (sequence, new-token count)
into input tensors and attention metadata, and returns each sequence's next-token logits."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from compiled_engine.attention.backend import get_backend
from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.cache.kv_cache import allocate_kv_cache, pages_for_budget
from compiled_engine.config import EngineConfig
from compiled_engine.engine.sequence import Sequence
from compiled_engine.errors import ModelConfigError, RequestError
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.loader import load_model
from compiled_engine.profiling import nvtx_range

logger = logging.getLogger(__name__)

ScheduledBatch = list[tuple[Sequence, int]]  # each sequence with how many new tokens it runs


class ModelRunner:
    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
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
        self.model = load_model(
            model_dir, self.model_config, get_backend(config.attention_backend), self.dtype, self.device
        )
        budget = int(config.kv_cache_memory_gib * (1 << 30))
        self.num_pages = config.num_pages or pages_for_budget(
            self.model_config, self.page_size, self.dtype, budget
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
        self.kv_cache = allocate_kv_cache(
            self.model_config, self.num_pages, self.page_size, self.dtype, self.device
        )
        logger.info(
            "KV cache: %d pages of %d tokens (%.2f GiB)",
            self.num_pages, self.page_size, self.kv_cache.numel() * self.kv_cache.element_size() / (1 << 30),
        )

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

    def prepare_inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
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
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, [seq.block_table for seq, _ in batch], self.page_size, self.device
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        position_ids = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return input_ids, position_ids, metadata

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run the new tokens of every sequence in `batch` (pages must already be allocated) and
        return the logits after each sequence's last new token, fp32 [num_seqs, vocab]."""
        with nvtx_range("prepare inputs"):
            input_ids, positions, metadata = self.prepare_inputs(batch)
        with nvtx_range("forward"):
            hidden = self.model(input_ids, positions, self.kv_cache, metadata)
            last = torch.tensor(metadata.query_start_loc_cpu[1:], device=self.device) - 1
            return self.model.compute_logits(hidden[last]).float()
