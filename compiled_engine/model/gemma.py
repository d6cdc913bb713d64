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
Execution tricks and compilation are applied from outside, as for model/llama.py. The two
families' records (config defaults, GGUF layouts) close the file.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compiled_engine.model.checkpoint import Layout, decoder_layout
from compiled_engine.model.config import FULL, SLIDING, ConfigRules, ModelConfig
from compiled_engine.model.family import Family, GGUFLayout, GGUFMetadata
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
    return decoder_layout(config, shard, LAYER_NORMS)


def _gemma2_layer_types(raw: dict[str, Any], num_layers: int) -> Any:
    if raw.get("layer_types") is not None:
        return raw["layer_types"]
    return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]


def _gemma3_layer_types(raw: dict[str, Any], num_layers: int) -> Any:
    if raw.get("layer_types") is not None:
        return raw["layer_types"]
    pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


# llama.cpp's Gemma files, as its convert_hf_to_gguf.py writes them and src/models/gemma*.cpp
# read them: every norm stored as 1 + w (q/k norms included); the norm before the MLP named
# `ffn_norm`, the two after `post_attention_norm` and `post_ffw_norm`; a tanh-approximated gelu.
# The query scale is not stored: llama.cpp takes 1/sqrt(head size), except for the 27B models
# (told apart by their layer count, 46 for Gemma 2 and 62 for Gemma 3), where it is
# 1/sqrt(hidden / heads), as Google's reference code does. Which layers slide comes from
# `attention.sliding_window_pattern` when a file has it (a period or one flag per layer), else
# every second layer from the first (Gemma 2) or five in six (Gemma 3); the converter writes no
# pattern for either. Gemma 2 slides over 4096 tokens and caps attention logits at 50 and final
# ones at 30 unless the file says otherwise, its sliding layers' rope base the global one. Gemma 3
# takes the sliding layers' rope base from `rope.freq_base_swa` (10000 without it) and applies
# a linear rope scaling to its full layers only; it has no attention soft cap.
GGUF_NORMS = (
    ("attn_norm", "input_layernorm"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)


def gguf_sliding_layers(meta: GGUFMetadata, layers: int, default_period: int) -> list[str]:
    """Each layer's attention type as llama.cpp decides it: the file's pattern (one flag per layer,
    or a period n: layer i slides unless i % n == n - 1, every layer for n = 0), else the
    family's period."""
    pattern = meta.metadata.get(f"{meta.architecture}.attention.sliding_window_pattern", default_period)
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise meta.fail(f"'{meta.architecture}.attention.sliding_window_pattern' must hold one flag per layer")
        slides = list(pattern)
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        slides = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    else:
        raise meta.fail(f"'{meta.architecture}.attention.sliding_window_pattern' must be a period or flags")
    return [SLIDING if s else FULL for s in slides]


def _query_scalar(config: dict[str, Any], big_model_layers: int) -> int:
    # llama.cpp's attention scale (src/models/gemma2.cpp, gemma3.cpp): the 27B models, known by
    # their layer count, scale by hidden / heads, every other size by the head size.
    if config["num_hidden_layers"] == big_model_layers:
        return int(config["hidden_size"] // config["num_attention_heads"])
    return int(config["head_dim"])


def _soft_cap(meta: GGUFMetadata, key: str, default: float | None) -> float | None:
    cap = meta.arch(key, float, default)
    return cap if cap else None  # 0 in a file: no cap


def _gemma2_gguf(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    swa_base = meta.arch("rope.freq_base_swa", float, config["rope_theta"])
    if swa_base != config["rope_theta"]:
        raise meta.fail(
            f"a Gemma 2 sliding-layer rope base ({swa_base}) other than the global one ({config['rope_theta']}) "
            "is not supported"
        )
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _query_scalar(config, 46),
        "sliding_window": meta.arch("attention.sliding_window", int, 4096),
        "layer_types": gguf_sliding_layers(meta, config["num_hidden_layers"], 2),
        "attn_logit_softcapping": _soft_cap(meta, "attn_logit_softcapping", 50.0),
        "final_logit_softcapping": _soft_cap(meta, "final_logit_softcapping", 30.0),
    }


def _gemma3_gguf(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    window = meta.arch("attention.sliding_window", int, 0)
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _query_scalar(config, 62),
        "attn_logit_softcapping": None,  # llama.cpp's Gemma 3 has none, whatever a file says
        "final_logit_softcapping": _soft_cap(meta, "final_logit_softcapping", None),
        "rope_local_base_freq": meta.arch("rope.freq_base_swa", float, 10000.0),
    }
    if window > 0:
        return fields | {"sliding_window": window, "layer_types": gguf_sliding_layers(meta, layers, 6)}
    return fields | {"sliding_window": None, "layer_types": [FULL] * layers}


# transformers' Gemma defaults, for the fields a Gemma config may leave out; Gemma names its
# activation `hidden_activation` (its configs' `hidden_act` is read only without one).
_DEFAULTS = {"head_dim": 256, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "hidden_act": "gelu_pytorch_tanh"}
GEMMA2 = Family(
    "gemma2",
    ("gemma2",),
    ("Gemma2ForCausalLM",),
    Gemma,
    checkpoint_layout,
    ConfigRules(
        {**_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
        layer_types=_gemma2_layer_types,
        activation_key="hidden_activation",
        query_scale=True,
    ),
    GGUFLayout("gemma2", _gemma2_gguf, norm_offset=1.0, layer_norms=GGUF_NORMS, merges_by_position=True),
)
GEMMA3 = Family(
    "gemma3",
    ("gemma3_text",),
    ("Gemma3ForCausalLM",),
    Gemma,
    checkpoint_layout,
    ConfigRules(
        {**_DEFAULTS, "rope_theta": 1_000_000.0},
        qk_norm=True,
        local_rope=True,
        layer_types=_gemma3_layer_types,
        activation_key="hidden_activation",
        query_scale=True,
    ),
    GGUFLayout("gemma3", _gemma3_gguf, norm_offset=1.0, layer_norms=GGUF_NORMS, merges_by_position=True),
    refused={"gemma3": "a Gemma 3 vision-language checkpoint: only the text models, model_type 'gemma3_text', run"},
)
