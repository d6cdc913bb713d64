"""ModelConfig: the typed view of a Hugging Face config.json for the families we run.

Which `model_type` is which family is the registry's (model/registry.py); this module reads any
family's fields into one plain struct, where families differ as its `ConfigRules` say (each
family's file holds its own), with transformers' defaults where a config leaves one out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from compiled_engine.errors import ModelConfigError
from compiled_engine.model.moe_config import MoEConfig

Activation = Literal["silu", "gelu_tanh"]
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn")
SLIDING, FULL = "sliding_attention", "full_attention"

_ACTIVATIONS: dict[str, Activation] = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class RopeConfig(msgspec.Struct, frozen=True):
    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): one factor per frequency for contexts within the pretraining length and
    # one for longer ones, and the scale of cos and sin.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    use_long_factor: bool = False
    # yarn (gpt-oss): the dims that turn fewer than beta_slow times over the original context
    # are slowed by `factor`, those that turn more than beta_fast times kept, a ramp between
    # (its ends rounded outward when `truncate`); cos and sin scaled by `attention_factor`.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def for_context(self, max_tokens: int) -> RopeConfig:
        """This rope for an engine whose sequences reach `max_tokens`: longrope takes its long
        factors when that passes the pretraining length (fixed per engine, as llama.cpp does, so
        a sequence's rotation never depends on the batch it runs in)."""
        if self.type != "longrope":
            return self
        return msgspec.structs.replace(self, use_long_factor=max_tokens > self.original_max_position_embeddings)


class ModelConfig(msgspec.Struct, frozen=True):
    architecture: str  # the family's name (model/registry.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    qk_norm_whole: bool = False  # q and k normalised over all their heads at once (OLMoE), not per head
    clip_qkv: float = 0.0  # q, k and v clamped to +-this (OLMoE's option); 0: not clamped
    hidden_act: Activation = "silu"
    rotary_dim: int = 0  # the dims of a head that rotate; 0: all of them
    rope_local: RopeConfig | None = None  # the sliding layers' rope, where it differs (Gemma 3)
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window, 0 for full; () all full
    query_pre_attn_scalar: float | None = None  # softmax scale 1/sqrt(this); None: head_dim
    # Granite's multipliers (1.0, None: no change): the embeddings scaled, each sublayer's output
    # scaled before its residual add, the softmax scale itself, the logits divided by.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    attn_soft_cap: float = 0.0  # 0: none
    final_soft_cap: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    moe: MoEConfig | None = None  # a mixture of experts in place of the MLP (model/moe.py)
    attention_sinks: bool = False  # a learned sink logit per query head in every layer (gpt-oss)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotated_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens, 0 when it attends to every earlier token."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def sliding(self) -> bool:
        return any(self.layer_windows)

    def for_context(self, max_tokens: int) -> ModelConfig:
        """This config for an engine whose sequences reach `max_tokens` (RopeConfig.for_context)."""
        return msgspec.structs.replace(self, rope=self.rope.for_context(max_tokens))


def declared_layer_types(raw: dict[str, Any], num_layers: int) -> Any:
    """Each layer's attention type as transformers reads most configs: `layer_types`, else the
    layers from `max_window_layers` on slide when `use_sliding_window` is set (Llama's, Qwen's)."""
    if raw.get("layer_types") is not None:
        return raw["layer_types"]
    first = raw.get("max_window_layers", num_layers) if raw.get("use_sliding_window") else num_layers
    return [SLIDING if i >= first else FULL for i in range(num_layers)]


@dataclass(frozen=True)
class ConfigRules:
    """How one family's config.json reads where families differ; the rest reads alike."""

    defaults: Mapping[str, Any] = field(default_factory=dict)  # transformers' values for fields left out
    activation_key: str = "hidden_act"  # read first when set (Gemma's `hidden_activation`)
    fixed_qkv_bias: bool = False  # q/k/v biases always, o_proj's never, whatever attention_bias says
    qk_norm: bool = False  # per-head q/k RMSNorm
    qk_norm_whole: bool = False  # the q/k RMSNorm over all heads at once, and `clip_qkv` read
    query_scale: bool = False  # the softmax scale from `query_pre_attn_scalar`
    local_rope: bool = False  # the sliding layers' own rope
    multipliers: bool = False  # Granite's embedding, residual, attention and logits multipliers
    # Each layer's attention type from the config (then checked): a list, SLIDING or FULL each.
    layer_types: Callable[[dict[str, Any], int], Any] = declared_layer_types
    # The mixture of experts from the config (model/moe_config.py), for an MoE family.
    moe: Callable[[dict[str, Any], str], MoEConfig] | None = None
    attention_sinks: bool = False  # a learned sink logit per query head (gpt-oss)


def read_config_json(model_dir: str | Path) -> tuple[dict[str, Any], str]:
    """A model directory's config.json as a dict, with its path for messages."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path} must hold a JSON object")
    return raw, str(path)


def _require(raw: dict[str, Any], key: str, kind: type, source: str) -> Any:
    if key not in raw:
        raise ModelConfigError(f"{source}: required field '{key}' is missing")
    value = raw[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ModelConfigError(f"{source}: field '{key}' must be {kind.__name__}, got {value!r}")
    return value


def _flag(raw: dict[str, Any], key: str, source: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ModelConfigError(f"{source}: field '{key}' must be true or false, got {value!r}")
    return value


def _positive(raw: dict[str, Any], key: str, source: str) -> int:
    value = _require(raw, key, int, source)
    if value <= 0:
        raise ModelConfigError(f"{source}: field '{key}' must be positive, got {value!r}")
    return int(value)


def _rope(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (holding rope_theta); older files write
    # `rope_theta` plus an optional `rope_scaling` dict.
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ModelConfigError(f"{source}: field 'rope_parameters' must be an object, got {params!r}")
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelConfigError(f"{source}: field 'rope_scaling' must be an object, got {scaling!r}")
    merged: dict[str, Any] = {**(scaling or {}), **(params or {})}
    return _rope_from(merged, raw, source, raw.get("rope_theta", 10000.0))


def _layer_ropes(raw: dict[str, Any], source: str) -> tuple[RopeConfig, RopeConfig]:
    """Two ropes, (full layers', sliding layers') (Gemma 3's): transformers 5 keys rope_parameters
    by layer type; older files give rope_theta and rope_scaling for the full layers and
    rope_local_base_freq for the sliding ones."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and {"full_attention", "sliding_attention"} <= params.keys():
        ropes = []
        for layer_type in ("full_attention", "sliding_attention"):
            part = params[layer_type]
            if not isinstance(part, dict):
                raise ModelConfigError(
                    f"{source}: field 'rope_parameters.{layer_type}' must be an object, got {part!r}"
                )
            ropes.append(_rope_from(part, raw, source, 10000.0))
        return ropes[0], ropes[1]
    local_theta = raw.get("rope_local_base_freq", 10000.0)
    return _rope(raw, source), _rope_from({}, raw, source, local_theta)


def _rope_from(merged: dict[str, Any], raw: dict[str, Any], source: str, default_theta: Any) -> RopeConfig:
    theta = merged.get("rope_theta", default_theta)
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise ModelConfigError(f"{source}: field 'rope_theta' must be a positive number, got {theta!r}")
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "su":  # the first Phi-3 files' name for longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: unsupported rope scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    fields: dict[str, Any] = {"theta": float(theta), "type": rope_type}
    if rope_type == "longrope":
        return _longrope(merged, raw, source, fields)
    if rope_type == "yarn":
        return _yarn(merged, raw, source, fields)
    if rope_type != "default":
        if "factor" not in merged:
            raise ModelConfigError(f"{source}: rope scaling type {rope_type!r} needs 'factor'")
        fields["factor"] = _rope_number(merged, "factor", rope_type, source)
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in merged:
                raise ModelConfigError(f"{source}: rope scaling type 'llama3' needs '{key}'")
            fields[key] = _rope_number(merged, key, rope_type, source)
        if fields["high_freq_factor"] <= fields["low_freq_factor"]:
            raise ModelConfigError(
                f"{source}: rope scaling type 'llama3' needs high_freq_factor > low_freq_factor, got "
                f"{merged['high_freq_factor']!r} and {merged['low_freq_factor']!r}"
            )
        original = merged["original_max_position_embeddings"]
        if not isinstance(original, int):
            raise ModelConfigError(
                f"{source}: rope scaling field 'original_max_position_embeddings' must be int, got {original!r}"
            )
        fields["original_max_position_embeddings"] = original
    return RopeConfig(**fields)


def _longrope(merged: dict[str, Any], raw: dict[str, Any], source: str, fields: dict[str, Any]) -> RopeConfig:
    # As transformers reads it: factor defaults to the ratio of the two context lengths, and
    # the attention factor to sqrt(1 + ln(factor) / ln(original length)).
    original = merged.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ModelConfigError(
            f"{source}: rope scaling type 'longrope' needs a positive int 'original_max_position_embeddings', "
            f"got {original!r}"
        )
    factors: dict[str, tuple[float, ...]] = {}
    for key in ("short_factor", "long_factor"):
        value = merged.get(key)
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in value)
        ):
            raise ModelConfigError(f"{source}: rope scaling type 'longrope' needs '{key}', a list of positive numbers")
        factors[key] = tuple(float(v) for v in value)
    factor = merged.get("factor")
    if factor is None:
        factor = raw.get("max_position_embeddings", original) / original
    attention_factor = merged.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if isinstance(attention_factor, bool) or not isinstance(attention_factor, int | float) or attention_factor <= 0:
        raise ModelConfigError(
            f"{source}: rope scaling field 'attention_factor' must be a positive number, got {attention_factor!r}"
        )
    return RopeConfig(
        theta=fields["theta"],
        type="longrope",
        original_max_position_embeddings=original,
        short_factor=factors["short_factor"],
        long_factor=factors["long_factor"],
        attention_factor=float(attention_factor),
    )


def _yarn(merged: dict[str, Any], raw: dict[str, Any], source: str, fields: dict[str, Any]) -> RopeConfig:
    # As transformers reads it: the attention factor defaults to 0.1 * ln(factor) + 1, or the
    # ratio of two such terms with DeepSeek's mscale and mscale_all_dim; truncate to true.
    original = merged.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ModelConfigError(
            f"{source}: rope scaling type 'yarn' needs a positive int 'original_max_position_embeddings', got {original!r}"
        )
    if "factor" not in merged:
        raise ModelConfigError(f"{source}: rope scaling type 'yarn' needs 'factor'")
    factor = _rope_number(merged, "factor", "yarn", source)
    beta_fast = _rope_number(merged, "beta_fast", "yarn", source) if "beta_fast" in merged else 32.0
    beta_slow = _rope_number(merged, "beta_slow", "yarn", source) if "beta_slow" in merged else 1.0
    truncate = merged.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ModelConfigError(f"{source}: rope scaling field 'truncate' must be true or false, got {truncate!r}")
    if merged.get("attention_factor") is not None:
        attention_factor = _rope_number(merged, "attention_factor", "yarn", source)
    elif merged.get("mscale") and merged.get("mscale_all_dim"):
        mscale, all_dim = (_rope_number(merged, key, "yarn", source) for key in ("mscale", "mscale_all_dim"))
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
    else:
        attention_factor = _yarn_mscale(factor, 1.0)
    return RopeConfig(
        theta=fields["theta"],
        type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=attention_factor,
        truncate=truncate,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_number(merged: dict[str, Any], key: str, rope_type: str, source: str) -> float:
    value = merged[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ModelConfigError(
            f"{source}: rope scaling type {rope_type!r} field '{key}' must be a positive number, got {value!r}"
        )
    return float(value)


def _token_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def parse_config(raw: dict[str, Any], source: str, family: str, rules: ConfigRules) -> ModelConfig:
    """The config of family `family` (model/registry.py found it) from its config.json `raw`."""
    raw = {**rules.defaults, **raw}
    hidden_size = _positive(raw, "hidden_size", source)
    num_heads = _positive(raw, "num_attention_heads", source)
    num_kv_heads = num_heads
    if raw.get("num_key_value_heads") is not None:
        num_kv_heads = _positive(raw, "num_key_value_heads", source)
    if num_heads % num_kv_heads != 0:
        raise ModelConfigError(
            f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    if raw.get("head_dim") is not None:
        head_dim = _positive(raw, "head_dim", source)
    else:
        if hidden_size % num_heads != 0:
            raise ModelConfigError(
                f"{source}: hidden_size={hidden_size} is not divisible by "
                f"num_attention_heads={num_heads} and no head_dim is given"
            )
        head_dim = hidden_size // num_heads
    if head_dim % 2 != 0:
        raise ModelConfigError(f"{source}: head_dim={head_dim} must be even for rotary embeddings")
    act_key = rules.activation_key if raw.get(rules.activation_key) is not None else "hidden_act"
    act = raw.get(act_key, "silu")
    if act not in _ACTIVATIONS:
        raise ModelConfigError(f"{source}: unsupported {act_key}={act!r} (supported: {', '.join(_ACTIVATIONS)})")
    if raw.get("mlp_bias"):
        raise ModelConfigError(f"{source}: unsupported mlp_bias=True")
    eps = _positive_number(raw, "rms_norm_eps", source)
    num_layers = _positive(raw, "num_hidden_layers", source)
    rope, rope_local = _layer_ropes(raw, source) if rules.local_rope else (_rope(raw, source), None)
    bos = raw.get("bos_token_id")
    attention_bias = _flag(raw, "attention_bias", source)
    return ModelConfig(
        architecture=family,
        vocab_size=_positive(raw, "vocab_size", source),
        hidden_size=hidden_size,
        intermediate_size=_positive(raw, "intermediate_size", source),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope=rope,
        rope_local=rope_local,
        max_position_embeddings=_positive(raw, "max_position_embeddings", source),
        tie_word_embeddings=_flag(raw, "tie_word_embeddings", source),
        qkv_bias=attention_bias or rules.fixed_qkv_bias,
        o_bias=attention_bias and not rules.fixed_qkv_bias,
        qk_norm=rules.qk_norm or rules.qk_norm_whole,
        qk_norm_whole=rules.qk_norm_whole,
        clip_qkv=_soft_cap(raw, "clip_qkv", source) if rules.qk_norm_whole else 0.0,
        hidden_act=_ACTIVATIONS[act],
        rotary_dim=_rotary_dim(raw, head_dim, source),
        layer_windows=_layer_windows(rules.layer_types(raw, num_layers), raw, num_layers, source),
        query_pre_attn_scalar=_positive_number(raw, "query_pre_attn_scalar", source) if rules.query_scale else None,
        **(_multipliers(raw, source) if rules.multipliers else {}),
        attn_soft_cap=_soft_cap(raw, "attn_logit_softcapping", source),
        final_soft_cap=_soft_cap(raw, "final_logit_softcapping", source),
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        moe=rules.moe(raw, source) if rules.moe is not None else None,
        attention_sinks=rules.attention_sinks,
    )


def _positive_number(raw: dict[str, Any], key: str, source: str) -> float:
    value = _require(raw, key, float, source)
    if value <= 0:
        raise ModelConfigError(f"{source}: field '{key}' must be positive, got {value!r}")
    return float(value)


def _multipliers(raw: dict[str, Any], source: str) -> dict[str, float]:
    # transformers' Granite defaults are all 1.0, the softmax scale included (not 1/sqrt(head_dim)).
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    values = {}
    for key in keys:
        value = raw.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ModelConfigError(f"{source}: field '{key}' must be a positive number, got {value!r}")
        values[key] = float(value)
    return values


def _soft_cap(raw: dict[str, Any], key: str, source: str) -> float:
    if raw.get(key) is None:
        return 0.0
    return _positive_number(raw, key, source)


def _rotary_dim(raw: dict[str, Any], head_dim: int, source: str) -> int:
    # Phi-4-mini rotates only part of each head; transformers 5 keeps the fraction in
    # rope_parameters, older files at the top level.
    params = raw.get("rope_parameters")
    fraction = raw.get("partial_rotary_factor", 1.0)
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        fraction = params["partial_rotary_factor"]
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise ModelConfigError(f"{source}: field 'partial_rotary_factor' must be in (0, 1], got {fraction!r}")
    rotary_dim = int(head_dim * fraction)
    if rotary_dim % 2 != 0 or rotary_dim == 0:
        raise ModelConfigError(
            f"{source}: partial_rotary_factor={fraction!r} rotates {rotary_dim} of {head_dim} dims; it must be even"
        )
    return 0 if rotary_dim == head_dim else rotary_dim


def _layer_windows(layer_types: Any, raw: dict[str, Any], num_layers: int, source: str) -> tuple[int, ...]:
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ModelConfigError(f"{source}: field 'layer_types' must list one type per layer, got {layer_types!r}")
    unknown = sorted({t for t in layer_types if t not in (FULL, SLIDING)})
    if unknown:
        raise ModelConfigError(
            f"{source}: unsupported layer types {unknown} (supported: full_attention, sliding_attention)"
        )
    if SLIDING not in layer_types:
        return ()
    window = _positive(raw, "sliding_window", source)
    return tuple(window if t == SLIDING else 0 for t in layer_types)
