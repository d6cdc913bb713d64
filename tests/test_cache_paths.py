"""The engine's cache locations, and the tests' isolation from the user's cache (conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compiled_engine.cache_paths import (
    CACHE_ENV,
    INDUCTOR_CACHE_ENV,
    MODELS_ENV,
    CacheLayout,
    cache_layout,
    compiled_dir,
    inductor_dir,
    kernels_dir,
    models_dir,
)
from tests.cache_isolation import Snapshot
from tests.conftest import TEST_CACHE, USER_CACHE


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


def test_the_session_builds_in_its_own_cache_and_reads_the_users_models() -> None:
    assert cache_layout() == TEST_CACHE
    assert TEST_CACHE.root != USER_CACHE.root and TEST_CACHE.models == USER_CACHE.models
    assert os.environ[INDUCTOR_CACHE_ENV] == str(TEST_CACHE.inductor)
    show = (
        "import json, os; from compiled_engine.cache_paths import cache_layout as c; "
        f"print(json.dumps([str(c().root), str(c().models), os.environ[{INDUCTOR_CACHE_ENV!r}]]))"
    )
    child = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, check=True)
    assert json.loads(child.stdout) == [str(TEST_CACHE.root), str(TEST_CACHE.models), str(TEST_CACHE.inductor)]


def test_a_snapshot_sees_what_was_created_modified_or_deleted(tmp_path: Path) -> None:
    layout = CacheLayout(root=tmp_path / "cache", models=tmp_path / "models")  # models outside the root
    for path in (layout.kernels / "a.so", layout.kernels / "b.so", layout.models / "m" / "config.json"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    before = Snapshot.take(layout)
    assert before.roots == (layout.root, layout.models)
    assert before.changes(Snapshot.take(layout)) == []
    (layout.kernels / "a.so").write_text("xy")
    (layout.kernels / "b.so").unlink()
    (layout.models / "m" / "new.json").write_text("{}")
    changes = set(before.changes(Snapshot.take(layout)))
    files = {
        f"created  {layout.models / 'm' / 'new.json'}",
        f"deleted  {layout.kernels / 'b.so'}",
        f"modified {layout.kernels / 'a.so'}",
    }
    # their folders too, unless this happened within the clock tick of the first snapshot
    assert files <= changes <= files | {f"modified {layout.kernels}", f"modified {layout.models / 'm'}"}
    assert Snapshot.take(CacheLayout(root=tmp_path / "cache", models=tmp_path / "cache" / "models")).roots == (
        tmp_path / "cache",
    )
