"""What llama.cpp writes for each family, in one place: the metadata its converter stores and
llama.cpp assumes where it stores none (read into a Hugging Face style config.json by
`gguf_config_dict`), and how it names and transforms the weights (`GGUFLayout`, which
weights/gguf_loader.py follows to fill our modules).

llama.cpp's conventions, family by family, as its convert_hf_to_gguf.py writes files and its
src/models/*.cpp read them:
- Llama (and Mistral, which it writes as a llama model): q and k rows interleaved per head for its
  rope (we put them back); a head size of its own in `attention.key_length`; Llama 3.1's rope
  scaling as a `rope_freqs` tensor of divisors.
- Qwen2: q/k/v biases, no o bias; no sliding window (llama.cpp runs none).
- Gemma 2 and 3: every norm stored as 1 + w (Gemma's RMSNorm multiplies by 1 + w; the
  Hugging Face checkpoint holds w), q/k norms included; Gemma's norm before the MLP named
  `ffn_norm`, the two after `post_attention_norm` and `post_ffw_norm`; a tanh-approximated gelu.
  The query scale is not stored: llama.cpp takes 1/sqrt(head size), except for the 27B models
  (told apart by their layer count, 46 for Gemma 2 and 62 for Gemma 3), where it is
  1/sqrt(hidden / heads), as Google's reference code does. Which layers slide comes from
  `attention.sliding_window_pattern` when a file has it (a period or one flag per layer), else
  every second layer from the first (Gemma 2) or five in six (Gemma 3); the converter writes no
  pattern for either. Gemma 2 slides over 4096 tokens and caps attention logits at 50 and final
  ones at 30 unless the file says otherwise, its sliding layers' rope base the global one. Gemma 3
  takes the sliding layers' rope base from `rope.freq_base_swa` (10000 without it) and applies
  a linear rope scaling to its full layers only; it has no attention soft cap.
- Phi-3: q/k/v fused in `attn_qkv` and gate/up in `ffn_up` (gate rows first), as our modules hold
  them; no head size stored (hidden / heads); `rope.dimension_count` below the head size for a
  partial rotary; longrope as `rope_factors_long` and `rope_factors_short` tensors with
  `rope.scaling.attn_factor` and `rope.scaling.original_context_length`. llama.cpp currently
  ignores a Phi-3 sliding window; we keep it, as transformers runs it, so a converted model
  behaves as the model it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compiled_engine.errors import CompiledEngineError, ModelSourceError
from compiled_engine.model.config import Architecture
from compiled_engine.model.families import FAMILIES, family_of_gguf
from compiled_engine.weights.gguf import GGUFHeader, check_tensor, read_tensor

LONG_FACTORS = "rope_factors_long.weight"
SHORT_FACTORS = "rope_factors_short.weight"
ROPE_FREQS = "rope_freqs.weight"

# (the file's layer norm, ours), after `blk.N.`.
LLAMA_NORMS = (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"))
GEMMA_NORMS = (
    ("attn_norm", "input_layernorm"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)


class Metadata:
    """A GGUF file's metadata, read with its types checked; `arch` reads the family's own keys
    (`{architecture}.{key}`)."""

    def __init__(self, header: GGUFHeader, architecture: str) -> None:
        self.header, self.architecture = header, architecture

    def get(self, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
        value = self.header.metadata.get(key)
        if value is None:
            if required:
                raise ModelSourceError(f"{self.header.path}: GGUF metadata '{key}' is missing")
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ModelSourceError(f"{self.header.path}: GGUF metadata '{key}' must be {kind.__name__}, got {value!r}")
        return value

    def arch(self, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
        return self.get(f"{self.architecture}.{key}", kind, default, required)

    def fail(self, what: str) -> ModelSourceError:
        return ModelSourceError(f"{self.header.path}: {what}")


# A family's own config.json fields from its metadata, given the common ones already read.
ConfigFields = Callable[[Metadata, dict[str, Any]], dict[str, Any]]


def _no_fields(meta: Metadata, config: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp stores one family: its config.json identity, the fields only it has, and its
    tensors' names and transformations."""

    model_type: str
    hf_class: str
    config_fields: ConfigFields = _no_fields
    permuted_qk: bool = False  # q/k rows interleaved per head for llama.cpp's rope
    fused_qkv: bool = False  # q/k/v rows in one `attn_qkv`
    fused_gate_up: bool = False  # gate rows then up rows in one `ffn_up`
    norm_offset: float = 0.0  # every norm stored as ours + this
    layer_norms: tuple[tuple[str, str], ...] = LLAMA_NORMS
    partial_rotary: bool = False  # `rope.dimension_count` may be below the head size
    extra_scalings: tuple[str, ...] = ()  # rope scaling types its config_fields reads


def _sliding_layers(meta: Metadata, layers: int, default_period: int) -> list[str]:
    """Each layer's attention type as llama.cpp decides it: the file's pattern (one flag per layer,
    or a period n: layer i slides unless i % n == n - 1, every layer for n = 0), else the
    family's period."""
    pattern = meta.header.metadata.get(f"{meta.architecture}.attention.sliding_window_pattern", default_period)
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise meta.fail(f"'{meta.architecture}.attention.sliding_window_pattern' must hold one flag per layer")
        slides = list(pattern)
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        slides = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    else:
        raise meta.fail(f"'{meta.architecture}.attention.sliding_window_pattern' must be a period or flags")
    return ["sliding_attention" if s else "full_attention" for s in slides]


def _gemma_query_scalar(config: dict[str, Any], big_model_layers: int) -> int:
    # llama.cpp's attention scale (src/models/gemma2.cpp, gemma3.cpp): the 27B models, known by
    # their layer count, scale by hidden / heads, every other size by the head size.
    if config["num_hidden_layers"] == big_model_layers:
        return int(config["hidden_size"] // config["num_attention_heads"])
    return int(config["head_dim"])


def _soft_cap(meta: Metadata, key: str, default: float | None) -> float | None:
    cap = meta.arch(key, float, default)
    return cap if cap else None  # 0 in a file: no cap


def _gemma2(meta: Metadata, config: dict[str, Any]) -> dict[str, Any]:
    swa_base = meta.arch("rope.freq_base_swa", float, config["rope_theta"])
    if swa_base != config["rope_theta"]:
        raise meta.fail(
            f"a Gemma 2 sliding-layer rope base ({swa_base}) other than the global one ({config['rope_theta']}) "
            "is not supported"
        )
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_query_scalar(config, 46),
        "sliding_window": meta.arch("attention.sliding_window", int, 4096),
        "layer_types": _sliding_layers(meta, config["num_hidden_layers"], 2),
        "attn_logit_softcapping": _soft_cap(meta, "attn_logit_softcapping", 50.0),
        "final_logit_softcapping": _soft_cap(meta, "final_logit_softcapping", 30.0),
    }


def _gemma3(meta: Metadata, config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    window = meta.arch("attention.sliding_window", int, 0)
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_query_scalar(config, 62),
        "attn_logit_softcapping": None,  # llama.cpp's Gemma 3 has none, whatever a file says
        "final_logit_softcapping": _soft_cap(meta, "final_logit_softcapping", None),
        "rope_local_base_freq": meta.arch("rope.freq_base_swa", float, 10000.0),
    }
    if window > 0:
        return fields | {"sliding_window": window, "layer_types": _sliding_layers(meta, layers, 6)}
    return fields | {"sliding_window": None, "layer_types": ["full_attention"] * layers}


def _phi3(meta: Metadata, config: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    window = meta.arch("attention.sliding_window", int, 0)
    if window > 0:  # 0: none (Phi-4-mini)
        fields["sliding_window"] = window
    header, arch = meta.header, meta.architecture
    present = [name for name in (LONG_FACTORS, SHORT_FACTORS) if name in header.tensors]
    declared = []  # what says the file's rope is longrope, besides the factors themselves
    if meta.arch("rope.scaling.type", str) == "longrope":
        declared.append(f"{arch}.rope.scaling.type = longrope")
    if meta.arch("rope.scaling.attn_factor", float) is not None:
        declared.append(f"{arch}.rope.scaling.attn_factor")
    if not present:
        if declared:
            raise meta.fail(
                f"it declares longrope ({', '.join(declared)}) but has neither {LONG_FACTORS} nor {SHORT_FACTORS}: "
                "the rope's factors are missing"
            )
        return fields
    if len(present) == 1:
        missing = SHORT_FACTORS if present == [LONG_FACTORS] else LONG_FACTORS
        raise meta.fail(f"it has {present[0]} but not {missing}: longrope needs both")
    pairs = meta.arch("rope.dimension_count", int, config["head_dim"]) // 2  # one factor per rotated pair
    original = meta.arch("rope.scaling.original_context_length", int, config["max_position_embeddings"])
    rope: dict[str, Any] = {
        "rope_type": "longrope",
        "rope_theta": config["rope_theta"],
        "long_factor": _factors(header, LONG_FACTORS, pairs),
        "short_factor": _factors(header, SHORT_FACTORS, pairs),
        "original_max_position_embeddings": original,
    }
    attention_factor = meta.arch("rope.scaling.attn_factor", float)
    if attention_factor is not None:
        rope["attention_factor"] = attention_factor
    return fields | {"rope_scaling": rope, "original_max_position_embeddings": original}


def _factors(header: GGUFHeader, name: str, count: int) -> list[float]:
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


LAYOUTS: dict[Architecture, GGUFLayout] = {
    "llama": GGUFLayout("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": GGUFLayout("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GGUFLayout("qwen3", "Qwen3ForCausalLM"),
    "gemma2": GGUFLayout("gemma2", "Gemma2ForCausalLM", _gemma2, norm_offset=1.0, layer_norms=GEMMA_NORMS),
    "gemma3": GGUFLayout("gemma3_text", "Gemma3ForCausalLM", _gemma3, norm_offset=1.0, layer_norms=GEMMA_NORMS),
    "phi3": GGUFLayout(
        "phi3",
        "Phi3ForCausalLM",
        _phi3,
        fused_qkv=True,
        fused_gate_up=True,
        partial_rotary=True,
        extra_scalings=("longrope",),
    ),
}


def supported_architectures() -> list[str]:
    """The GGUF `general.architecture` values the engine loads, from the family registry."""
    return [f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture and f.name in LAYOUTS]


def gguf_config_dict(header: GGUFHeader) -> dict[str, Any]:
    """The Hugging Face style config.json of a GGUF file, from its metadata and tensor list (the
    head is tied when there is no `output.weight`; Phi-3's longrope factors are tensors)."""
    arch = Metadata(header, "").get("general.architecture", str, required=True)
    family = family_of_gguf(arch)
    if family is None or family.name not in LAYOUTS:
        raise ModelSourceError(
            f"{header.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(supported_architectures())})"
        )
    layout, meta = LAYOUTS[family.name], Metadata(header, arch)
    if meta.arch("expert_count", int, 0) > 0:
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
        "model_type": layout.model_type,
        "architectures": [layout.hf_class],
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
    config |= layout.config_fields(meta, config)
    config |= _special_tokens(meta)
    return config


def _linear_rope_scaling(meta: Metadata, layout: GGUFLayout) -> dict[str, Any]:
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


def _special_tokens(meta: Metadata) -> dict[str, Any]:
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
