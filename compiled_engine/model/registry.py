"""The model families the engine runs, one line each: which Hugging Face `model_type` (and class
name) and which GGUF `general.architecture` is which family. Anything not listed here is refused,
with the list. The only module that reads a config's `model_type`; each family's record
(model/family.py) is in its own file.

To add a family: write its file (plain, from model/layers.py's pieces, its layers and model
subclassing DecoderLayer and DecoderModel, ending in its `Family` record), then one line below."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compiled_engine.errors import ModelConfigError
from compiled_engine.model.config import ModelConfig, parse_config, read_config_json
from compiled_engine.model.family import Family
from compiled_engine.model.gemma import GEMMA2, GEMMA3
from compiled_engine.model.gpt_oss import GPT_OSS
from compiled_engine.model.granitemoe import GRANITEMOE, GRANITEMOE_SHARED
from compiled_engine.model.layers import DecoderModel
from compiled_engine.model.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from compiled_engine.model.mixtral import MIXTRAL
from compiled_engine.model.olmoe import OLMOE
from compiled_engine.model.phi3 import PHI3
from compiled_engine.model.qwen2_moe import QWEN2_MOE
from compiled_engine.model.qwen3_moe import QWEN3_MOE
from compiled_engine.model.shard import TPShard

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        *(LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3),
        *(QWEN3_MOE, QWEN2_MOE, MIXTRAL, OLMOE, GRANITEMOE, GRANITEMOE_SHARED, GPT_OSS),
    )
}


def family_of_gguf(architecture: str, experts: bool = False) -> Family | None:
    """The family of a GGUF `general.architecture`; llama.cpp writes Mixtral as a llama model
    with experts, so `experts` (the file has an `expert_count`) picks between the two."""
    named = [f for f in FAMILIES.values() if f.gguf is not None and f.gguf.architecture == architecture]
    return next((f for f in named if f.gguf is not None and (f.gguf.experts is not None) == experts), None) or (
        named[0] if named else None
    )


def family_of(config: ModelConfig) -> Family:
    return FAMILIES[config.architecture]


def config_from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The config a Hugging Face config.json `raw` describes, read as its family reads it."""
    # model_type decides when present (a Mistral config may still name LlamaForCausalLM);
    # the class list is only a fallback for configs without one.
    model_type = raw.get("model_type")
    family = next((f for f in FAMILIES.values() if model_type in f.model_types), None)
    if model_type is None:
        classes = raw.get("architectures") or []
        family = next((f for c in classes for f in FAMILIES.values() if c in f.classes), None)
    if family is not None:
        return parse_config(raw, source, family.name, family.config)
    refused = [
        f.refused[model_type] for f in FAMILIES.values() if isinstance(model_type, str) and model_type in f.refused
    ]
    hint = f" ({refused[0]})" if refused else ""
    raise ModelConfigError(
        f"{source}: unsupported architecture (model_type={model_type!r}, "
        f"architectures={raw.get('architectures')!r}){hint}; supported model_type values: "
        f"{sorted(t for f in FAMILIES.values() for t in f.model_types)}"
    )


def config_from_model_dir(model_dir: str | Path) -> ModelConfig:
    return config_from_dict(*read_config_json(model_dir))


def build_model(config: ModelConfig, shard: TPShard) -> DecoderModel:
    """The eager model of `config`'s family, its parameters uninitialised (on the current
    default device: the loaders build it on the meta device)."""
    return family_of(config).model(config, shard)


def check_shard(config: ModelConfig, shard: TPShard) -> None:
    """A ModelConfigError, before any weight is read, unless `shard` can split this model."""
    reason = family_of(config).no_tensor_parallel
    if shard.size > 1 and reason is not None:
        raise ModelConfigError(
            f"--tensor-parallel-size {shard.size}: not supported for {config.architecture}: {reason}"
        )
    shard.check(config)
