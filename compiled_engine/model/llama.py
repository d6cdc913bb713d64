"""The Llama family in one file: Llama 2/3 and SmolLM2, Mistral (a sliding window on every layer),
Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm), each with its `Family` record at the end, and
Phi-3's network (its own record and checkpoint layout in model/phi3.py, with longrope or partial
rotary). A pre-norm decoder with a gated SiLU MLP, or a mixture of experts in its place (the MoE
families' network: model/moe.py, their records in model/qwen3_moe.py and the files beside it).
Granite-MoE's multipliers (model/granitemoe.py) are config fields here, 1 for every other family:
the embeddings scaled, each sublayer's output scaled before its residual add, the softmax scale
(`ModelConfig.softmax_scale`) and the logits divided (`DecoderModel.finish_logits`).

The model takes a flat batch: every sequence's new tokens concatenated, with their positions, and
the KV page pool. Which tokens belong to which sequence, and where their pages live, is the
attention backend's plan for the batch, which the runner sets around the forward; attention is one
opaque operator (attention/op.py) that reads it. So prefill, decode and any mixture of the two are
one code path, and the model compiles as a single graph. This file is the plain reference:
execution tricks (CPU products, packed weights, quantized kernels, LoRA) are applied from outside
it (linear/install.py), and so is compilation (executor/compilation.py). Parameter names follow the
Hugging Face checkpoints with the leading `model.` dropped, except that q/k/v and gate/up are
fused (their rows stacked); `checkpoint_layout` says where each checkpoint tensor lands.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compiled_engine.model.checkpoint import Layout, decoder_layout
from compiled_engine.model.config import FULL, SLIDING, ConfigRules, ModelConfig, declared_layer_types
from compiled_engine.model.family import Family, GGUFLayout
from compiled_engine.model.layers import (
    Attention,
    DecoderLayer,
    DecoderModel,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    scaled,
)
from compiled_engine.model.moe import feed_forward
from compiled_engine.model.shard import NO_SHARD, TPShard


class TransformerBlock(DecoderLayer):
    """One decoder layer: x + attn(norm(x)) * r, then x + mlp(norm(x)) * r (r: the residual
    multiplier, Granite's; 1 elsewhere)."""

    def __init__(self, config: ModelConfig, shard: TPShard, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_norm = RMSNorm if config.qk_norm else None
        self.self_attn = Attention(config, shard, config.window(layer), head_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = feed_forward(config, shard, layer)  # a GatedMLP, or a mixture of experts
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        r = self.residual_multiplier
        x = x + scaled(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache), r)
        return x + scaled(self.mlp(self.post_attention_layernorm(x)), r)


class Transformer(DecoderModel):
    def __init__(self, config: ModelConfig, shard: TPShard = NO_SHARD) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config, shard, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)  # tied: the embedding's own weight
        self.logits_scaling = config.logits_scaling
        self.rotary = RotaryEmbedding(config.rope, config.rotated_dims)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [tokens]; kv_cache: [layers, pages, 2, page_size, kv_heads,
        head_dim]. Returns the final hidden states, [tokens, hidden]. Must run inside the
        runner's `attention_forward(backend, plan)` for this batch."""
        x = scaled(self.embed_tokens(input_ids), self.config.embedding_multiplier)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i])
        return self.norm(x)


def checkpoint_layout(config: ModelConfig, shard: TPShard = NO_SHARD) -> Layout:
    """Every tensor a checkpoint for `config` must hold, by its Hugging Face name (decoder_layout)."""
    return decoder_layout(config, shard, ("input_layernorm", "post_attention_layernorm"))


def every_layer_slides(raw: dict[str, Any], num_layers: int) -> list[str]:
    # Mistral and Phi-3 slide every layer whenever sliding_window is set, whatever else says.
    return [SLIDING if raw.get("sliding_window") is not None else FULL] * num_layers


def qwen_layer_types(raw: dict[str, Any], num_layers: int) -> Any:
    # Without use_sliding_window transformers ignores the window and layer_types.
    return declared_layer_types(raw, num_layers) if raw.get("use_sliding_window") else [FULL] * num_layers


# llama.cpp interleaves Llama's q and k rows per head for its rope (we put them back), and may
# store Llama 3.1's rope scaling as a tensor of divisors; it writes Mistral as a llama model.
LLAMA = Family(
    "llama",
    ("llama",),
    ("LlamaForCausalLM",),
    Transformer,
    checkpoint_layout,
    gguf=GGUFLayout("llama", permuted_qk=True, rope_freqs=True),
    tool_call_parser="llama3_json",
)
MISTRAL = Family(
    "mistral",
    ("mistral",),
    ("MistralForCausalLM",),
    Transformer,
    checkpoint_layout,
    ConfigRules(layer_types=every_layer_slides),
    tool_call_parser="mistral",
)
QWEN2 = Family(
    "qwen2",
    ("qwen2",),
    ("Qwen2ForCausalLM",),
    Transformer,
    checkpoint_layout,
    ConfigRules(fixed_qkv_bias=True, layer_types=qwen_layer_types),
    GGUFLayout("qwen2"),
)
QWEN3 = Family(
    "qwen3",
    ("qwen3",),
    ("Qwen3ForCausalLM",),
    Transformer,
    checkpoint_layout,
    ConfigRules(qk_norm=True, layer_types=qwen_layer_types),
    GGUFLayout("qwen3"),
)
