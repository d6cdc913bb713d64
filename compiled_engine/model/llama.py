"""The Llama family in one file: Llama 2/3, SmolLM2 and Qwen3 (Llama plus per-head q/k RMSNorm).

The model takes a flat batch: every sequence's new tokens concatenated, with their positions, and
the KV page pool. Which tokens belong to which sequence, and where their pages live, is the
attention backend's plan for the batch, which the runner sets around the forward; attention is one
opaque operator (attention/op.py) that reads it. So prefill, decode and any mixture of the two are
one code path, and the model compiles as a single graph. This file is the plain reference:
execution tricks (CPU products, packed weights, quantized kernels, LoRA) are applied from outside
it (products/walk.py), and so is compilation (engine/compilation.py). Parameter names follow the
Hugging Face checkpoints with the leading `model.` dropped, except that q/k/v and gate/up are
fused (their rows stacked); `checkpoint_layout` says where each checkpoint tensor lands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from compiled_engine.attention.op import paged_attention
from compiled_engine.model.config import ModelConfig, RopeConfig
from compiled_engine.model.shard import NO_SHARD, TPShard


class Linear(nn.Module):
    """y = x @ weight.T + bias, with the weight stored [out_features, in_features] as in the
    checkpoints and nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
    """With tensor parallelism, this rank's query heads and the KV heads they read (TPShard);
    q/k/v are then column-parallel and o_proj row-parallel (parallel/plan.py)."""

    def __init__(self, config: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        self.num_heads = shard.heads(config)[1]
        self.num_kv_heads = shard.kv_heads(config)[1]
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v side by side in one weight: one product per layer instead of three.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        self.intermediate_size = shard.intermediate(config)[1]
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size)  # gate, then up
        self.down_proj = Linear(self.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """One decoder layer."""

    def __init__(self, config: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config, shard)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, shard: TPShard = NO_SHARD) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config, shard) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)  # tied: the embedding's own weight
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [tokens]; kv_cache: [layers, pages, 2, page_size, kv_heads,
        head_dim]. Returns the final hidden states, [tokens, hidden]. Must run inside the
        runner's `attention_forward(backend, plan)` for this batch."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


@dataclass(frozen=True)
class CheckpointTensor:
    """Where one tensor of a Hugging Face checkpoint lands in this model: in parameter `param`,
    from output feature (row) `start` on. With tensor parallelism a rank reads only `part` of the
    tensor: (dim, first, count)."""

    param: str
    shape: tuple[int, ...]  # the checkpoint tensor's whole shape
    start: int = 0
    part: tuple[int, int, int] | None = None

    @property
    def read_shape(self) -> tuple[int, ...]:
        if self.part is None:
            return self.shape
        dim, _, count = self.part
        return tuple(count if d == dim else n for d, n in enumerate(self.shape))

    def read(self, tensor_slice: Any) -> torch.Tensor:
        """This rank's part of a safetensors slice (only that part is read from disk)."""
        if self.part is None:
            return tensor_slice[:]
        dim, first, count = self.part
        return tensor_slice[first : first + count] if dim == 0 else tensor_slice[:, first : first + count]

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """The part of `param` this tensor fills (writable)."""
        return param.narrow(0, self.start, self.read_shape[0])


def checkpoint_layout(config: ModelConfig, shard: TPShard = NO_SHARD) -> dict[str, CheckpointTensor]:
    """Every tensor a checkpoint for `config` must hold, by its Hugging Face name, and which part
    of it `shard` reads: q/k/v and gate/up rows (column parallel), o_proj and down_proj columns
    (row parallel); embeddings, norms and the head whole."""
    h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_first, q_heads = shard.heads(config)
    kv_first, kv_heads = shard.kv_heads(config)
    i_first, i_count = shard.intermediate(config)
    q, kv = q_heads * hd, kv_heads * hd  # local widths
    split = shard.size > 1
    rows_q = (0, q_first * hd, q) if split else None
    rows_kv = (0, kv_first * hd, kv) if split else None
    rows_i = (0, i_first, i_count) if split else None
    T = CheckpointTensor
    layout = {
        "model.embed_tokens.weight": T("embed_tokens.weight", (config.vocab_size, h)),
        "model.norm.weight": T("norm.weight", (h,)),
    }
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = T("lm_head.weight", (config.vocab_size, h))
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        qkv = (
            ("q_proj", 0, config.q_size, rows_q),
            ("k_proj", q, config.kv_size, rows_kv),
            ("v_proj", q + kv, config.kv_size, rows_kv),
        )
        for name, start, width, rows in qkv:
            layout[f"{hf}self_attn.{name}.weight"] = T(f"{ours}self_attn.qkv_proj.weight", (width, h), start, rows)
            if config.attention_bias:
                layout[f"{hf}self_attn.{name}.bias"] = T(f"{ours}self_attn.qkv_proj.bias", (width,), start, part=rows)
        cols_q = (1, rows_q[1], rows_q[2]) if rows_q else None
        layout[f"{hf}self_attn.o_proj.weight"] = T(f"{ours}self_attn.o_proj.weight", (h, config.q_size), part=cols_q)
        if config.attention_bias:
            layout[f"{hf}self_attn.o_proj.bias"] = T(f"{ours}self_attn.o_proj.bias", (h,))
        if config.qk_norm:
            layout[f"{hf}self_attn.q_norm.weight"] = T(f"{ours}self_attn.q_norm.weight", (hd,))
            layout[f"{hf}self_attn.k_norm.weight"] = T(f"{ours}self_attn.k_norm.weight", (hd,))
        layout[f"{hf}mlp.gate_proj.weight"] = T(f"{ours}mlp.gate_up_proj.weight", (inter, h), 0, rows_i)
        layout[f"{hf}mlp.up_proj.weight"] = T(f"{ours}mlp.gate_up_proj.weight", (inter, h), i_count, rows_i)
        cols_i = (1, i_first, i_count) if split else None
        layout[f"{hf}mlp.down_proj.weight"] = T(f"{ours}mlp.down_proj.weight", (h, inter), part=cols_i)
        layout[f"{hf}input_layernorm.weight"] = T(f"{ours}input_layernorm.weight", (h,))
        layout[f"{hf}post_attention_layernorm.weight"] = T(f"{ours}post_attention_layernorm.weight", (h,))
    return layout
