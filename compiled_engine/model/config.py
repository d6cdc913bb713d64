"""ModelConfig: the typed view of a Hugging Face config.json for the architectures we run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

from compiled_engine.errors import ModelConfigError

Architecture = Literal["llama", "qwen3"]
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")

_ARCHITECTURE_BY_MODEL_TYPE: dict[str, Architecture] = {"llama": "llama", "qwen3": "qwen3"}
_ARCHITECTURE_BY_CLASS: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


class RopeConfig(msgspec.Struct, frozen=True):
    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelConfig(msgspec.Struct, frozen=True):
    architecture: Architecture
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
    attention_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        return _parse(raw, source)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{path} does not exist")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path} must hold a JSON object")
        return _parse(raw, str(path))


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


def _architecture(raw: dict[str, Any], source: str) -> Architecture:
    # model_type decides when present (a Mistral config may still name LlamaForCausalLM);
    # the class list is only a fallback for configs without one.
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in _ARCHITECTURE_BY_MODEL_TYPE:
        return _ARCHITECTURE_BY_MODEL_TYPE[model_type]
    for name in raw.get("architectures") or [] if model_type is None else []:
        if name in _ARCHITECTURE_BY_CLASS:
            return _ARCHITECTURE_BY_CLASS[name]
    raise ModelConfigError(
        f"{source}: unsupported architecture (model_type={model_type!r}, "
        f"architectures={raw.get('architectures')!r}); supported model_type values: "
        f"{sorted(_ARCHITECTURE_BY_MODEL_TYPE)}"
    )


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
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise ModelConfigError(f"{source}: field 'rope_theta' must be a positive number, got {theta!r}")
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: unsupported rope scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    fields: dict[str, Any] = {"theta": float(theta), "type": rope_type}
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


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    architecture = _architecture(raw, source)
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
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{source}: unsupported hidden_act={raw['hidden_act']!r} (only 'silu')")
    layer_types = raw.get("layer_types") or []
    if raw.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise ModelConfigError(
            f"{source}: sliding-window attention is not supported "
            f"(use_sliding_window={raw.get('use_sliding_window')!r}, layer_types={layer_types!r})"
        )
    if raw.get("mlp_bias"):
        raise ModelConfigError(f"{source}: unsupported mlp_bias=True")
    eps = _require(raw, "rms_norm_eps", float, source)
    if eps <= 0:
        raise ModelConfigError(f"{source}: field 'rms_norm_eps' must be positive, got {eps!r}")
    bos = raw.get("bos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=_positive(raw, "vocab_size", source),
        hidden_size=hidden_size,
        intermediate_size=_positive(raw, "intermediate_size", source),
        num_layers=_positive(raw, "num_hidden_layers", source),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        rope=_rope(raw, source),
        max_position_embeddings=_positive(raw, "max_position_embeddings", source),
        tie_word_embeddings=_flag(raw, "tie_word_embeddings", source),
        attention_bias=_flag(raw, "attention_bias", source),
        qk_norm=architecture == "qwen3",
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
    )
