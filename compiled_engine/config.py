"""EngineConfig: the options a user picks, resolved once (device, dtype) into plain values."""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

import msgspec
import torch

ENFORCE_EAGER_ENV = "COMPILED_ENGINE_ENFORCE_EAGER"
DEVICES = ("cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


QUANTIZATIONS = ("none", "int8", "int4")
# The KV pages' storage types (--kv-cache-dtype): "auto" keeps the activations' dtype; "fp8" is
# fp8_e4m3, as vLLM names it. FP8 pages hold K and V at a per-tensor scale of 1.0: each value
# saturated to the type's finite range, then rounded (docs/quantization.md).
KV_CACHE_DTYPES = {
    "auto": None,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
CPU_ACTIVATIONS = ("fp32", "int8")
RUNNERS = ("generate", "pooling")  # vLLM's --runner: generate text, or pool hidden states (embeddings)
SAMPLERS = ("torch", "flashinfer")
DEFAULT_PAGE_SIZE = 16  # tokens per KV page


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the engine proposes tokens to verify, in vLLM's shape: `--speculative-config '{"method":
    "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'` or
    `'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}'` on the command line,
    `LLM(speculative_config={...})` offline. EngineConfig holds it parsed (speculative/ runs it)."""

    METHODS: ClassVar[tuple[str, ...]] = ("ngram", "draft_model")  # each a drafter (compiled_engine/registrations.py)
    MODEL_METHODS: ClassVar[tuple[str, ...]] = ("draft_model",)  # the methods that take a "model"

    method: str
    num_speculative_tokens: int = 4  # draft tokens verified per sequence and step, at most
    # ngram: the longest suffix of the sequence, of prompt_lookup_max tokens down to
    # prompt_lookup_min, that occurred before proposes the tokens that followed it.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # draft_model: the draft's directory, GGUF file or Hub id; a smaller model with the target's
    # vocabulary (speculative/draft_model.py).
    model: str | None = None
    # No drafts in a step with more running sequences than this (None: no limit): a big batch
    # already fills the products, and verifying k tokens a sequence then costs k times as much
    # (16 repetitive requests at once ran at 0.72x with drafts on the CPU, docs/benchmarks.md).
    disable_by_batch_size: int | None = 8
    # A sequence whose drafts are accepted less often than this, once it has been offered
    # `acceptance_probe` draft tokens, stops speculating (its drafts cost more than they bring).
    min_acceptance_rate: float = 0.1
    acceptance_probe: int = 32
    # Each sequence's draft length follows its acceptance, as transformers' assisted generation
    # does: two more after a draft accepted whole, one less after a rejection, between 1 and
    # num_speculative_tokens. A verify row is not free (on the CPU each costs about a quarter of
    # a one-token step), so rows that would mostly be rejected are not drafted. False: always
    # num_speculative_tokens.
    adaptive_draft_length: bool = True

    def __post_init__(self) -> None:
        if self.method not in self.METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported (yet); the methods are {', '.join(self.METHODS)}"
            )
        takes_model = self.method in self.MODEL_METHODS
        if takes_model and not self.model:
            raise ValueError(f'the {self.method} method needs "model": the draft model\'s directory or GGUF file')
        if not takes_model and self.model is not None:
            raise ValueError(f'"model" is for the {" or ".join(self.MODEL_METHODS)} method, not {self.method!r}')
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                f"and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")
        if not 0 <= self.min_acceptance_rate <= 1:
            raise ValueError(f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From the JSON text of `--speculative-config`, a dict (`LLM(speculative_config={...})`, as in
        vLLM) or a config; None stays None. A ValueError names what is wrong."""
        if value is None or isinstance(value, cls):
            return value
        try:
            data = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative_config is not JSON: {error}") from None
        if not isinstance(data, dict):
            raise ValueError("speculative_config must be a JSON object")
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as error:
            raise ValueError(f"speculative_config: {error}") from None


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
    # (executor/precompiled.py); False traces it at every start.
    compile_cache: bool = True
    tensor_parallel_size: int = 1  # ranks each layer's products are split across (parallel/)
    # Stages the layers are split across, each a slice of them (executor/pipeline.py); the engine
    # runs pipeline_parallel_size x tensor_parallel_size ranks.
    pipeline_parallel_size: int = 1
    # Micro-batches a pipeline step is cut into, at most (None: one per stage).
    pipeline_micro_batches: int | None = None
    # CPU threads for each of the engine's processes; None: torch's default for one process, and
    # each tensor-parallel rank its share of the cores (executor/threads.py).
    cpu_threads: int | None = None
    # Engine replicas behind one server, each on its share of the cores or its own GPUs
    # (serving/; `serve` only: an LLMEngine is one replica).
    data_parallel_size: int = 1
    distributed_timeout_s: float = 60.0  # a collective that waits longer fails (a rank died or hung)
    # A data-parallel replica that sends nothing (no step report, no idle heartbeat) for longer is
    # lost: stopped or hung. One step must not take longer.
    replica_heartbeat_timeout_s: float = 120.0
    # One of QUANTIZATIONS: the layer products' weights quantized at load. None = the checkpoint's
    # own: a GGUF's quantized tensors stay as they are (the default model runs its Q4_1/Q8_0
    # weights), safetensors stay dense. "none" = dense weights, a GGUF dequantized.
    quantization: str | None = None
    quantization_group_size: int | None = None  # None = per output channel for int8, 32 for int4
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES: the KV pages' storage type
    quantize_head: bool = True  # with int8/int4: the head and embedding too, as int8 in groups of 32
    # One of CPU_ACTIVATIONS: "fp32" (exact) or "int8", the quantized products' activations rounded
    # to int8 in blocks of 32 for integer dot products (llama.cpp's numerics; lossy, opt-in).
    cpu_activations: str = "fp32"
    # LoRA adapters (lora/): off unless enabled; then `max_loras` device slots, adapters of rank
    # up to `max_lora_rank`, and at most `max_cpu_loras` loaded (None: as many as the slots).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (speculative/): a SpeculativeConfig, given as one, as a dict or as the
    # JSON of vLLM's --speculative-config, e.g. '{"method": "ngram", "num_speculative_tokens": 4}',
    # and held parsed (`speculative`); None: off.
    speculative_config: SpeculativeConfig | str | dict[str, Any] | None = None
    # "generate" (text) or "pooling" (one embedding a prompt, pooling/; /v1/embeddings).
    runner: str = "generate"

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization_group_size is not None and self.quantization not in ("int8", "int4"):
            raise ValueError("quantization_group_size needs quantization int8 or int4")
        if self.cpu_activations not in CPU_ACTIVATIONS:
            raise ValueError(
                f"cpu_activations must be one of {', '.join(CPU_ACTIVATIONS)}, got {self.cpu_activations!r}"
            )
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.sampler is not None and self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be {' or '.join(SAMPLERS)}, got {self.sampler!r}")
        # Parsed once, here: a bad one fails before any work.
        msgspec.structs.force_setattr(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        for name in (
            "page_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "max_loras",
            "max_lora_rank",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {self.num_pages}")
        if self.pipeline_micro_batches is not None and self.pipeline_micro_batches < 1:
            raise ValueError(f"pipeline_micro_batches must be at least 1, got {self.pipeline_micro_batches}")
        if self.pipeline_parallel_size > 1 and (self.speculative is not None or self.enable_lora):
            raise ValueError("pipeline parallelism runs without speculative decoding and LoRA for now")
        if self.runner == "pooling" and self.speculative is not None:
            raise ValueError("speculative decoding generates text: it cannot run with runner pooling")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.replica_heartbeat_timeout_s <= 0:
            raise ValueError(f"replica_heartbeat_timeout_s must be positive, got {self.replica_heartbeat_timeout_s}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative config (`speculative_config` after construction)."""
        assert self.speculative_config is None or isinstance(self.speculative_config, SpeculativeConfig)
        return self.speculative_config

    @property
    def world_size(self) -> int:
        """The engine's ranks: one a (pipeline stage, tensor-parallel rank) pair."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

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

    def resolved_kv_cache_dtype(self) -> torch.dtype:
        """The KV pages' storage type: the activations' own for "auto"."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.resolved_dtype()

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]
