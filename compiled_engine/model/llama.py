"""The Llama family in one file: Llama 2/3 and SmolLM2, Mistral (a sliding window on every layer),
Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm) and Phi-3 (its own checkpoint layout,
model/phi3.py, and longrope or partial rotary). A pre-norm decoder with a gated SiLU MLP.

The model takes a flat batch: every sequence's new tokens concatenated, with their positions, and
the KV page pool. Which tokens belong to which sequence, and where their pages live, is the
attention backend's plan for the batch, which the runner sets around the forward; attention is one
opaque operator (attention/op.py) that reads it. So prefill, decode and any mixture of the two are
one code path, and the model compiles as a single graph. This file is the plain reference:
execution tricks (CPU products, packed weights, quantized kernels, LoRA) are applied from outside
it (linear/install.py), and so is compilation (engine/compilation.py). Parameter names follow the
Hugging Face checkpoints with the leading `model.` dropped, except that q/k/v and gate/up are
fused (their rows stacked); `checkpoint_layout` says where each checkpoint tensor lands.
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
    Linear,
    RMSNorm,
    RotaryEmbedding,
)
from compiled_engine.model.shard import NO_SHARD, TPShard


class TransformerBlock(DecoderLayer):
    """One decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, shard: TPShard, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_norm = RMSNorm if config.qk_norm else None
        self.self_attn = Attention(config, shard, config.window(layer), head_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config, shard)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(DecoderModel):
    def __init__(self, config: ModelConfig, shard: TPShard = NO_SHARD) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config, shard, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)  # tied: the embedding's own weight
        self.rotary = RotaryEmbedding(config.rope, config.rotated_dims)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [tokens]; kv_cache: [layers, pages, 2, page_size, kv_heads,
        head_dim]. Returns the final hidden states, [tokens, hidden]. Must run inside the
        runner's `attention_forward(backend, plan)` for this batch."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i])
        return self.norm(x)


def checkpoint_layout(config: ModelConfig, shard: TPShard = NO_SHARD) -> Layout:
    """Every tensor a checkpoint for `config` must hold, by its Hugging Face name, and which part
    of it `shard` reads: q/k/v and gate/up rows (column parallel), o_proj and down_proj columns
    (row parallel); embeddings, norms and the head whole."""
    layout = embedding_layout(config)
    for i in range(config.num_layers):
        layout |= attention_layout(config, shard, i)
        layout |= mlp_layout(config, shard, i)
        layout |= norm_layout(config, i, ("input_layernorm", "post_attention_layernorm"))
    return layout
