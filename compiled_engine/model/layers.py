"""The pieces every model family is built from, in one place: the product, the norms, the rotary
embeddings (default, linear, llama3, longrope, yarn; whole or partial), attention with its per-layer
window and soft-cap, the gated MLP, and `DecoderModel`, the shape of a model the engine runs.

Each family file (model/llama.py, model/gemma.py) assembles these top to bottom. Execution tricks
(packed CPU products, quantized kernels, LoRA) replace the `Linear` modules from outside
(linear/install.py); compilation wraps the decoder layers from outside (executor/compilation.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from compiled_engine.attention.op import paged_attention
from compiled_engine.model.config import ModelConfig, RopeConfig
from compiled_engine.model.shard import TPShard


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
    """weight * x / rms(x): Llama's norm, the product taken in the run dtype."""

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


class GemmaRMSNorm(nn.Module):
    """(1 + weight) * x / rms(x), all in fp32 and cast back at the end: Gemma's norm. The
    checkpoint stores weight without the 1 (llama.cpp's GGUF files store it with)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): logits squashed into (-cap, cap); cap 0 leaves them as they are."""
    return x if cap == 0.0 else cap * torch.tanh(x / cap)


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x * factor; factor 1 leaves x as it is (no extra operation for the families without one)."""
    return x if factor == 1.0 else x * factor


def rope_inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
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
    if rope.type == "longrope":
        # Phi-3: each frequency divided by its own factor, the long set for contexts past the
        # pretraining length (`RopeConfig.for_context` chose which).
        factors = rope.long_factor if rope.use_long_factor else rope.short_factor
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    if rope.type == "yarn":
        return yarn_inverse_frequencies(rope, rotary_dim, inv_freq)
    return inv_freq


def yarn_inverse_frequencies(rope: RopeConfig, rotary_dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: frequency pair i turns (original length) * inv_freq[i] / 2pi times over the
    pretraining context. Pairs that turn more than beta_fast times keep their frequency, those
    under beta_slow are divided by `factor`, and a linear ramp over the pair index blends between
    (the pair index where a pair turns r times is solved for r = beta_fast and beta_slow)."""

    def pair_turning(turns: float) -> float:
        return (
            rotary_dim
            * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = pair_turning(rope.beta_fast), pair_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one point: keep it a step
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0: the pair keeps its frequency; ramp 1: slowed by the factor.
    return inv_freq * (1 - ramp) + inv_freq / rope.factor * ramp


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's angles over the first `rotary_dim` dims of a head."""

    inv_freq: torch.Tensor

    def __init__(self, rope: RopeConfig, rotary_dim: int) -> None:
        super().__init__()
        self.rope, self.rotary_dim = rope, rotary_dim
        self.attention_factor = rope.attention_factor
        self.register_buffer("inv_freq", rope_inverse_frequencies(rope, rotary_dim), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [tokens, rotary_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; rotates the two halves of the first cos.shape[-1] dims (the
    HF layout) and passes the rest through (partial rotary, as in Phi-4-mini)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = rotary_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """Self-attention over the paged cache. With tensor parallelism, this rank's query heads and
    the KV heads they read (TPShard); q/k/v are then column-parallel and o_proj row-parallel
    (linear/tensor_parallel.py). `window` (0: every earlier token) and `soft_cap` (0: none) are this
    layer's; the norm class, if given, normalises each head of q and k before the rotation. With
    `config.attention_sinks`, each head's learned sink logit joins its softmax (gpt-oss)."""

    def __init__(
        self,
        config: ModelConfig,
        shard: TPShard,
        window: int = 0,
        head_norm: Callable[[int, float], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = shard.heads(config)[1]
        self.num_kv_heads = shard.kv_heads(config)[1]
        self.head_dim = config.head_dim
        self.scale = config.softmax_scale
        self.window = window
        self.soft_cap = config.attn_soft_cap
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v side by side in one weight: one product per layer instead of three.
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        # OLMoE normalises q and k over all their heads at once, then clamps q, k and v.
        self.whole_norm, self.clip = config.qk_norm_whole, config.clip_qkv
        q_width, k_width = (self.q_size, self.kv_size) if self.whole_norm else (config.head_dim, config.head_dim)
        self.q_norm = head_norm(q_width, config.rms_norm_eps) if head_norm is not None else None
        self.k_norm = head_norm(k_width, config.rms_norm_eps) if head_norm is not None else None
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        if self.whole_norm and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip:
            q, k, v = q.clamp(-self.clip, self.clip), k.clamp(-self.clip, self.clip), v.clamp(-self.clip, self.clip)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if not self.whole_norm and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, self.scale, self.window, self.soft_cap, self.sinks)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu."""

    def __init__(self, config: ModelConfig, shard: TPShard, intermediate_size: int | None = None) -> None:
        super().__init__()
        # its own width where given (an MoE's shared expert, unsharded), else the config's share
        self.intermediate_size = intermediate_size or shard.intermediate(config)[1]
        self.activation = ACTIVATIONS[config.hidden_act]
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size)  # gate, then up
        self.down_proj = Linear(self.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.activation(gate) * up)


class DecoderLayer(nn.Module):
    """What every family's decoder layer is to the engine: x, the rotation its attention uses,
    and its layer's pages in; x out. Compilation traces this call (executor/compilation.py)."""

    self_attn: Attention
    mlp: nn.Module  # GatedMLP, or a mixture of experts (model/moe.py)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DecoderModel(nn.Module):
    """What every family's model is to the engine: token ids and positions in, final hidden states
    out (`forward`, inside the runner's attention_forward), then `compute_logits`. The modules
    named here are the ones the product walk, LoRA, quantization and tensor parallelism reach."""

    config: ModelConfig
    shard: TPShard
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm | GemmaRMSNorm
    lm_head: Linear
    rotary: RotaryEmbedding
    final_soft_cap: float = 0.0
    logits_scaling: float = 1.0  # the logits divided by this (Granite's)
    first_layer: int = 0  # the model index of layers[0] (a pipeline stage holds a slice of them)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rotaries(self) -> dict[str, RotaryEmbedding]:
        """The model's rotary embeddings by attribute name: rebuilt on the device after loading
        (they hold no checkpoint tensor)."""
        return {name: module for name, module in self.named_children() if isinstance(module, RotaryEmbedding)}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.finish_logits(self.lm_head(hidden))

    def finish_logits(self, head_out: torch.Tensor) -> torch.Tensor:
        """The logits from the head's product: divided by `logits_scaling`, then soft-capped."""
        if self.logits_scaling != 1.0:
            head_out = head_out / self.logits_scaling
        return soft_cap(head_out, self.final_soft_cap)

    def keep_layers(self, kept: range) -> None:
        """Hold only the layers `kept` (a pipeline stage's contiguous slice), dropping the rest."""
        self.layers = nn.ModuleList(self.layers[i] for i in kept)
        self.first_layer = kept.start


LAYER_PARAM = re.compile(r"layers\.(\d+)\.")


def in_layers(param_name: str, layers: range | None) -> bool:
    """Whether a rank holding the decoder layers `layers` (None: all of them) holds the parameter
    named `param_name` (a name of the whole model: "layers.7.mlp.down_proj.weight"). Parameters
    outside the layers (embedding, final norm, head) are held by every rank."""
    found = LAYER_PARAM.match(param_name)
    return layers is None or found is None or int(found.group(1)) in layers
