"""Where the engine keeps what it builds once and reuses: prepared models, compiled kernels,
Inductor's caches and saved traces, all under one root (`$COMPILED_ENGINE_CACHE`, default
`~/.cache/compiled_engine`)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "COMPILED_ENGINE_CACHE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "compiled_engine"))


def models_dir() -> Path:
    """Prepared model directories (the embedded default model)."""
    return cache_root() / "models"


def kernels_dir() -> Path:
    """Native kernels built with the machine's compiler."""
    return cache_root() / "kernels"


def inductor_dir() -> Path:
    """Inductor's FX-graph and AOTAutograd caches."""
    return cache_root() / "inductor"


def compiled_dir() -> Path:
    """The compiled model's saved traces (engine/precompiled.py), one directory per model."""
    return cache_root() / "compiled"
