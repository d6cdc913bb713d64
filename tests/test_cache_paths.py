"""The engine's cache locations."""

from __future__ import annotations

from pathlib import Path

import pytest

from compiled_engine.cache_paths import (
    CACHE_ENV,
    MODELS_ENV,
    CacheLayout,
    compiled_dir,
    inductor_dir,
    kernels_dir,
    models_dir,
)


def test_the_layout_from_the_variables(tmp_path: Path) -> None:
    home = Path.home() / ".cache" / "compiled_engine"
    assert CacheLayout.from_env({}) == CacheLayout(root=home, models=home / "models")
    assert CacheLayout.from_env({CACHE_ENV: "", MODELS_ENV: ""}) == CacheLayout.from_env({})  # empty is unset
    root = CacheLayout.from_env({CACHE_ENV: str(tmp_path)})
    assert root == CacheLayout(root=tmp_path, models=tmp_path / "models")
    assert (root.kernels, root.inductor, root.compiled) == (
        tmp_path / "kernels",
        tmp_path / "inductor",
        tmp_path / "compiled",
    )
    both = CacheLayout.from_env({CACHE_ENV: str(tmp_path / "built"), MODELS_ENV: str(tmp_path / "prepared")})
    assert both == CacheLayout(root=tmp_path / "built", models=tmp_path / "prepared")
    assert CacheLayout.from_env(both.environment()) == both


def test_each_kind_of_artefact_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "built"))
    monkeypatch.setenv(MODELS_ENV, str(tmp_path / "prepared"))
    assert models_dir() == tmp_path / "prepared"
    assert (kernels_dir(), inductor_dir(), compiled_dir()) == tuple(
        tmp_path / "built" / kind for kind in ("kernels", "inductor", "compiled")
    )
