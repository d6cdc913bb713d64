"""The KV page pool's size. Its bytes: what the user set, 1 GiB on the CPU, or on CUDA what
`--gpu-memory-utilization` leaves after the weights, the largest forward's activations and the
CUDA-graph pool, each measured on the device (`kv_budget_bytes`). From its pages, the context
limit, decided once (`size_kv_pool`)."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.errors import ModelConfigError
from compiled_engine.model.config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_GIB = 1.0


@dataclass(frozen=True)
class KVPoolSize:
    num_pages: int  # the pages the scheduler may hand out
    max_model_len: int  # the context limit: the model's or the user's, lowered to what the pages hold


def context_limit(config: EngineConfig, model: ModelConfig) -> int:
    """The context the user asked for (or the model's own), before the KV pool is sized."""
    limit = config.max_model_len or model.max_position_embeddings
    if limit > model.max_position_embeddings:
        raise ModelConfigError(
            f"max_model_len={limit} exceeds the model's max_position_embeddings={model.max_position_embeddings}"
        )
    return limit


def size_kv_pool(num_pages: int, page_size: int, limit: int, user_set_limit: bool) -> KVPoolSize:
    """The pool of `num_pages` pages and the context it allows: `limit` lowered (with a warning)
    to what the pages hold, unless the user set it, in which case it must fit."""
    capacity = num_pages * page_size
    if capacity >= limit:
        return KVPoolSize(num_pages, limit)
    if user_set_limit:
        raise ModelConfigError(
            f"max_model_len={limit} needs {limit} tokens of KV cache, but "
            f"{num_pages} pages of {page_size} hold {capacity}: raise --kv-cache-memory-gib "
            f"or --num-pages, or lower --max-model-len"
        )
    # One sequence as long as the context must fit, or requests the model accepts would fail.
    logger.warning("max_model_len lowered from %d to %d: the KV cache holds %d tokens", limit, capacity, capacity)
    return KVPoolSize(num_pages, capacity)


def kv_budget_bytes(
    config: EngineConfig, device: torch.device, measure_cuda: Callable[[], tuple[int, int]], reserved_bytes: int = 0
) -> int:
    """`measure_cuda()` runs the largest forward and captures the largest decode graph once
    against a scratch cache, returning (activation bytes, graph pool bytes); only called on CUDA
    without an explicit budget. `reserved_bytes`: device memory something loaded later takes (a
    draft model's weights), kept out of the CUDA budget."""
    if config.kv_cache_memory_gib is not None:
        return int(config.kv_cache_memory_gib * (1 << 30))
    if device.type != "cuda":
        return int(DEFAULT_CPU_KV_CACHE_GIB * (1 << 30))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    activations, graph_pool = measure_cuda()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(config.gpu_memory_utilization * total) - weights - activations - graph_pool - reserved_bytes
    logger.info(
        "GPU memory: %.1f GiB total x %.2f; weights %.2f GiB, activations %.2f GiB, CUDA graphs %.2f GiB, reserved %.2f GiB; KV cache gets %.2f GiB",
        total / 2**30, config.gpu_memory_utilization, weights / 2**30, activations / 2**30, graph_pool / 2**30,
        reserved_bytes / 2**30, budget / 2**30,
    )  # fmt: skip
    if budget <= 0:
        raise ModelConfigError(
            f"no GPU memory is left for the KV cache at --gpu-memory-utilization {config.gpu_memory_utilization}: "
            "raise it, or lower --max-num-batched-tokens / --max-num-seqs"
        )
    return budget


def return_freed_heap() -> None:
    """Give the heap memory that start-up freed (the dense weights that packing replaced, the
    loader's temporaries) back to the system: glibc keeps freed allocations below its mmap
    threshold in its arenas otherwise, resident. A no-op where the C library is not glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
