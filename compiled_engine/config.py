"""EngineConfig: the options a user picks, resolved once (device, dtype) into plain values."""

from __future__ import annotations

import os

import msgspec
import torch

from compiled_engine.cache.kv_cache import DEFAULT_PAGE_SIZE
from compiled_engine.engine.sampler import SAMPLERS
from compiled_engine.speculative.config import SpeculativeConfig

ENFORCE_EAGER_ENV = "COMPILED_ENGINE_ENFORCE_EAGER"
DEVICES = ("cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


QUANTIZATIONS = ("none", "int8", "int4")


class EngineConfig(msgspec.Struct, frozen=True):
    model: str | None = None  # local dir or Hub id; None = the embedded default model
    device: str | None = None  # "cpu" or "cuda"; None = cuda when available
    dtype: str | None = None  # None = bfloat16 on cuda, float32 on cpu
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None  # None = as many as the KV cache memory holds
    # None = 1 GiB on CPU; on CUDA what gpu_memory_utilization leaves after weights,
    # activations and CUDA graphs.
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    attention_backend: str | None = (
        None  # one of attention.backend.BACKENDS; None = flashinfer on CUDA, cpu on the CPU, when they can run
    )
    sampler: str | None = None  # one of engine.sampler.SAMPLERS; None = flashinfer on CUDA when installed
    max_num_seqs: int = 256  # sequences running at once
    max_num_batched_tokens: int = 2048  # tokens in one forward (decodes plus prefill chunks)
    enable_prefix_caching: bool = True
    seed: int | None = None  # seeds the draw of per-request seeds for requests without one
    # None = compile unless COMPILED_ENGINE_ENFORCE_EAGER=1; True = plain eager PyTorch, no
    # torch.compile and no CUDA graphs (the slow twin every fast path is tested against).
    enforce_eager: bool | None = None
    cuda_graphs: bool = True  # decode through captured CUDA graphs (CUDA only, not with eager)
    # Compiled: save the traced model at the first start and load it at the next ones
    # (engine/precompiled.py); False traces it at every start.
    compile_cache: bool = True
    tensor_parallel_size: int = 1  # ranks the model is split across (parallel/)
    # CPU threads for each of the engine's processes; None: torch's default for one process, and
    # each tensor-parallel rank its share of the cores (parallel/threads.py).
    cpu_threads: int | None = None
    distributed_timeout_s: float = 60.0  # a collective that waits longer fails (a rank died or hung)
    # One of QUANTIZATIONS: the layer products' weights quantized at load. None = the checkpoint's
    # own: a GGUF's quantized tensors stay as they are (the default model runs its Q4_1/Q8_0
    # weights), safetensors stay dense. "none" = dense weights, a GGUF dequantized.
    quantization: str | None = None
    quantization_group_size: int | None = None  # None = per output channel for int8, 32 for int4
    quantize_head: bool = True  # with int8/int4: the head and embedding too, as int8 in groups of 32
    # LoRA adapters (lora/): off unless enabled; then `max_loras` device slots, adapters of rank
    # up to `max_lora_rank`, and at most `max_cpu_loras` loaded (None: as many as the slots).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (speculative/): the JSON of a SpeculativeConfig, as vLLM's
    # --speculative-config, e.g. '{"method": "ngram", "num_speculative_tokens": 4}'; None: off.
    speculative_config: str | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization_group_size is not None and self.quantization not in ("int8", "int4"):
            raise ValueError("quantization_group_size needs quantization int8 or int4")
        if self.sampler is not None and self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be {' or '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters with tensor parallelism are not supported yet")
        self.resolved_speculative()  # a bad speculative config fails here, before any work
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        for name in (
            "page_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
            "max_loras",
            "max_lora_rank",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {self.num_pages}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def resolved_speculative(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    def resolved_device(self) -> torch.device:
        name = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if name not in DEVICES:
            raise ValueError(f"device must be {' or '.join(map(repr, DEVICES))}, got {name!r}")
        if name == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        return torch.device(name)

    def resolved_enforce_eager(self) -> bool:
        if self.enforce_eager is not None:
            return self.enforce_eager
        return os.environ.get(ENFORCE_EAGER_ENV, "0") == "1"

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]
