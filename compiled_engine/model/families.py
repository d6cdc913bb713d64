"""The model families the engine runs, in one registry: which Hugging Face `model_type` (and
class name) and which GGUF `general.architecture` is which family, the module that builds it, and
where its checkpoint's tensors land. Anything not listed here is refused, with the list.

To add a family: write its model file (plain, from model/layers.py's pieces, its layers and model
subclassing DecoderLayer and DecoderModel), then one `Family` line below. docs/architecture.md
says what else a family may need (GGUF tensor names, LoRA target names, chat template quirks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from compiled_engine.errors import ModelConfigError
from compiled_engine.model import gemma, llama, phi3
from compiled_engine.model.checkpoint import Layout
from compiled_engine.model.config import Architecture, ModelConfig
from compiled_engine.model.layers import DecoderModel
from compiled_engine.model.shard import TPShard


@dataclass(frozen=True)
class Family:
    name: Architecture
    model_types: tuple[str, ...]  # config.json's model_type
    classes: tuple[str, ...]  # config.json's architectures, for configs without a model_type
    gguf_architecture: str | None  # a GGUF file's general.architecture (None: llama.cpp writes another's)
    model: Callable[[ModelConfig, TPShard], DecoderModel]
    checkpoint_layout: Callable[[ModelConfig, TPShard], Layout]
    # Why tensor parallelism is refused for this family, or None when it runs where heads divide.
    no_tensor_parallel: str | None = None


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", ("llama",), ("LlamaForCausalLM",), "llama", llama.Transformer, llama.checkpoint_layout),
        Family("mistral", ("mistral",), ("MistralForCausalLM",), None, llama.Transformer, llama.checkpoint_layout),
        Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), "qwen2", llama.Transformer, llama.checkpoint_layout),
        Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), "qwen3", llama.Transformer, llama.checkpoint_layout),
        Family("gemma2", ("gemma2",), ("Gemma2ForCausalLM",), "gemma2", gemma.Gemma, gemma.checkpoint_layout),
        Family("gemma3", ("gemma3_text",), ("Gemma3ForCausalLM",), "gemma3", gemma.Gemma, gemma.checkpoint_layout),
        Family(
            "phi3",
            ("phi3",),
            ("Phi3ForCausalLM",),
            "phi3",
            llama.Transformer,
            phi3.checkpoint_layout,
            no_tensor_parallel="its checkpoint fuses q/k/v and gate/up into single tensors",
        ),
    )
}


def family_of_model_type(model_type: str) -> Family | None:
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)


def family_of_class(class_name: str) -> Family | None:
    return next((f for f in FAMILIES.values() if class_name in f.classes), None)


def family_of_gguf(architecture: str) -> Family | None:
    return next((f for f in FAMILIES.values() if f.gguf_architecture == architecture), None)


def family(config: ModelConfig) -> Family:
    return FAMILIES[config.architecture]


def build_model(config: ModelConfig, shard: TPShard) -> DecoderModel:
    """The eager model of `config`'s family, its parameters uninitialised (on the current
    default device: the loaders build it on the meta device)."""
    return family(config).model(config, shard)


def check_shard(config: ModelConfig, shard: TPShard) -> None:
    """A ModelConfigError, before any weight is read, unless `shard` can split this model."""
    reason = family(config).no_tensor_parallel
    if shard.size > 1 and reason is not None:
        raise ModelConfigError(
            f"--tensor-parallel-size {shard.size}: not supported for {config.architecture}: {reason}"
        )
    shard.check(config)
