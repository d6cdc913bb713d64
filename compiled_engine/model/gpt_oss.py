"""gpt-oss (OpenAI's gpt-oss-20b and -120b): Llama's network with q/k/v and o biases, a learned
attention sink per head (attention/op.py), a sliding window on alternate layers (`layer_types`),
YaRN rope (model/layers.py), and a mixture of experts in every layer (model/moe.py). Its router
adds a bias to x @ weight.T, takes the top k logits and softmaxes those k; its experts have biases
on both products and a clamped SwiGLU over interleaved gate/up features (experts/op.py's
SWIGLU_OAI). The checkpoint fuses each layer's experts into 3-D tensors stored as [in, out]:
`gate_up_proj` [experts, hidden, 2 * width] and `down_proj` [experts, width, hidden], transposed
as they load.

The published checkpoints store the experts in MXFP4 (`*_blocks`, `*_scales`, said by
`quantization_config`): they load as int8 experts exactly (weights/mxfp4.py), never as floats.
llama.cpp writes it as `gpt-oss`: the experts' gate and up features apart (`ffn_gate_exps`,
`ffn_up_exps`, each with its `.bias`), interleaved again here as they load; each head's sink as
`attn_sinks`; the YaRN keys under `rope.scaling.*` (without transformers' `truncate`: the
published configs' false is taken); a window of `attention.sliding_window` on the even layers
unless `attention.sliding_window_pattern` says otherwise. Its MXFP4 experts load as int8 exactly
(weights/gguf_blocks.py).
Its chat format (harmony) renders through
the tokenizer's template; its tool calls and reasoning channels are not parsed yet.
"""

from __future__ import annotations

from typing import Any

from compiled_engine.errors import ModelConfigError
from compiled_engine.experts.op import SWIGLU_ALPHA, SWIGLU_LIMIT, SWIGLU_OAI
from compiled_engine.model.checkpoint import (
    CheckpointTensor,
    Layout,
    attention_layout,
    embedding_layout,
    norm_layout,
)
from compiled_engine.model.config import FULL, SLIDING, ConfigRules, ModelConfig
from compiled_engine.model.family import Family, GGUFExperts, GGUFLayout, GGUFMetadata
from compiled_engine.model.gemma import gguf_sliding_layers
from compiled_engine.model.llama import Transformer
from compiled_engine.model.moe_config import MoEConfig, MoEKeys, read_moe
from compiled_engine.model.shard import NO_SHARD, TPShard


def checkpoint_layout(config: ModelConfig, shard: TPShard = NO_SHARD) -> Layout:
    """Every tensor of a gpt-oss checkpoint: Llama's attention with its biases and each head's
    sink, the norms, and per layer the router (weight and bias) and the experts' two fused
    tensors and their biases."""
    moe, h = config.moe, config.hidden_size
    assert moe is not None
    T, experts, inter = CheckpointTensor, moe.num_experts, moe.intermediate_size
    layout = embedding_layout(config)
    for i in range(config.num_layers):
        layout |= attention_layout(config, shard, i)
        layout |= norm_layout(config, i, ("input_layernorm", "post_attention_layernorm"))
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        layout[f"{hf}self_attn.sinks"] = T(f"{ours}self_attn.sinks", (config.num_heads,))
        layout[f"{hf}mlp.router.weight"] = T(f"{ours}mlp.gate.weight", (experts, h))
        layout[f"{hf}mlp.router.bias"] = T(f"{ours}mlp.gate.bias", (experts,))
        mlp = f"{hf}mlp.experts."
        gate_up, down = f"{ours}mlp.experts.gate_up_proj", f"{ours}mlp.experts.down_proj"
        if moe.packed_experts == "mxfp4":  # [out, in] as ours, in blocks of 32 weights
            for name, param, rows, width in (("gate_up_proj", gate_up, 2 * inter, h), ("down_proj", down, h, inter)):
                layout[f"{mlp}{name}_blocks"] = T(param, (experts, rows, width // 32, 16), packed="blocks")
                layout[f"{mlp}{name}_scales"] = T(param, (experts, rows, width // 32), packed="scales")
        else:
            layout[f"{mlp}gate_up_proj"] = T(gate_up, (experts, h, 2 * inter), transposed=True)
            layout[f"{mlp}down_proj"] = T(down, (experts, inter, h), transposed=True)
        layout[f"{mlp}gate_up_proj_bias"] = T(f"{ours}mlp.experts.gate_up_bias", (experts, 2 * inter))
        layout[f"{mlp}down_proj_bias"] = T(f"{ours}mlp.experts.down_bias", (experts, h))
    return layout


_KEYS = MoEKeys(num_experts=("num_local_experts",), intermediate_size="intermediate_size", renormalize=None)
# What transformers assumes where a config.json leaves these out.
DEFAULTS = {
    "attention_bias": True,
    "sliding_window": 128,
    "rope_theta": 150000.0,
    "swiglu_alpha": SWIGLU_ALPHA,
    "swiglu_limit": SWIGLU_LIMIT,
}


def _moe(raw: dict[str, Any], source: str) -> MoEConfig:
    quantization = raw.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if quantization is not None and method != "mxfp4":
        raise ModelConfigError(
            f"{source}: quantization_config.quant_method {method!r} is not supported for gpt-oss (only 'mxfp4', "
            "the published checkpoints' experts)"
        )
    for key, fixed in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
        if raw.get(key, fixed) != fixed:
            raise ModelConfigError(
                f"{source}: field '{key}' is {raw[key]!r}; gpt-oss's experts run with {key} {fixed} only"
            )
    moe = read_moe(raw, source, _KEYS)
    return MoEConfig(
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        intermediate_size=moe.intermediate_size,
        softmax_after_topk=True,
        router_bias=True,
        expert_bias=True,
        expert_activation=SWIGLU_OAI,
        packed_experts=method,
    )


def layer_types(raw: dict[str, Any], num_layers: int) -> Any:
    # transformers' default: even layers (0, 2, ...) slide, odd ones attend to everything.
    if raw.get("layer_types") is not None:
        return raw["layer_types"]
    return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]


def _gguf_fields(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "sliding_window": meta.arch("attention.sliding_window", int, required=True),
        "layer_types": gguf_sliding_layers(meta, config["num_hidden_layers"], 2),
    }
    scaling = meta.arch("rope.scaling.type", str, "none")
    if scaling == "yarn":
        yarn: dict[str, Any] = {
            "rope_type": "yarn",
            "rope_theta": config["rope_theta"],
            "factor": meta.arch("rope.scaling.factor", float, required=True),
            "original_max_position_embeddings": meta.arch("rope.scaling.original_context_length", int, required=True),
            "beta_fast": meta.arch("rope.scaling.yarn_beta_fast", float, 32.0),
            "beta_slow": meta.arch("rope.scaling.yarn_beta_slow", float, 1.0),
            "truncate": False,
        }
        if meta.arch("rope.scaling.yarn_attn_factor", float, None) is not None:
            # llama.cpp multiplies YaRN's own scale by it, transformers replaces that scale by its
            # attention_factor: the two readings differ, and no gpt-oss checkpoint sets one.
            raise meta.fail(f"GGUF metadata '{meta.architecture}.rope.scaling.yarn_attn_factor' is not supported")
        fields["rope_parameters"] = yarn
    elif scaling != "none":
        raise meta.fail(f"rope scaling type {scaling!r} is not supported for gpt-oss (only yarn)")
    return fields


GGUF_NORMS = (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"))
GGUF_LAYOUT = GGUFLayout(
    "gpt-oss",
    _gguf_fields,
    layer_norms=GGUF_NORMS,
    extra_scalings=("yarn",),
    experts=GGUFExperts(
        True, "num_local_experts", "intermediate_size", renormalize_key=None, biases=True, interleaved=True
    ),
)

# A rank's share of each expert would be strided columns of the fused, interleaved gate/up
# tensor, and each head's sink would be sharded with its head: neither is written yet.
NO_TENSOR_PARALLEL = "its experts' gate and up features are interleaved in one fused tensor"
GPT_OSS = Family(
    "gpt_oss",
    ("gpt_oss",),
    ("GptOssForCausalLM",),
    Transformer,
    checkpoint_layout,
    ConfigRules(defaults=DEFAULTS, layer_types=layer_types, moe=_moe, attention_sinks=True),
    GGUF_LAYOUT,
    no_tensor_parallel=NO_TENSOR_PARALLEL,
)
