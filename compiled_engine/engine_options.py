"""The engine's command-line options, declared once.

Each EngineConfig field has one entry here: its flag, help text and choices. Its type and its
default are read from the field itself, so `compiled-engine generate|verify|serve` and
`python -m compiled_engine.bench latency|offline|serve` offer the same options with the same
defaults as the Python API, and a new field cannot be left off the command line (the tests list
the fields). Choices come from the registries the engine checks names against.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin

import msgspec

from compiled_engine.attention.selector import BACKENDS
from compiled_engine.config import (
    CPU_ACTIVATIONS,
    DEVICES,
    DTYPES,
    ENFORCE_EAGER_ENV,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    RUNNERS,
    SAMPLERS,
    EngineConfig,
)

# The namespace attribute that records which fields a parser declared, so that
# engine_config_from_args reads those and never a command's own option of the same name
# (generate's and the bench's --seed).
_DECLARED = "_engine_option_fields"
_VALUE_TYPES = (str, int, float, bool)


@dataclass(frozen=True)
class EngineOption:
    """One EngineConfig field on the command line.

    A bool field is a bare flag that moves it off its default: a field that defaults to True is
    turned off by a `--no-...` flag, one that defaults to None or False is set to True by its
    flag (None stays None when the flag is absent, so `enforce_eager` still defers to
    $COMPILED_ENGINE_ENFORCE_EAGER).
    """

    field: str
    flag: str
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None  # None: N for an int, else argparse's (the flag in capitals)


ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    EngineOption(
        "model",
        "--model",
        "local model directory or Hub id (default: the embedded SmolLM2-135M-Instruct)",
        metavar="DIR_OR_HUB_ID",
    ),
    EngineOption("device", "--device", "default: cuda when available", DEVICES),
    EngineOption("dtype", "--dtype", "default: bfloat16 on cuda, float32 on cpu", tuple(sorted(DTYPES))),
    EngineOption("page_size", "--page-size", "tokens per KV page"),
    EngineOption("num_pages", "--num-pages", "KV pages (default: as many as --kv-cache-memory-gib holds)"),
    EngineOption(
        "kv_cache_memory_gib",
        "--kv-cache-memory-gib",
        "default: 1 GiB on CPU; on CUDA what --gpu-memory-utilization leaves",
        metavar="GIB",
    ),
    EngineOption(
        "gpu_memory_utilization",
        "--gpu-memory-utilization",
        "fraction of GPU memory for weights, activations, CUDA graphs and the KV cache",
        metavar="FRACTION",
    ),
    EngineOption(
        "max_model_len",
        "--max-model-len",
        "context limit (default: the model's max_position_embeddings, lowered with a warning to "
        "what the KV cache holds)",
    ),
    EngineOption(
        "attention_backend",
        "--attention-backend",
        "default: flashinfer on CUDA, cpu (native decode kernel) on the CPU, when they can run the model; else torch",
        BACKENDS,
    ),
    EngineOption(
        "sampler",
        "--sampler",
        "default: flashinfer on CUDA when installed (requests with their own seed always take torch's)",
        SAMPLERS,
    ),
    EngineOption("max_num_seqs", "--max-num-seqs", "sequences running at once"),
    EngineOption(
        "max_num_batched_tokens",
        "--max-num-batched-tokens",
        "tokens in one forward pass, decodes and prefill chunks together",
    ),
    EngineOption("enable_prefix_caching", "--no-prefix-caching", "turn the prefix cache off"),
    EngineOption(
        "seed",
        "--seed",
        "seeds the per-request seeds of requests that bring none, so a run can be repeated "
        "(default: a fresh draw each start)",
    ),
    EngineOption(
        "enforce_eager",
        "--enforce-eager",
        f"plain eager PyTorch: no torch.compile, no CUDA graphs (absent: eager only when {ENFORCE_EAGER_ENV}=1)",
    ),
    EngineOption("cuda_graphs", "--no-cuda-graphs", "compiled, but decode without CUDA graphs"),
    EngineOption("enable_lora", "--enable-lora", "serve LoRA adapters (requests name one with lora_request / model)"),
    EngineOption("max_loras", "--max-loras", "adapters in device slots, so in one step, with --enable-lora"),
    EngineOption("max_lora_rank", "--max-lora-rank", "the largest adapter rank accepted, with --enable-lora"),
    EngineOption("max_cpu_loras", "--max-cpu-loras", "adapters kept loaded, with --enable-lora (default: --max-loras)"),
    EngineOption(
        "speculative_config",
        "--speculative-config",
        'speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}\' or \'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}\' '
        "(docs/architecture.md, Speculative decoding)",
        metavar="JSON",
    ),
    EngineOption(
        "compile_cache",
        "--no-compile-cache",
        "trace the compiled model at every start instead of loading the trace an earlier start saved",
    ),
    EngineOption(
        "cpu_threads",
        "--cpu-threads",
        "CPU threads for each engine process (default: torch's for one process; with tensor parallelism on "
        "the CPU, each rank its share of the usable cores)",
        metavar="N",
    ),
    EngineOption(
        "tensor_parallel_size",
        "--tensor-parallel-size",
        "split the model across this many processes: gloo on CPU, NCCL on CUDA, see docs/parallel.md",
    ),
    EngineOption(
        "pipeline_parallel_size",
        "--pipeline-parallel-size",
        "split the layers into this many contiguous stages, one process each (times --tensor-parallel-size); "
        "activations go stage to stage, see docs/parallel.md",
    ),
    EngineOption(
        "pipeline_micro_batches",
        "--pipeline-micro-batches",
        "with --pipeline-parallel-size, cut each step into at most this many micro-batches of whole "
        "sequences, so that the stages work at once (default: one per stage)",
    ),
    EngineOption(
        "data_parallel_size",
        "--data-parallel-size",
        "serve: run this many engine replicas behind one front end, each on its share of the cores or its "
        "own GPUs; requests go to the replica that caches most of their prompt, else the least loaded "
        "(docs/parallel.md)",
    ),
    EngineOption(
        "replica_heartbeat_timeout_s",
        "--replica-heartbeat-timeout-s",
        "with --data-parallel-size: a replica that reports nothing for this long (stopped, deadlocked, or "
        "inside one step that long) is declared lost, its requests fail and its process is killed",
        metavar="SECONDS",
    ),
    EngineOption(
        "distributed_timeout_s",
        "--distributed-timeout-s",
        "seconds a tensor-parallel collective may wait before it fails",
        metavar="SECONDS",
    ),
    EngineOption(
        "quantization",
        "--quantization",
        "quantize the layer products' weights at load: int8 (per output channel, or groups of "
        "--quantization-group-size) or int4 (groups of 32, 64 or 128); none keeps them dense and "
        "dequantizes a GGUF (default: the checkpoint's own, so the default model runs its 4-bit GGUF weights)",
        QUANTIZATIONS,
    ),
    EngineOption(
        "kv_cache_dtype",
        "--kv-cache-dtype",
        "the KV pages' storage type: auto keeps the activations' (fp32 on the CPU); float16 and bfloat16 "
        "hold twice the tokens, fp8 (= fp8_e4m3) and fp8_e5m2 four times, at a per-tensor scale of 1.0 "
        "(docs/quantization.md)",
        tuple(KV_CACHE_DTYPES),
    ),
    EngineOption(
        "quantization_group_size",
        "--quantization-group-size",
        "weights per scale for --quantization (default: per channel for int8, 32 for int4)",
    ),
    EngineOption(
        "quantize_head",
        "--no-quantize-head",
        "with --quantization int8/int4, keep the head and embedding dense (default: int8 in groups of 32)",
    ),
    EngineOption(
        "cpu_activations",
        "--cpu-activations",
        "activations of the quantized products on the CPU: fp32 (exact, the default) or int8 (rounded "
        "to int8 in blocks of 32 for integer dot products, as llama.cpp does: faster decode, lossy; "
        "weights in groups of 16 and prompts of more than 32 tokens stay exact)",
        CPU_ACTIVATIONS,
    ),
    EngineOption(
        "runner",
        "--runner",
        "generate (text, the default) or pooling (an embedding a prompt, served at /v1/embeddings; "
        "the pooling and normalization come from the model's sentence-transformers files, else the "
        "last token's hidden state, normalized)",
        RUNNERS,
    ),
)


def engine_config_fields() -> dict[str, msgspec.structs.FieldInfo]:
    """EngineConfig's fields by name: the one source of every option's type and default."""
    return {field.name: field for field in msgspec.structs.fields(EngineConfig)}


def value_type(annotation: Any) -> type:
    """The type a field's value is parsed as: the one non-None member of its annotation
    (`int | None` is int), or str for a field that also takes its value as text (the JSON of
    --speculative-config). Anything else is refused here rather than parsed as a string."""
    if isinstance(annotation, types.UnionType) or get_origin(annotation) is Union:
        members = [member for member in get_args(annotation) if member is not type(None)]
    else:
        members = [annotation]
    if str in members:
        members = [str]
    if len(members) != 1 or members[0] not in _VALUE_TYPES:
        raise TypeError(f"an engine option must be one of str, int, float or bool, not {annotation!r}")
    kind: type = members[0]
    return kind


def add_engine_options(parser: argparse.ArgumentParser, *, exclude: Collection[str] = ()) -> None:
    """Add the options of every EngineConfig field but `exclude` (fields a command fixes itself,
    or whose flag it spends on an option of its own) to `parser`, in a group of their own.

    Each option's dest is its field's name and its default the field's default, so a parsed
    namespace holds EngineConfig's values for every flag left out.
    """
    fields = engine_config_fields()
    unknown = set(exclude) - fields.keys()
    if unknown:
        raise ValueError(f"no EngineConfig field named {', '.join(sorted(unknown))}")
    group = parser.add_argument_group("engine options")
    declared = []
    for option in ENGINE_OPTIONS:
        if option.field in exclude:
            continue
        field = fields[option.field]
        default = field.default
        kind = value_type(field.type)
        if kind is bool:  # a bare flag: off for a field that defaults to True, else on
            bare: dict[str, Any] = (
                {"action": "store_false"} if default is True else {"action": "store_const", "const": True}
            )
            group.add_argument(option.flag, dest=option.field, default=default, help=option.help, **bare)
        else:
            shown = option.help if default is None else f"{option.help} (default: {default})"
            group.add_argument(
                option.flag,
                dest=option.field,
                type=kind,
                choices=option.choices,
                metavar=option.metavar or ("N" if kind is int else None),
                default=default,
                help=shown,
            )
        declared.append(option.field)
    parser.set_defaults(**{_DECLARED: tuple(declared)})


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig of a namespace parsed by a parser given add_engine_options.

    Only the fields that parser declared are read; `overrides` (fields a command fixes, such as
    the latency bench's prefix caching) win over them, and every other field keeps its default.
    EngineConfig validates the result, so a bad value is a ValueError before any work.
    """
    declared = getattr(args, _DECLARED, None)
    if declared is None:
        raise ValueError("these arguments were parsed without add_engine_options")
    values = {name: getattr(args, name) for name in declared}
    return EngineConfig(**{**values, **overrides})
