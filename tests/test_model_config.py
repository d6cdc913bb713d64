"""ModelConfig parsing, checked against config.json files that transformers itself writes, and
the rotary frequencies we derive from it, checked against transformers' own RoPE functions."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from compiled_engine.errors import ModelConfigError
from compiled_engine.model.config import RopeConfig
from compiled_engine.model.layers import RotaryEmbedding, rope_inverse_frequencies
from compiled_engine.model.registry import config_from_dict, config_from_model_dir

SMALL: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    return AutoConfig.for_model(model_type, **{**SMALL, **overrides})


def hf_dict(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    """config.json content exactly as transformers would write it."""
    return hf_config(model_type, **overrides).to_dict()


def legacy(raw: dict[str, Any], theta: float, scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """The same config spelled the transformers-4 way: top-level rope_theta, rope_scaling."""
    out = {k: v for k, v in raw.items() if k != "rope_parameters"}
    out["rope_theta"] = theta
    out["rope_scaling"] = scaling
    return out


def config_error(raw: dict[str, Any], message: str) -> ModelConfigError:
    with pytest.raises(ModelConfigError, match=message) as info:
        config_from_dict(raw)
    return info.value


# --- parsing real transformers configs -------------------------------------------------------


def test_llama_config_written_by_transformers() -> None:
    config = config_from_dict(hf_dict("llama"))
    assert config.architecture == "llama"
    assert config.vocab_size == 320
    assert config.hidden_size == 64
    assert config.intermediate_size == 128
    assert config.num_layers == 2
    assert config.num_heads == 4
    assert config.num_kv_heads == 2  # GQA: two query heads per kv head
    assert config.head_dim == 16  # transformers writes hidden_size // heads
    assert config.q_size == 64
    assert config.kv_size == 32
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.max_position_embeddings == 256
    assert config.tie_word_embeddings is False
    assert config.qkv_bias is False and config.o_bias is False
    assert config.qk_norm is False
    assert config.eos_token_ids == (2,)
    assert config.bos_token_id == 1
    assert config.rope == RopeConfig(theta=10000.0, type="default")


def test_qwen3_config_written_by_transformers_with_explicit_head_dim() -> None:
    # Qwen3 decouples head_dim from hidden_size / heads (here 32, not 64 // 4 = 16).
    config = config_from_dict(hf_dict("qwen3", head_dim=32, rope_theta=1_000_000.0))
    assert config.architecture == "qwen3"
    assert config.head_dim == 32
    assert config.q_size == 4 * 32
    assert config.kv_size == 2 * 32
    assert config.qk_norm is True
    assert config.rope.theta == 1_000_000.0
    assert config.num_kv_heads == 2


def test_explicit_head_dim_wins_over_derived() -> None:
    derived = config_from_dict({**hf_dict("llama"), "head_dim": None})
    explicit = config_from_dict({**hf_dict("llama"), "head_dim": 8})
    assert derived.head_dim == 16
    assert explicit.head_dim == 8
    assert explicit.q_size == 32


def test_hidden_not_divisible_by_heads_is_fine_with_explicit_head_dim() -> None:
    raw = {**hf_dict("qwen3", head_dim=32), "hidden_size": 66}
    assert config_from_dict(raw).head_dim == 32


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_from_model_dir_reads_save_pretrained_output(tmp_path: Path, model_type: str) -> None:
    hf = hf_config(model_type, tie_word_embeddings=True, eos_token_id=[2, 7])
    hf.save_pretrained(tmp_path)
    config = config_from_model_dir(tmp_path)
    assert config == config_from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert config.architecture == model_type
    assert config.tie_word_embeddings is True
    assert config.eos_token_ids == (2, 7)
    assert config_from_model_dir(str(tmp_path)) == config


def test_missing_kv_heads_means_multi_head_attention() -> None:
    raw = hf_dict("llama")
    del raw["num_key_value_heads"]
    assert config_from_dict(raw).num_kv_heads == 4
    raw["num_key_value_heads"] = None
    assert config_from_dict(raw).num_kv_heads == 4


def test_architecture_from_architectures_when_model_type_is_absent() -> None:
    raw = hf_dict("qwen3", head_dim=32)
    del raw["model_type"]
    raw["architectures"] = ["Qwen3ForCausalLM"]
    assert config_from_dict(raw).architecture == "qwen3"


def test_token_ids_are_read_leniently() -> None:
    raw = hf_dict("llama")
    raw.update(eos_token_id=None, bos_token_id=None)
    config = config_from_dict(raw)
    assert config.eos_token_ids == ()
    assert config.bos_token_id is None
    raw.update(eos_token_id=[5, True, "x", 6], bos_token_id=True)
    config = config_from_dict(raw)
    assert config.eos_token_ids == (5, 6)
    assert config.bos_token_id is None


def test_integer_eps_is_accepted_as_float() -> None:
    config = config_from_dict({**hf_dict("llama"), "rms_norm_eps": 1})
    assert config.rms_norm_eps == 1.0
    assert isinstance(config.rms_norm_eps, float)


# --- rope spellings -------------------------------------------------------------------------


def test_both_rope_spellings_give_the_same_theta() -> None:
    modern = hf_dict("llama", rope_theta=500_000.0)
    assert modern["rope_parameters"]["rope_theta"] == 500_000.0  # transformers 5 spelling
    assert modern.get("rope_theta") is None
    old = legacy(modern, 500_000.0)
    assert config_from_dict(modern).rope == config_from_dict(old).rope
    assert config_from_dict(old).rope.theta == 500_000.0


def test_rope_parameters_theta_wins_over_top_level() -> None:
    raw = hf_dict("llama", rope_theta=123.0)
    raw["rope_theta"] = 999.0
    assert config_from_dict(raw).rope.theta == 123.0


def test_rope_theta_defaults_to_10000_when_absent() -> None:
    raw = hf_dict("llama")
    del raw["rope_parameters"]
    assert config_from_dict(raw).rope.theta == 10000.0


def test_llama3_rope_both_spellings() -> None:
    modern = hf_dict(
        "llama",
        max_position_embeddings=131072,
        rope_parameters={**LLAMA3_ROPE, "rope_theta": 500_000.0},
    )
    old = legacy(modern, 500_000.0, scaling=dict(LLAMA3_ROPE))
    # transformers itself accepts the old kwargs and writes the new spelling
    converted = hf_dict(
        "llama",
        max_position_embeddings=131072,
        rope_theta=500_000.0,
        rope_scaling=dict(LLAMA3_ROPE),
    )
    expected = RopeConfig(
        theta=500_000.0,
        type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    assert config_from_dict(modern).rope == expected
    assert config_from_dict(old).rope == expected
    assert config_from_dict(converted).rope == expected


def test_linear_rope_old_type_key() -> None:
    # Very old files spell the scaling kind `type`, not `rope_type`.
    old = legacy(hf_dict("llama"), 10000.0, scaling={"type": "linear", "factor": 2})
    rope = config_from_dict(old).rope
    assert rope.type == "linear"
    assert rope.factor == 2.0
    modern = hf_dict("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    assert config_from_dict(modern).rope == rope


# --- rejected configs -----------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["gpt2", "falcon"])
def test_unsupported_architecture(model_type: str) -> None:
    raw = AutoConfig.for_model(model_type).to_dict()
    error = config_error(raw, re.escape(f"unsupported architecture (model_type='{model_type}'"))
    families = "gemma2 gemma3_text gpt_oss granitemoe granitemoeshared llama mistral mixtral olmoe phi3 qwen2 qwen2_moe"
    supported = str([*families.split(), "qwen3", "qwen3_moe"])
    assert f"supported model_type values: {supported}" in str(error)
    assert str(error).startswith("config.json: ")


def test_gemma3_vision_language_checkpoint_is_refused_with_a_hint() -> None:
    error = config_error({"model_type": "gemma3", "text_config": {}}, "unsupported architecture")
    assert "only the text models, model_type 'gemma3_text', run" in str(error)


def test_architecture_missing_entirely() -> None:
    raw = hf_dict("llama")
    del raw["model_type"]
    config_error(raw, re.escape("unsupported architecture (model_type=None, architectures=None)"))


def test_source_names_the_file() -> None:
    with pytest.raises(ModelConfigError, match=r"^/models/x/config\.json: unsupported architecture"):
        config_from_dict({"model_type": "gpt2"}, source="/models/x/config.json")


@pytest.mark.parametrize("rope_type", ["dynamic", "ntk"])
def test_unsupported_rope_type(rope_type: str) -> None:
    raw = hf_dict("llama")
    raw["rope_parameters"] = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 1e4}
    config_error(
        raw,
        re.escape(f"unsupported rope scaling type '{rope_type}' (supported: default, llama3, linear, longrope, yarn)"),
    )
    old = legacy(hf_dict("llama"), 1e4, scaling={"type": rope_type, "factor": 4.0})
    config_error(old, re.escape(f"unsupported rope scaling type '{rope_type}'"))


def test_a_qwen3_yarn_config_written_by_transformers_reads() -> None:
    hf = hf_config(
        "qwen3",
        head_dim=32,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
            "rope_theta": 1e6,
        },
    )
    config = config_from_dict(hf.to_dict())
    assert (config.rope.type, config.rope.factor, config.rope.original_max_position_embeddings) == ("yarn", 4.0, 32768)
    expected, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, device=None)
    torch.testing.assert_close(rope_inverse_frequencies(config.rope, 32), expected, rtol=1e-6, atol=0)
    assert config.rope.attention_factor == pytest.approx(attention_factor)


@pytest.mark.parametrize("key", ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"])
def test_llama3_rope_missing_key(key: str) -> None:
    params = {**LLAMA3_ROPE, "rope_theta": 5e5}
    del params[key]
    raw = {**hf_dict("llama"), "rope_parameters": params}
    config_error(raw, re.escape(f"rope scaling type 'llama3' needs '{key}'"))


def test_linear_rope_missing_factor() -> None:
    raw = {**hf_dict("llama"), "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}
    config_error(raw, re.escape("rope scaling type 'linear' needs 'factor'"))


@pytest.mark.parametrize("factor", ["8", None, 0, -2.0, True, [8]])
def test_rope_factor_must_be_a_positive_number(factor: Any) -> None:
    for params in (
        {"rope_type": "linear", "factor": factor, "rope_theta": 1e4},
        {**LLAMA3_ROPE, "factor": factor, "rope_theta": 1e4},
    ):
        raw = {**hf_dict("llama"), "rope_parameters": params}
        config_error(
            raw,
            re.escape(
                f"rope scaling type '{params['rope_type']}' field 'factor' must be a positive number, got {factor!r}"
            ),
        )


@pytest.mark.parametrize("key", ["low_freq_factor", "high_freq_factor"])
def test_llama3_freq_factors_must_be_positive_numbers(key: str) -> None:
    for bad in ("1", 0, -1.0):
        raw = {**hf_dict("llama"), "rope_parameters": {**LLAMA3_ROPE, key: bad, "rope_theta": 1e4}}
        config_error(raw, re.escape(f"field '{key}' must be a positive number, got {bad!r}"))


@pytest.mark.parametrize(("low", "high"), [(4.0, 4.0), (4.0, 1.0)])
def test_llama3_high_freq_factor_must_exceed_low(low: float, high: float) -> None:
    params = {**LLAMA3_ROPE, "low_freq_factor": low, "high_freq_factor": high, "rope_theta": 1e4}
    raw = {**hf_dict("llama"), "rope_parameters": params}
    config_error(
        raw,
        re.escape(f"'llama3' needs high_freq_factor > low_freq_factor, got {high!r} and {low!r}"),
    )


@pytest.mark.parametrize("value", [8192.5, "8192", -1, 0])
def test_llama3_original_max_positions_must_be_a_positive_int(value: Any) -> None:
    params = {**LLAMA3_ROPE, "original_max_position_embeddings": value, "rope_theta": 1e4}
    raw = {**hf_dict("llama"), "rope_parameters": params}
    with pytest.raises(ModelConfigError, match="original_max_position_embeddings") as info:
        config_from_dict(raw)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("theta", [-1.0, 0, "10000", True, None])
def test_bad_rope_theta(theta: Any) -> None:
    raw = {**hf_dict("llama"), "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    if theta is None:
        # an explicit null in rope_parameters is still a value, not a default
        config_error(raw, re.escape("field 'rope_theta' must be a positive number, got None"))
        return
    config_error(raw, re.escape(f"field 'rope_theta' must be a positive number, got {theta!r}"))
    config_error(legacy(hf_dict("llama"), theta), "field 'rope_theta' must be a positive number")


def test_rope_parameters_and_scaling_must_be_objects() -> None:
    config_error(
        {**hf_dict("llama"), "rope_parameters": [1, 2]},
        re.escape("field 'rope_parameters' must be an object, got [1, 2]"),
    )
    config_error(
        legacy(hf_dict("llama"), 1e4, scaling="llama3"),  # type: ignore[arg-type]
        re.escape("field 'rope_scaling' must be an object, got 'llama3'"),
    )


def test_heads_not_divisible_by_kv_heads() -> None:
    raw = hf_dict("llama", num_attention_heads=4, num_key_value_heads=3, head_dim=16)
    config_error(raw, re.escape("num_attention_heads=4 is not a multiple of num_key_value_heads=3"))
    config_error(
        {**hf_dict("llama"), "num_key_value_heads": 8},
        re.escape("num_attention_heads=4 is not a multiple of num_key_value_heads=8"),
    )


def test_hidden_not_divisible_by_heads_without_head_dim() -> None:
    raw = {**hf_dict("llama"), "hidden_size": 66}
    del raw["head_dim"]
    config_error(
        raw,
        re.escape("hidden_size=66 is not divisible by num_attention_heads=4 and no head_dim is given"),
    )


def test_odd_head_dim_is_rejected() -> None:
    config_error(
        {**hf_dict("llama"), "head_dim": 15},
        re.escape("head_dim=15 must be even for rotary embeddings"),
    )


@pytest.mark.parametrize(
    "field",
    [
        "hidden_size",
        "num_attention_heads",
        "vocab_size",
        "intermediate_size",
        "num_hidden_layers",
        "max_position_embeddings",
        "rms_norm_eps",
    ],
)
def test_missing_required_field(field: str) -> None:
    raw = hf_dict("llama")
    del raw[field]
    if field == "num_attention_heads":
        del raw["head_dim"]
    config_error(raw, re.escape(f"config.json: required field '{field}' is missing"))


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("hidden_size", "64", "int"),
        ("hidden_size", 64.0, "int"),
        ("hidden_size", True, "int"),
        ("vocab_size", None, "int"),
        ("num_hidden_layers", [2], "int"),
        ("head_dim", "16", "int"),
        ("num_key_value_heads", 2.0, "int"),
        ("rms_norm_eps", "1e-5", "float"),
        ("rms_norm_eps", False, "float"),
    ],
)
def test_wrong_type(field: str, value: Any, kind: str) -> None:
    raw = {**hf_dict("llama"), field: value}
    config_error(raw, re.escape(f"field '{field}' must be {kind}, got {value!r}"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", -64),
        ("vocab_size", 0),
        ("intermediate_size", -1),
        ("num_hidden_layers", 0),
        ("num_attention_heads", -4),
        ("num_key_value_heads", 0),
        ("head_dim", -16),
        ("max_position_embeddings", -1),
        ("rms_norm_eps", -1e-6),
        ("rms_norm_eps", 0.0),
    ],
)
def test_non_positive_values(field: str, value: float) -> None:
    raw = {**hf_dict("llama"), field: value}
    config_error(raw, re.escape(f"field '{field}' must be positive, got {value!r}"))


def test_qwen3_sliding_layers_from_transformers_layer_types() -> None:
    raw = hf_dict("qwen3", head_dim=32, use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert raw["layer_types"] == ["full_attention", "sliding_attention"]
    assert config_from_dict(raw).layer_windows == (0, 64)


def test_layer_types_without_the_flag_are_ignored_as_transformers_does() -> None:
    types_only = {**hf_dict("qwen3", head_dim=32), "layer_types": ["full_attention", "sliding_attention"]}
    assert config_from_dict(types_only).layer_windows == ()
    assert config_from_dict({**hf_dict("llama"), "use_sliding_window": True}).layer_windows == ()


def test_qwen3_default_layer_types_are_accepted() -> None:
    raw = hf_dict("qwen3", head_dim=32)
    assert set(raw["layer_types"]) == {"full_attention"}
    assert raw["use_sliding_window"] is False
    assert config_from_dict(raw).architecture == "qwen3"


def test_unsupported_activation_and_mlp_bias() -> None:
    config_error(
        {**hf_dict("llama"), "hidden_act": "gelu"},
        re.escape("unsupported hidden_act='gelu' (supported: silu, gelu_pytorch_tanh, gelu_tanh)"),
    )
    config_error({**hf_dict("llama"), "mlp_bias": True}, re.escape("unsupported mlp_bias=True"))


def test_attention_bias_is_carried() -> None:
    config = config_from_dict(hf_dict("llama", attention_bias=True))
    assert config.qkv_bias and config.o_bias


# --- from_model_dir file errors --------------------------------------------------------------


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=re.escape(f"{tmp_path / 'config.json'} does not exist")):
        config_from_model_dir(tmp_path)
    with pytest.raises(ModelConfigError, match="does not exist"):
        config_from_model_dir(tmp_path / "no-such-dir")


@pytest.mark.parametrize("content", [b"{not json", b"", b'{"model_type": "llama",}', b"\xff\xfe\x00garbage"])
def test_invalid_json_file(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ModelConfigError, match=re.escape(f"{tmp_path / 'config.json'} is not valid JSON: ")):
        config_from_model_dir(tmp_path)


def test_json_that_is_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ModelConfigError, match=re.escape("config.json must hold a JSON object")):
        config_from_model_dir(tmp_path)


def test_errors_from_a_dir_name_the_file(tmp_path: Path) -> None:
    raw = hf_dict("llama")
    raw["num_key_value_heads"] = 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError) as info:
        config_from_model_dir(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: num_attention_heads=4")


# --- rotary frequencies against transformers -------------------------------------------------


def _ours(hf: PretrainedConfig) -> torch.Tensor:
    config = config_from_dict(hf.to_dict())
    return rope_inverse_frequencies(config.rope, config.head_dim)


def test_default_rope_matches_transformers() -> None:
    hf = hf_config("llama", rope_theta=500_000.0)
    assert isinstance(hf, LlamaConfig)
    expected = LlamaRotaryEmbedding(hf).inv_freq
    ours = _ours(hf)
    assert ours.shape == (8,)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)


def test_llama3_rope_matches_transformers() -> None:
    hf = hf_config(
        "llama",
        max_position_embeddings=131072,
        rope_parameters={**LLAMA3_ROPE, "rope_theta": 500_000.0},
    )
    assert isinstance(hf, LlamaConfig)
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, device=None)
    assert attention_factor == 1.0
    ours = _ours(hf)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours, LlamaRotaryEmbedding(hf).inv_freq, rtol=1e-6, atol=0)
    # The check only means something if all three wavelength bands occur at this size.
    plain = rope_inverse_frequencies(RopeConfig(theta=500_000.0), 16)
    kept = torch.isclose(ours, plain)
    divided = torch.isclose(ours, plain / 8.0)
    assert kept.any()
    assert divided.any()
    assert (~kept & ~divided).any()


def test_llama3_rope_with_other_factors_matches_transformers() -> None:
    params = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 8.0,
        "original_max_position_embeddings": 1024,
        "rope_theta": 50_000.0,
    }
    hf = hf_config("qwen3", head_dim=32, max_position_embeddings=65536, rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, device=None)
    ours = _ours(hf)
    assert ours.shape == (16,)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)


def test_linear_rope_matches_transformers() -> None:
    hf = hf_config("llama", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    expected, _ = ROPE_INIT_FUNCTIONS["linear"](hf, device=None)
    ours = _ours(hf)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    plain = rope_inverse_frequencies(RopeConfig(theta=10000.0), 16)
    torch.testing.assert_close(ours, plain / 4.0)
    assert not torch.allclose(ours, plain)


def test_model_type_decides_over_the_class_list() -> None:
    raw = {**hf_dict(), "model_type": "mistral", "architectures": ["LlamaForCausalLM"]}
    assert config_from_dict(raw).architecture == "mistral"
    raw["model_type"] = "gpt2"
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        config_from_dict(raw)
    raw.pop("model_type")
    assert config_from_dict(raw).architecture == "llama"


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attention_bias"])
def test_flags_must_be_booleans(key: str) -> None:
    with pytest.raises(ModelConfigError, match=f"field '{key}' must be true or false, got 'false'"):
        config_from_dict({**hf_dict(), key: "false"})


# --- YaRN (gpt-oss) ---------------------------------------------------------------------------

YARN_CASES: dict[str, dict[str, Any]] = {
    # gpt-oss's own parameters (truncate false)
    "gpt-oss": {
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    # transformers' defaults: betas 32 and 1, truncate true, attention factor from the factor
    "defaults": {"factor": 4.0, "original_max_position_embeddings": 2048},
    "narrow-ramp": {"factor": 8.0, "beta_fast": 8.0, "beta_slow": 2.0, "original_max_position_embeddings": 1024},
    "explicit-attention-factor": {"factor": 16.0, "attention_factor": 1.25, "original_max_position_embeddings": 4096},
    "deepseek-mscale": {
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
    },
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
@pytest.mark.parametrize(("head_dim", "theta"), [(64, 150_000.0), (32, 10_000.0)])
def test_yarn_rope_matches_transformers(case: str, head_dim: int, theta: float) -> None:
    params = {"rope_type": "yarn", "rope_theta": theta, **YARN_CASES[case]}
    hf = hf_config("llama", head_dim=head_dim, max_position_embeddings=131072, rope_parameters=params)
    expected, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, device=None)
    config = config_from_dict(hf.to_dict())
    ours = rope_inverse_frequencies(config.rope, config.head_dim)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    assert config.rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    # Meaningful only where the ramp has pairs kept, pairs slowed and pairs between.
    plain = rope_inverse_frequencies(RopeConfig(theta=theta), head_dim)
    factor = YARN_CASES[case]["factor"]
    kept, slowed = torch.isclose(ours, plain), torch.isclose(ours, plain / factor)
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()


def test_yarn_scales_cos_and_sin() -> None:
    params = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0, "original_max_position_embeddings": 4096}
    hf = hf_config("llama", max_position_embeddings=32768, rope_parameters=params)
    expected, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, device=None)
    config = config_from_dict(hf.to_dict())
    assert config.rope.factor == 8.0
    torch.testing.assert_close(rope_inverse_frequencies(config.rope, 16), expected, rtol=1e-6, atol=0)
    cos, sin = RotaryEmbedding(config.rope, 16)(torch.tensor([0, 5]), torch.float32)
    assert attention_factor > 1.0
    torch.testing.assert_close(cos[0], torch.full((16,), attention_factor))  # position 0: cos 1, scaled
    torch.testing.assert_close(cos[1] ** 2 + sin[1] ** 2, torch.full((16,), attention_factor**2))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"factor": 4.0}, "rope scaling type 'yarn' needs a positive int 'original_max_position_embeddings'"),
        ({"original_max_position_embeddings": 4096}, "rope scaling type 'yarn' needs 'factor'"),
        ({"factor": -1.0, "original_max_position_embeddings": 4096}, "'yarn' field 'factor' must be a positive"),
        (
            {"factor": 4.0, "beta_fast": 0, "original_max_position_embeddings": 4096},
            "field 'beta_fast' must be a positive",
        ),
        (
            {"factor": 4.0, "truncate": "no", "original_max_position_embeddings": 4096},
            "'truncate' must be true or false",
        ),
    ],
)
def test_yarn_refuses_bad_fields(params: dict[str, Any], message: str) -> None:
    raw = hf_dict("llama")
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, **params}
    config_error(raw, message)
