"""Granite-MoE (Granite 3.0/3.1 1B-A400M and 3B-A800M, PowerMoE): Llama's network with Granite's
four multipliers (embeddings, each residual branch, the softmax scale, the logits: config fields
that model/llama.py applies) and a mixture of experts in every layer (model/moe.py). Its router
takes the top k of the raw logits and softmaxes those k. Its checkpoint holds each layer's experts
fused: `input_linear` [experts, 2 * width, hidden] (gate rows, then up rows) and `output_linear`
[experts, hidden, width], which land whole in `Experts`. Granite-MoE-shared adds a shared expert
(`shared_mlp`, its gate and up rows fused too) that every token goes through, ungated.

llama.cpp writes both as `granitemoe` (q/k rows permuted as llama's, each layer's experts split
into `ffn_gate_exps` and `ffn_up_exps`, the shared expert's into `ffn_{gate,up,down}_shexp`), the
multipliers as `embedding_scale`, `residual_scale`, `attention.scale` and `logit_scale` (each left
out where it is 0 or missing: then transformers' 1, or for the attention 1/sqrt(head size)); a
file with `expert_shared_feed_forward_length` is the shared variant.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from compiled_engine.model.checkpoint import (
    CheckpointTensor,
    Layout,
    attention_layout,
    embedding_layout,
    norm_layout,
)
from compiled_engine.model.config import ConfigRules, ModelConfig
from compiled_engine.model.family import Family, GGUFExperts, GGUFLayout, GGUFMetadata
from compiled_engine.model.llama import Transformer
from compiled_engine.model.moe_config import MoEConfig, MoEKeys, read_moe
from compiled_engine.model.shard import NO_SHARD, TPShard


def checkpoint_layout(config: ModelConfig, shard: TPShard = NO_SHARD) -> Layout:
    """Every tensor of a Granite-MoE checkpoint: Llama's attention and norms, and per layer the
    router and the two fused expert tensors (and the shared expert's two, where it has one)."""
    moe, h = config.moe, config.hidden_size
    assert moe is not None
    T, experts, inter, shared = CheckpointTensor, moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size
    layout = embedding_layout(config)
    for i in range(config.num_layers):
        layout |= attention_layout(config, shard, i)
        layout |= norm_layout(config, i, ("input_layernorm", "post_attention_layernorm"))
        hf, ours = f"model.layers.{i}.", f"layers.{i}.mlp."
        layout[f"{hf}block_sparse_moe.router.layer.weight"] = T(f"{ours}gate.weight", (experts, h))
        layout[f"{hf}block_sparse_moe.input_linear.weight"] = T(f"{ours}experts.gate_up_proj", (experts, 2 * inter, h))
        layout[f"{hf}block_sparse_moe.output_linear.weight"] = T(f"{ours}experts.down_proj", (experts, h, inter))
        if shared:
            layout[f"{hf}shared_mlp.input_linear.weight"] = T(
                f"{ours}shared_expert.gate_up_proj.weight", (2 * shared, h)
            )
            layout[f"{hf}shared_mlp.output_linear.weight"] = T(f"{ours}shared_expert.down_proj.weight", (h, shared))
    return layout


_KEYS = MoEKeys(num_experts=("num_local_experts",), intermediate_size="intermediate_size", renormalize=None)


def _moe(raw: dict[str, Any], source: str) -> MoEConfig:
    return msgspec.structs.replace(read_moe(raw, source, _KEYS), softmax_after_topk=True)


def _moe_shared(raw: dict[str, Any], source: str) -> MoEConfig:
    keys = dataclasses.replace(_KEYS, shared_intermediate_size="shared_intermediate_size")
    return msgspec.structs.replace(read_moe(raw, source, keys), softmax_after_topk=True)


# llama.cpp's metadata key of each multiplier, under the architecture's name.
_GGUF_MULTIPLIERS = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}


def _gguf_fields(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, field in _GGUF_MULTIPLIERS.items():
        value = meta.arch(key, float, 0.0)
        if value:  # the converter writes none that is 0 (or missing from config.json)
            fields[field] = value
    shared = meta.arch("expert_shared_feed_forward_length", int, 0)
    if shared:
        fields |= {
            "model_type": "granitemoeshared",
            "architectures": ["GraniteMoeSharedForCausalLM"],
            "shared_intermediate_size": shared,
        }
    return fields


# Its router's softmax over the top k equals the softmax over all, renormalised over the top k.
GGUF_LAYOUT = GGUFLayout(
    "granitemoe",
    _gguf_fields,
    permuted_qk=True,
    experts=GGUFExperts(True, "num_local_experts", "intermediate_size", renormalize_key=None),
)

# A rank's share of each expert would be two ranges of the fused tensor's rows, which a layout
# entry cannot say yet (Phi-3 is refused alike).
NO_TENSOR_PARALLEL = "its checkpoint fuses every expert's gate and up rows in one tensor"
GRANITEMOE = Family(
    "granitemoe",
    ("granitemoe",),
    ("GraniteMoeForCausalLM",),
    Transformer,
    checkpoint_layout,
    ConfigRules(multipliers=True, moe=_moe),
    GGUF_LAYOUT,
    no_tensor_parallel=NO_TENSOR_PARALLEL,
    refused={"granitemoehybrid": "Granite 4's hybrid Mamba and attention layers are not supported"},
)
GRANITEMOE_SHARED = Family(
    "granitemoeshared",
    ("granitemoeshared",),
    ("GraniteMoeSharedForCausalLM",),
    Transformer,
    checkpoint_layout,
    ConfigRules(multipliers=True, moe=_moe_shared),
    GGUF_LAYOUT,
    no_tensor_parallel=NO_TENSOR_PARALLEL,
)
