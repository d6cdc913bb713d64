"""resolve_model_dir: the embedded default, local directories, bad names, and Hub ids, the last
resolved only from a fake offline Hugging Face cache with every socket call refused."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)

from compiled_engine.errors import ModelSourceError
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.weights.default_model import (
    DEFAULT_MODEL_NAME,
    MANIFEST,
    MANIFEST_VERSION,
    default_model_dir,
)
from compiled_engine.weights.source import HUB_FILE_PATTERNS, resolve_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
Factory = Callable[..., Path]


@pytest.fixture
def network_attempts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Refuse and record every attempt to resolve a host or open a connection."""
    attempts: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        attempts.append(repr(args)[:200])
        raise OSError("network access attempted in a test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, network_attempts: list[str]) -> Path:
    """An empty Hugging Face cache, offline mode on (env and the constants read at import)."""
    home = tmp_path / "hf-home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # so no relative name happens to be a local directory
    assert hub_constants.is_offline_mode()
    return cache


def cache_repo(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT) -> Path:
    """Lay out `files` as huggingface_hub does: blobs by hash, snapshot symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture
def forbid_download(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace snapshot_download with one that records calls and fails the test if reached."""
    calls: list[str] = []

    def fake(repo_id: str, **kwargs: Any) -> str:
        calls.append(repo_id)
        raise AssertionError(f"snapshot_download({repo_id!r}) should not be called")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return calls


# --- the embedded default --------------------------------------------------------------------


def test_default_model_not_prepared(private_cache: Path) -> None:
    manifest = private_cache / "models" / DEFAULT_MODEL_NAME / MANIFEST
    with pytest.raises(ModelSourceError) as info:
        resolve_model_dir(None)
    assert str(info.value) == (
        f"the default model is not prepared ({manifest} is missing (incomplete or interrupted "
        "build)); run `python -m compiled_engine prepare`"
    )


def _prepare_fake_default(root: Path) -> Path:
    model_dir = root / "models" / DEFAULT_MODEL_NAME
    model_dir.mkdir(parents=True)
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"weights"}
    for name, data in files.items():
        (model_dir / name).write_bytes(data)
    manifest = {
        "version": MANIFEST_VERSION,
        "model": DEFAULT_MODEL_NAME,
        "files": {
            name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)} for name, data in files.items()
        },
    }
    (model_dir / MANIFEST).write_text(json.dumps(manifest))
    return model_dir


def test_default_model_prepared(private_cache: Path) -> None:
    model_dir = _prepare_fake_default(private_cache)
    assert resolve_model_dir(None) == model_dir == default_model_dir()


def test_default_model_with_a_changed_file(private_cache: Path) -> None:
    model_dir = _prepare_fake_default(private_cache)
    (model_dir / "model.safetensors").write_bytes(b"truncat")  # same size: only prepare's hash check sees it
    assert resolve_model_dir(None) == model_dir
    (model_dir / "model.safetensors").write_bytes(b"trunc")
    with pytest.raises(
        ModelSourceError,
        match=re.escape(f"{model_dir / 'model.safetensors'} has 5 bytes, its manifest says 7"),
    ):
        resolve_model_dir(None)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="listed in the manifest is missing"):
        resolve_model_dir(None)


@pytest.mark.parametrize(
    ("manifest", "problem"),
    [
        ("{broken", "is unreadable"),
        ('{"files": {}}', "is unreadable"),
        ('{"version": 99, "files": {}}', f"has version 99, expected {MANIFEST_VERSION}"),
    ],
)
def test_default_model_with_a_bad_manifest(private_cache: Path, manifest: str, problem: str) -> None:
    model_dir = _prepare_fake_default(private_cache)
    (model_dir / MANIFEST).write_text(manifest)
    with pytest.raises(ModelSourceError, match=f"the default model is not prepared .*{problem}"):
        resolve_model_dir(None)


# --- local paths and bad names ---------------------------------------------------------------


def test_local_directory_absolute(tmp_path: Path, forbid_download: list[str]) -> None:
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    assert forbid_download == []


def test_local_directory_relative_even_if_it_looks_like_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forbid_download: list[str]
) -> None:
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("owner/name") == Path("owner/name")
    assert resolve_model_dir("owner/name").resolve() == (tmp_path / "owner" / "name").resolve()
    assert forbid_download == []


def test_home_directory_is_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forbid_download: list[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "my-model").mkdir()
    assert resolve_model_dir("~/my-model") == tmp_path / "my-model"


def test_tiny_model_dir_resolves_and_parses(tiny_model_factory: Factory) -> None:
    model_dir = tiny_model_factory("llama")
    resolved = resolve_model_dir(str(model_dir))
    assert config_from_model_dir(resolved).architecture == "llama"


def test_file_is_not_a_model_dir(tmp_path: Path, forbid_download: list[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text("{}")
    with pytest.raises(ModelSourceError) as info:
        resolve_model_dir(str(config))
    assert str(info.value) == f"--model {str(config)!r} is a file; pass the model directory or a .gguf file"
    assert forbid_download == []


def test_file_that_looks_like_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forbid_download: list[str]
) -> None:
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "name").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match=re.escape("--model 'owner/name' is a file")):
        resolve_model_dir("owner/name")
    assert forbid_download == []


@pytest.mark.parametrize(
    "name",
    [
        "not a model",
        "just-a-name",
        "a/b/c",
        "../nowhere/x",
        "./owner/name",
        "~/nowhere",
        "-owner/name",
        "owner/",
        "/owner/name",
        "owner/na me",
        "   ",
    ],
)
def test_garbage_name(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forbid_download: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(ModelSourceError) as info:
        resolve_model_dir(name)
    assert str(info.value) == (f"--model {name!r} is neither a local directory nor a Hub id (owner/name)")
    assert forbid_download == []


def test_empty_name_is_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forbid_download: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match=re.escape("--model is empty")):
        resolve_model_dir("")
    assert forbid_download == []


@pytest.mark.parametrize("name", ["owner/name--x", "owner/name.", "owner/..", "owner/" + "b" * 100])
def test_name_the_hub_would_reject(name: str, hub_cache: Path, network_attempts: list[str]) -> None:
    with pytest.raises(ModelSourceError) as info:
        resolve_model_dir(name)
    assert str(info.value).startswith(f"--model {name!r} is neither a local directory nor a valid Hub id: ")
    assert network_attempts == []


# --- Hub ids, offline ------------------------------------------------------------------------


def test_hub_id_resolves_from_offline_cache(
    hub_cache: Path, network_attempts: list[str], tiny_model_factory: Factory
) -> None:
    source = tiny_model_factory("qwen3")
    files = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    snapshot = cache_repo(hub_cache, "owner/tiny-qwen3", files)
    resolved = resolve_model_dir("owner/tiny-qwen3")
    assert resolved.resolve() == snapshot.resolve()
    assert resolved.parent.name == "snapshots"
    assert resolved.name == COMMIT
    assert (resolved / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert config_from_model_dir(resolved).architecture == "qwen3"
    assert network_attempts == []


def test_hub_id_picks_the_commit_refs_main_names(hub_cache: Path, network_attempts: list[str]) -> None:
    snapshot = cache_repo(hub_cache, "owner/name", {"config.json": b"{}"})
    other = snapshot.parent / ("f" * 40)
    other.mkdir()
    assert resolve_model_dir("owner/name").resolve() == snapshot.resolve()
    (snapshot.parent.parent / "refs" / "main").write_text("f" * 40)
    assert resolve_model_dir("owner/name").resolve() == other.resolve()
    assert network_attempts == []


def test_hub_id_absent_from_offline_cache(hub_cache: Path, network_attempts: list[str]) -> None:
    cache_repo(hub_cache, "owner/other", {"config.json": b"{}"})
    with pytest.raises(ModelSourceError) as info:
        resolve_model_dir("owner/absent")
    message = str(info.value)
    assert message == (
        "model 'owner/absent' is not in the local Hugging Face cache and the Hub cannot be "
        "reached (no network, or HF_HUB_OFFLINE=1); download it on a connected machine or "
        "pass a local directory"
    )
    cause = info.value.__cause__
    assert isinstance(cause, LocalEntryNotFoundError)
    # offline mode really was in force: huggingface_hub refused before opening any socket
    assert isinstance(cause.__cause__, OfflineModeIsEnabled)
    assert network_attempts == []


def test_hub_ref_without_its_snapshot(hub_cache: Path, network_attempts: list[str]) -> None:
    snapshot = cache_repo(hub_cache, "owner/name", {"config.json": b"{}"})
    shutil.rmtree(snapshot)
    with pytest.raises(ModelSourceError, match=re.escape("HF_HUB_OFFLINE=1")):
        resolve_model_dir("owner/name")
    assert network_attempts == []


# --- Hub error mapping (snapshot_download replaced; nothing leaves the process) ---------------


def _http_error(kind: type[RepositoryNotFoundError], message: str) -> RepositoryNotFoundError:
    # The constructor wants the HTTP client's response object, whose class depends on the
    # huggingface_hub version; the message is all resolve_model_dir reads.
    error = kind.__new__(kind)
    Exception.__init__(error, message)
    return error


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            _http_error(RepositoryNotFoundError, "404 error for owner/name"),
            "the Hub has no accessible model 'owner/name': 404 error for owner/name",
        ),
        (
            _http_error(GatedRepoError, "403 error for owner/name"),
            "the Hub has no accessible model 'owner/name': 403 error for owner/name",
        ),
        (
            ConnectionError("connection refused"),
            "could not download 'owner/name' from the Hugging Face Hub (network error: connection refused)",
        ),
        (
            LocalEntryNotFoundError("nothing cached"),
            "model 'owner/name' is not in the local Hugging Face cache and the Hub cannot be reached",
        ),
    ],
    ids=["not-found", "gated", "connection", "not-cached"],
)
def test_hub_errors_become_model_source_errors(
    error: Exception,
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    network_attempts: list[str],
) -> None:
    calls: list[tuple[str, Any]] = []

    def fake(repo_id: str, **kwargs: Any) -> str:
        calls.append((repo_id, kwargs))
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError) as info:
        resolve_model_dir("owner/name")
    assert str(info.value).startswith(expected)
    assert info.value.__cause__ is error
    assert calls == [("owner/name", {"allow_patterns": HUB_FILE_PATTERNS})]
    assert network_attempts == []


def test_hub_download_returns_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **_: str(tmp_path))
    monkeypatch.chdir(tmp_path)
    resolved = resolve_model_dir("owner/name")
    assert isinstance(resolved, Path)
    assert resolved == tmp_path


def test_hub_patterns_fetch_what_the_engine_reads() -> None:
    from huggingface_hub.utils import filter_repo_objects

    repo_files = [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "chat_template.jinja",
        "pytorch_model.bin",
        "original/consolidated.00.pth",
        "README.md",
        "model.gguf",
    ]
    kept = set(filter_repo_objects(repo_files, allow_patterns=HUB_FILE_PATTERNS))
    assert kept == set(repo_files[:9])
