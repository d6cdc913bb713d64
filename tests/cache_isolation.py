"""The tests' own engine cache, and the check that they leave the user's alone.

`isolate` (called by conftest.py when pytest imports it, before any test module) points the
engine's cache root and Inductor's cache at a new temporary directory, through the environment,
so the compile-and-save paths run cold in every session and the servers and command-line
processes the tests start build there too. The native kernels the user's cache already holds are
copied in (read, never written): `make test` builds them with `prepare` just before, and the
tests of building a kernel use caches of their own. The models directory stays the user's: the
prepared default model is read from it, never written (tests that prepare models use
`private_cache`).
`Snapshot` records every path under the user's cache (kind, size, modification time) so the
session can end by comparing it with what is there then.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from compiled_engine.cache_paths import INDUCTOR_CACHE_ENV, CacheLayout


def isolate() -> tuple[CacheLayout, CacheLayout]:
    """(the user's layout, the tests' layout), the environment now giving the tests' one."""
    user = CacheLayout.from_env()
    tests = CacheLayout(root=Path(tempfile.mkdtemp(prefix="compiled_engine-tests-")), models=user.models)
    os.environ.update(tests.environment())
    # Also covers a TORCHINDUCTOR_CACHE_DIR the user set, and torch.compile outside an engine.
    os.environ[INDUCTOR_CACHE_ENV] = str(tests.inductor)
    if user.kernels.is_dir():
        tests.kernels.mkdir(parents=True)
        for built in user.kernels.glob("*.so"):
            shutil.copy2(built, tests.kernels / built.name)
    return user, tests


Entry = tuple[str, int, int]  # kind, size, modification time in ns


@dataclass(frozen=True)
class Snapshot:
    """Every path under some directories (links not followed), with what a write changes."""

    roots: tuple[Path, ...]
    entries: dict[Path, Entry]

    @classmethod
    def take(cls, layout: CacheLayout) -> Snapshot:
        inside = layout.models.is_relative_to(layout.root)
        roots = (layout.root,) if inside else (layout.root, layout.models)
        entries: dict[Path, Entry] = {}
        for root in roots:
            if not os.path.lexists(root):
                continue
            entries[root] = _entry(root)
            for folder, dirs, files in os.walk(root):
                for name in dirs + files:
                    path = Path(folder, name)
                    with contextlib.suppress(FileNotFoundError):  # removed while we walked: absent
                        entries[path] = _entry(path)
        return cls(roots, entries)

    def changes(self, later: Snapshot) -> list[str]:
        """What differs in `later`, one line a path: created, modified or deleted."""
        lines = [f"created  {p}" for p in sorted(later.entries.keys() - self.entries.keys())]
        lines += [f"deleted  {p}" for p in sorted(self.entries.keys() - later.entries.keys())]
        lines += [
            f"modified {p}"
            for p in sorted(self.entries.keys() & later.entries.keys())
            if self.entries[p] != later.entries[p]
        ]
        return lines


def _entry(path: Path) -> Entry:
    info = os.lstat(path)
    kind = "dir" if stat.S_ISDIR(info.st_mode) else "link" if stat.S_ISLNK(info.st_mode) else "file"
    return kind, info.st_size, info.st_mtime_ns
