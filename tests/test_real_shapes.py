"""perf/real_shapes.py: the shapes are the published models' (parameter counts, the engine's reading
of each config), a directory is written whole and then skipped, and a missing tokenizer is a clear
error."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

PERF = Path(__file__).resolve().parent.parent / "perf"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("real_shapes", PERF / "real_shapes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


real_shapes = _load()

# The published totals: Llama-3.2-1B 1.24B; Qwen3-1.7B 1.7B (1.4B without the embedding);
# Qwen3-4B 4.0B (3.6B without it). Tied heads add nothing.
PARAMETERS = {"llama-3.2-1b": 1_235_814_400, "qwen3-1.7b": 1_720_574_976, "qwen3-4b": 4_022_468_096}


def _config(name: str) -> Any:
    from transformers import AutoConfig

    model_type, fields = real_shapes.SHAPES[name]
    return AutoConfig.for_model(model_type, **fields)


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_each_shape_has_the_published_parameter_count(name: str) -> None:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(name))
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_the_engine_reads_each_config_with_its_real_sizes(name: str) -> None:
    from compiled_engine.model.registry import config_from_dict

    raw = _config(name).to_dict()
    config = config_from_dict(raw)
    _, fields = real_shapes.SHAPES[name]
    assert config.vocab_size == fields["vocab_size"]
    assert config.hidden_size == fields["hidden_size"]
    assert config.intermediate_size == fields["intermediate_size"]
    assert config.num_layers == fields["num_hidden_layers"]
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        fields["num_attention_heads"],
        fields["num_key_value_heads"],
        fields["head_dim"],
    )
    assert config.tie_word_embeddings
    assert config.rope.type == fields["rope_parameters"]["rope_type"]
    assert config.rope.theta == fields["rope_parameters"]["rope_theta"]


TINY = (
    "llama",
    dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
)


def test_a_directory_is_written_whole_then_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    (tokenizer / "tokenizer_config.json").write_text("{}")
    monkeypatch.setitem(real_shapes.SHAPES, "tiny", TINY)
    monkeypatch.setattr(real_shapes, "default_tokenizer_dir", lambda: tokenizer)
    out = tmp_path / "models"
    monkeypatch.setattr(sys, "argv", ["real_shapes.py", str(out), "--only", "tiny"])
    real_shapes.main()
    written = out / "tiny"
    assert real_shapes.is_complete(written)
    assert not (out / "tiny.partial").exists()
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in written.iterdir()
    }
    config = json.loads((written / "config.json").read_text())
    assert config["vocab_size"] == 300 and config["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(written / "model.safetensors"), "pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
    assert embedding.dtype == torch.bfloat16 and embedding.shape == (300, 64)
    assert 0.01 < embedding.float().std().item() < 0.03  # the small init: activations stay finite

    stamp = (written / "model.safetensors").stat().st_mtime_ns
    real_shapes.main()
    assert "already complete, skipped" in capsys.readouterr().out
    assert (written / "model.safetensors").stat().st_mtime_ns == stamp


def test_an_unfinished_directory_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(real_shapes.SHAPES, "tiny", TINY)
    out = tmp_path / "models"
    (out / "tiny").mkdir(parents=True)
    (out / "tiny" / "config.json").write_text("{}")  # left by an interrupted run: no complete.json
    real_shapes.write_random_model("tiny", out / "tiny", tokenizer)
    assert real_shapes.is_complete(out / "tiny")
    assert json.loads((out / "tiny" / "config.json").read_text())["hidden_size"] == 64


def test_a_missing_tokenizer_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import compiled_engine.weights.default_model as default_model

    monkeypatch.setattr(default_model, "default_model_dir", lambda: tmp_path / "absent")
    with pytest.raises(SystemExit, match="compiled_engine prepare"):
        real_shapes.default_tokenizer_dir()
