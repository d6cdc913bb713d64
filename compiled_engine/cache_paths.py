"""Where the engine keeps what it prepares or builds once and reuses.

Two locations, each set by its own variable:
- the cache root, `$COMPILED_ENGINE_CACHE` (default `~/.cache/compiled_engine`): what the engine
  builds on this machine, native kernels (`kernels/`), Inductor's caches (`inductor/`) and the
  compiled model's saved traces (`compiled/`);
- the models directory, `$COMPILED_ENGINE_MODELS` (default `models/` under the cache root): the
  prepared default model and the directories made for users' `.gguf` files.
They are separate so that one can move without the other: the tests build everything in a
temporary root while reading the prepared default model from the user's models directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "COMPILED_ENGINE_CACHE"
MODELS_ENV = "COMPILED_ENGINE_MODELS"
# Inductor's own choice of cache directory; the engine sets it to `CacheLayout.inductor` unless the
# user already did (executor/compilation.py).
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "compiled_engine"


@dataclass(frozen=True)
class CacheLayout:
    """The engine's cache locations: `root` for what it builds, `models` for prepared models."""

    root: Path
    models: Path

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CacheLayout:
        """The layout the variables give (an empty variable counts as unset)."""
        env = os.environ if environ is None else environ
        root = Path(env.get(CACHE_ENV) or default_cache_root())
        models = env.get(MODELS_ENV)
        return cls(root=root, models=Path(models) if models else root / "models")

    @property
    def kernels(self) -> Path:
        """Native kernels built with the machine's compiler."""
        return self.root / "kernels"

    @property
    def inductor(self) -> Path:
        """Inductor's FX-graph and AOTAutograd caches."""
        return self.root / "inductor"

    @property
    def compiled(self) -> Path:
        """The compiled model's saved traces (executor/precompiled.py), one directory per model."""
        return self.root / "compiled"

    def environment(self) -> dict[str, str]:
        """The variables that give this layout to the engine, and to the processes it starts."""
        return {CACHE_ENV: str(self.root), MODELS_ENV: str(self.models)}


def cache_layout() -> CacheLayout:
    """The layout of the current environment (read at each call, so a changed variable counts)."""
    return CacheLayout.from_env()


def models_dir() -> Path:
    """Prepared model directories (the embedded default model, users' `.gguf` files)."""
    return cache_layout().models


def kernels_dir() -> Path:
    return cache_layout().kernels


def inductor_dir() -> Path:
    return cache_layout().inductor


def compiled_dir() -> Path:
    return cache_layout().compiled
