"""A GGUF file's metadata read into a Hugging Face style config.json (`gguf_config_dict`): the
keys every family shares here, each family's own by its record's GGUF layout (model/family.py,
filled in each family's file), with what llama.cpp assumes where a file stores nothing."""

from __future__ import annotations

from typing import Any

from compiled_engine.errors import CompiledEngineError, ModelSourceError
from compiled_engine.model.family import GGUFExperts, GGUFLayout, GGUFMetadata
from compiled_engine.model.registry import FAMILIES, family_of_gguf
from compiled_engine.weights.gguf import GGUFHeader, check_tensor, read_tensor


def gguf_metadata(header: GGUFHeader, architecture: str = "") -> GGUFMetadata:
    """The header's metadata as a family's GGUF layout reads it."""
    return GGUFMetadata(
        header.path, header.metadata, architecture, header.tensors, lambda name, count: _values(header, name, count)
    )


def _values(header: GGUFHeader, name: str, count: int) -> list[float]:
    """A small fp32 tensor's values (Phi-3's rope factors), read from the file."""
    info = header.tensors[name]
    if info.shape != (count,):
        raise ModelSourceError(
            f"{header.path}: tensor '{name}' has shape {list(info.shape)}, the rope implies [{count}]"
        )
    try:
        check_tensor(header, name)
        with header.path.open("rb") as f:
            values = read_tensor(f, header, name)
    except CompiledEngineError as exc:
        raise ModelSourceError(str(exc)) from exc
    return [float(v) for v in values.float().tolist()]


def supported_architectures() -> list[str]:
    """The GGUF `general.architecture` values the engine loads, from the family registry."""
    return list(dict.fromkeys(f.gguf.architecture for f in FAMILIES.values() if f.gguf is not None))


def gguf_config_dict(header: GGUFHeader) -> dict[str, Any]:
    """The Hugging Face style config.json of a GGUF file, from its metadata and tensor list (the
    head is tied when there is no `output.weight`; Phi-3's longrope factors are tensors)."""
    arch = gguf_metadata(header).get("general.architecture", str, required=True)
    experts = gguf_metadata(header, arch).arch("expert_count", int, 0)
    family = family_of_gguf(arch, experts > 0)
    if family is None or family.gguf is None:
        raise ModelSourceError(
            f"{header.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(supported_architectures())})"
        )
    layout, meta = family.gguf, gguf_metadata(header, arch)
    if layout.experts is None and experts > 0:
        raise meta.fail(f"mixture-of-experts GGUF models ({arch}.expert_count) are not supported")
    hidden = meta.arch("embedding_length", int, required=True)
    heads = meta.arch("attention.head_count", int, required=True)
    kv_heads = header.metadata.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list) and kv_heads and all(k == kv_heads[0] for k in kv_heads):
        kv_heads = kv_heads[0]  # a per-layer list, all the same
    if not isinstance(kv_heads, int) or isinstance(kv_heads, bool):
        raise meta.fail(f"GGUF metadata '{arch}.attention.head_count_kv' must be one int, got {kv_heads!r}")
    # As llama.cpp: the head size from key_length, else hidden / heads.
    head_dim = meta.arch("attention.key_length", int, hidden // max(heads, 1))
    if heads < 1 or head_dim < 1:  # divided by below (rotary fraction, Gemma's query scale)
        raise meta.fail(f"{heads} attention heads of {head_dim} dims each: both must be positive")
    value_dim = meta.arch("attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise meta.fail(f"value heads of {value_dim} differ from key heads of {head_dim}")
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if isinstance(tokens, list) else meta.arch("vocab_size", int, required=True)
    config: dict[str, Any] = {
        "model_type": family.model_types[0],
        "architectures": [family.classes[0]],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": meta.arch("feed_forward_length", int, required=True),
        "num_hidden_layers": meta.arch("block_count", int, required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.arch("attention.layer_norm_rms_epsilon", float, required=True),
        "rope_theta": meta.arch("rope.freq_base", float, 10000.0),
        "max_position_embeddings": meta.arch("context_length", int, required=True),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "attention_bias": "blk.0.attn_q.bias" in header.tensors or "blk.0.attn_qkv.bias" in header.tensors,
    }
    rope_dims = meta.arch("rope.dimension_count", int, head_dim)
    if rope_dims != head_dim:
        fraction = rope_dims / head_dim
        if not layout.partial_rotary or int(head_dim * fraction) != rope_dims:
            raise meta.fail(f"rotary embedding over {rope_dims} of {head_dim} dims is not supported for {arch}")
        config["partial_rotary_factor"] = fraction
    config |= _linear_rope_scaling(meta, layout)
    if layout.experts is not None:
        config |= _expert_fields(meta, layout.experts, config["intermediate_size"])
    config |= layout.config_fields(meta, config)
    config |= _special_tokens(meta)
    return config


# Router settings llama.cpp's MoE files may carry, and the one value of each these families run
# (softmax scores, weights not scaled, one shared expert, no dense layers first).
_ROUTER_FIXED = {
    "expert_gating_func": (1,),
    "expert_weights_scale": (0.0, 1.0),
    "expert_shared_count": (0, 1),
    "leading_dense_block_count": (0,),
}


def _expert_fields(meta: GGUFMetadata, experts: GGUFExperts, ffn: int) -> dict[str, Any]:
    """A mixture's config.json fields from llama.cpp's `expert_*` keys, with its assumptions where
    a file says nothing: the router renormalises or not by architecture, an expert (and a shared
    one) is `feed_forward_length` wide."""
    arch = meta.architecture
    count = meta.arch("expert_count", int, 0)
    if count < 1:
        raise meta.fail(f"a {arch} model needs its experts counted: GGUF metadata '{arch}.expert_count' is missing")
    for key, allowed in _ROUTER_FIXED.items():
        value = meta.arch(key, float if isinstance(allowed[0], float) else int, allowed[0])
        if value not in allowed:
            raise meta.fail(f"GGUF metadata '{arch}.{key}' is {value!r}: only {allowed[-1]!r} is supported for {arch}")
    renormalize = meta.arch("expert_weights_norm", bool, experts.renormalize)
    fields: dict[str, Any] = {
        experts.count_key: count,
        "num_experts_per_tok": meta.arch("expert_used_count", int, required=True),
        experts.width_key: meta.arch("expert_feed_forward_length", int, ffn),
    }
    if experts.renormalize_key is not None:
        fields[experts.renormalize_key] = renormalize
    elif renormalize != experts.renormalize:
        always = "always" if experts.renormalize else "never"
        raise meta.fail(
            f"GGUF metadata '{arch}.expert_weights_norm' is {renormalize}, but a {arch} mixture {always} "
            "renormalises its routed weights"
        )
    if experts.shared:
        fields["shared_expert_intermediate_size"] = meta.arch("expert_shared_feed_forward_length", int, ffn)
    return fields


def _linear_rope_scaling(meta: GGUFMetadata, layout: GGUFLayout) -> dict[str, Any]:
    # llama.cpp reads the factor whatever the type says (its default type is linear), and the
    # old key `rope.scale_linear` where the new one is missing.
    factor = meta.arch("rope.scaling.factor", float, meta.arch("rope.scale_linear", float, 0.0))
    scaling = meta.arch("rope.scaling.type", str, "linear")
    if scaling == "none" or scaling in layout.extra_scalings:  # the family's own reads the rest
        return {}
    if scaling != "linear":
        supported = ", ".join(("linear", *layout.extra_scalings))
        raise meta.fail(f"rope scaling type {scaling!r} is not supported for {meta.architecture} (only {supported})")
    if factor in (0.0, 1.0):  # 0: not set
        return {}
    return {"rope_scaling": {"rope_type": "linear", "factor": factor}}


def _special_tokens(meta: GGUFMetadata) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    bos = meta.get("tokenizer.ggml.bos_token_id", int)
    eos = [
        token
        for token in (meta.get("tokenizer.ggml.eos_token_id", int), meta.get("tokenizer.ggml.eot_token_id", int))
        if token is not None
    ]
    eos = list(dict.fromkeys(eos))  # one end of turn may be the end of text too
    if bos is not None:
        fields["bos_token_id"] = bos
    if eos:
        fields["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return fields
