"""Phi-3, 3.5 and 4-mini: the Llama family's network (model/llama.py) stored with q/k/v fused in
one `qkv_proj` and gate/up in one `gate_up_proj`, which is exactly how our modules hold them; with
longrope or partial rotary from its config. Only its checkpoint layout is its own."""

from __future__ import annotations

from compiled_engine.model.checkpoint import CheckpointTensor, Layout, embedding_layout, norm_layout
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.shard import NO_SHARD, TPShard


def checkpoint_layout(config: ModelConfig, shard: TPShard = NO_SHARD) -> Layout:
    """Every tensor a Phi-3 checkpoint holds; whole tensors only (one fused tensor would need
    three row ranges per rank: tensor parallelism is refused for Phi-3, model/families.py)."""
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
