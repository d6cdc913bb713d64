"""The Llama family in one file: Llama 2/3, SmolLM2 and Qwen3 (Llama plus per-head q/k RMSNorm).

The model takes a flat batch: every sequence's new tokens concatenated, with their positions, plus
AttentionMetadata saying which tokens belong to which sequence and where their K/V pages live. So
prefill, decode and any mixture of the two are one code path. Attention is one opaque operator
(attention/op.py), so the decoder layer compiles as a single graph. Parameter names follow the Hugging
Face checkpoints with the leading `model.` dropped (see loader.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from compiled_engine.attention.backend import AttentionBackend
from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.attention.op import attention_forward, paged_attention
from compiled_engine.model.config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the run dtype, as the reference implementation does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inverse_frequencies(rope, head_dim), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [tokens, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; rotates the two halves of head_dim (the HF layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """One decoder layer: the unit that torch.compile compiles once and reuses for every layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [tokens]; kv_cache: [layers, pages, 2, page_size, kv_heads,
        head_dim]. Returns the final hidden states, [tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        if x.shape[0] > 1:  # for torch.compile: the token count is the one shape that varies
            for tensor in (x, cos, sin):
                torch._dynamo.mark_dynamic(tensor, 0)
        with attention_forward(self.backend, metadata):
            for i, layer in enumerate(self.layers):
                layer_cache = kv_cache[i]
                torch._dynamo.maybe_mark_dynamic(layer_cache, 0)  # any pool size, one graph
                x = layer(x, cos, sin, layer_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
