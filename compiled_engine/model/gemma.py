"""The Gemma family in one file: Gemma 2 and Gemma 3 (text). Llama's decoder with Gemma's
choices, top to bottom:
- the embeddings scaled by sqrt(hidden);
- RMSNorm as x * (1 + w), in fp32 (GemmaRMSNorm), four per layer: before and after attention,
  before and after the MLP;
- a GeGLU MLP (tanh-approximated gelu);
- the softmax scale from `query_pre_attn_scalar`, not head_dim;
- sliding-window layers beside full ones (Gemma 2 alternates; Gemma 3 slides five in six);
- Gemma 2: attention logits and final logits soft-capped;
- Gemma 3: per-head q/k norms, and the sliding layers' own rope base (`rope_local`), the full
  layers' rope possibly scaled.
Execution tricks and compilation are applied from outside, as for model/llama.py.
"""

from __future__ import annotations

import torch
from torch import nn

from compiled_engine.model.checkpoint import Layout, attention_layout, embedding_layout, mlp_layout, norm_layout
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.layers import (
    Attention,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    GemmaRMSNorm,
    Linear,
    RotaryEmbedding,
)
from compiled_engine.model.shard import NO_SHARD, TPShard

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class GemmaBlock(DecoderLayer):
    """x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))."""

    def __init__(self, config: ModelConfig, shard: TPShard, layer: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        head_norm = GemmaRMSNorm if config.qk_norm else None
        self.self_attn = Attention(config, shard, config.window(layer), head_norm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GatedMLP(config, shard)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma(DecoderModel):
    def __init__(self, config: ModelConfig, shard: TPShard = NO_SHARD) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.embed_scale = config.hidden_size**0.5
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaBlock(config, shard, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)  # tied: the embedding's own weight
        self.final_soft_cap = config.final_soft_cap
        self.rotary = RotaryEmbedding(config.rope, config.rotated_dims)
        self.rotary_local = RotaryEmbedding(config.rope_local, config.rotated_dims) if config.rope_local else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """As the Llama family's forward (model/llama.py)."""
        x = self.embed_tokens(input_ids)
        # The scale rounded to the run dtype first, as the reference implementation does.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        local = self.rotary_local(positions, x.dtype) if self.rotary_local is not None else (cos, sin)
        for i, layer in enumerate(self.layers):
            layer_cos, layer_sin = local if self.config.window(self.first_layer + i) else (cos, sin)
            x = layer(x, layer_cos, layer_sin, kv_cache[i])
        return self.norm(x)


def checkpoint_layout(config: ModelConfig, shard: TPShard = NO_SHARD) -> Layout:
    """As the Llama family's (model/llama.py), with Gemma's four norms per layer."""
    layout = embedding_layout(config)
    for i in range(config.num_layers):
        layout |= attention_layout(config, shard, i)
        layout |= mlp_layout(config, shard, i)
        layout |= norm_layout(config, i, LAYER_NORMS)
    return layout
