"""Phi-3, 3.5 and 4-mini: the Llama family's network (model/llama.py) stored with q/k/v fused in
one `qkv_proj` and gate/up in one `gate_up_proj`, which is exactly how our modules hold them; with
longrope or partial rotary from its config. Its checkpoint layout and its record are its own."""

from __future__ import annotations

from typing import Any

from compiled_engine.model.checkpoint import CheckpointTensor, Layout, embedding_layout, norm_layout
from compiled_engine.model.config import ConfigRules, ModelConfig
from compiled_engine.model.family import LONG_FACTORS, SHORT_FACTORS, Family, GGUFLayout, GGUFMetadata
from compiled_engine.model.llama import Transformer, every_layer_slides
from compiled_engine.model.shard import NO_SHARD, TPShard


def checkpoint_layout(config: ModelConfig, shard: TPShard = NO_SHARD) -> Layout:
    """Every tensor a Phi-3 checkpoint holds; whole tensors only (one fused tensor would need
    three row ranges per rank: tensor parallelism is refused for Phi-3, below)."""
    T, h, inter = CheckpointTensor, config.hidden_size, config.intermediate_size
    layout = embedding_layout(config)
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        width = config.q_size + 2 * config.kv_size
        layout[f"{hf}self_attn.qkv_proj.weight"] = T(f"{ours}self_attn.qkv_proj.weight", (width, h))
        layout[f"{hf}self_attn.o_proj.weight"] = T(f"{ours}self_attn.o_proj.weight", (h, config.q_size))
        layout[f"{hf}mlp.gate_up_proj.weight"] = T(f"{ours}mlp.gate_up_proj.weight", (2 * inter, h))
        layout[f"{hf}mlp.down_proj.weight"] = T(f"{ours}mlp.down_proj.weight", (h, inter))
        layout |= norm_layout(config, i, ("input_layernorm", "post_attention_layernorm"))
    return layout


def _gguf_fields(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's Phi-3: no head size stored (hidden / heads); `rope.dimension_count` below the
    head size for a partial rotary; longrope as `rope_factors_long` and `rope_factors_short`
    tensors with `rope.scaling.attn_factor` and `rope.scaling.original_context_length`.
    llama.cpp currently ignores a Phi-3 sliding window; we keep it, as transformers runs it, so a
    converted model behaves as the model it came from."""
    fields: dict[str, Any] = {}
    window = meta.arch("attention.sliding_window", int, 0)
    if window > 0:  # 0: none (Phi-4-mini)
        fields["sliding_window"] = window
    arch = meta.architecture
    present = [name for name in (LONG_FACTORS, SHORT_FACTORS) if name in meta.tensors]
    declared = []  # what says the file's rope is longrope, besides the factors themselves
    if meta.arch("rope.scaling.type", str) == "longrope":
        declared.append(f"{arch}.rope.scaling.type = longrope")
    if meta.arch("rope.scaling.attn_factor", float) is not None:
        declared.append(f"{arch}.rope.scaling.attn_factor")
    if not present:
        if declared:
            raise meta.fail(
                f"it declares longrope ({', '.join(declared)}) but has neither {LONG_FACTORS} nor {SHORT_FACTORS}: "
                "the rope's factors are missing"
            )
        return fields
    if len(present) == 1:
        missing = SHORT_FACTORS if present == [LONG_FACTORS] else LONG_FACTORS
        raise meta.fail(f"it has {present[0]} but not {missing}: longrope needs both")
    pairs = meta.arch("rope.dimension_count", int, config["head_dim"]) // 2  # one factor per rotated pair
    original = meta.arch("rope.scaling.original_context_length", int, config["max_position_embeddings"])
    rope: dict[str, Any] = {
        "rope_type": "longrope",
        "rope_theta": config["rope_theta"],
        "long_factor": meta.values(LONG_FACTORS, pairs),
        "short_factor": meta.values(SHORT_FACTORS, pairs),
        "original_max_position_embeddings": original,
    }
    attention_factor = meta.arch("rope.scaling.attn_factor", float)
    if attention_factor is not None:
        rope["attention_factor"] = attention_factor
    return fields | {"rope_scaling": rope, "original_max_position_embeddings": original}


PHI3 = Family(
    "phi3",
    ("phi3",),
    ("Phi3ForCausalLM",),
    Transformer,
    checkpoint_layout,
    ConfigRules(layer_types=every_layer_slides),
    # q/k/v fused in `attn_qkv` and gate/up in `ffn_up` (gate rows first), as our modules hold them.
    GGUFLayout(
        "phi3",
        _gguf_fields,
        fused_qkv=True,
        fused_gate_up=True,
        partial_rotary=True,
        extra_scalings=("longrope",),
        always_prefixed=True,
    ),
    no_tensor_parallel="its checkpoint fuses q/k/v and gate/up into single tensors",
)
