"""The frame-stack arena cache (executor/frame_arena.py): Python's frame-stack chunks come back
from it instead of from mmap, the model runner installs it, and a failed build leaves Python's own
allocator with a warning (where Python's C headers are not installed, the engine runs so, and the
tests of the cache skip)."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from compiled_engine.executor import frame_arena
from compiled_engine.executor.frame_arena import (
    FrameArenaCounts,
    frame_arena_counts,
    install_frame_arena,
    set_frame_arena_enabled,
)
from compiled_engine.native_build import KernelBuildError

# A header the compiler did not find, as GCC and Clang say it.
MISSING_HEADER = re.compile(r"([\w./+-]+\.h)'?:? (?:No such file or directory|file not found)")


def skip_without_pythons_headers() -> None:
    """Skip the test where the cache cannot be built for want of Python's C headers (no Python.h
    among its include directories, or a header it includes missing), as on a Python installed
    without its development files: the engine runs there with Python's allocator and a warning,
    which test_a_failing_build_keeps_pythons_allocator covers. Any other build failure fails."""
    library = frame_arena.LIBRARY
    if not any((Path(d) / "Python.h").is_file() for d in library.include_dirs):
        pytest.skip(
            f"Python's C headers are not installed (no Python.h in {', '.join(library.include_dirs)}): "
            "the engine runs without the frame-stack arena cache"
        )
    try:
        library.path()
    except KernelBuildError as error:
        missing = MISSING_HEADER.search(str(error))
        if missing is None:
            raise
        pytest.skip(f"Python's C headers are incomplete ({missing.group(1)} not found): {error}")


@pytest.fixture
def arena_builds() -> None:
    skip_without_pythons_headers()


def _recurse(depth: int) -> int:
    return 0 if depth == 0 else _recurse(depth - 1) + 1


def _chunks_taken(calls: int) -> FrameArenaCounts:
    """What `calls` recursions of 400 frames took from the arena allocator: each opens at least
    one new 16 KiB frame-stack chunk and closes it on the way back."""
    before = frame_arena_counts()
    for _ in range(calls):
        assert _recurse(400) == 400
    after = frame_arena_counts()
    assert before is not None and after is not None
    return FrameArenaCounts(after.reused - before.reused, after.passed - before.passed)


@pytest.mark.usefixtures("arena_builds")
def test_frame_stack_chunks_are_reused_not_mapped_again() -> None:
    assert install_frame_arena()
    try:
        set_frame_arena_enabled(False)  # the slow twin: Python's own allocator maps every chunk
        plain = _chunks_taken(300)
        assert plain.reused == 0 and plain.passed >= 300
        set_frame_arena_enabled(True)
        cached = _chunks_taken(300)
        assert cached.reused >= 300
        assert cached.passed <= 16  # at most the cache's size, taken once
    finally:
        set_frame_arena_enabled(True)


@pytest.mark.usefixtures("arena_builds")
def test_the_model_runner_installs_it(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("llama")
    script = textwrap.dedent(
        f"""
        from pathlib import Path

        from compiled_engine.config import EngineConfig
        from compiled_engine.executor.frame_arena import frame_arena_counts
        from compiled_engine.executor.runner import Runner

        assert frame_arena_counts() is None
        Runner(Path({str(model_dir)!r}), EngineConfig(page_size=4, num_pages=16, enforce_eager=True, device="cpu"))
        print(frame_arena_counts() is not None)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


def test_a_failing_build_keeps_pythons_allocator(
    private_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    frame_arena._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert not install_frame_arena()
            assert frame_arena_counts() is None
        assert "frame stack keeps its own allocator" in caplog.text and "no-such-compiler" in caplog.text
        assert _recurse(400) == 400  # Python runs on as before
    finally:
        frame_arena._library.cache_clear()


def test_missing_headers_skip_the_tests_of_the_cache_and_other_build_failures_fail(
    private_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    include = tmp_path / "include"
    include.mkdir()
    monkeypatch.setattr(frame_arena, "LIBRARY", dataclasses.replace(frame_arena.LIBRARY, include_dirs=(str(include),)))
    with pytest.raises(pytest.skip.Exception, match=r"Python's C headers are not installed \(no Python\.h in"):
        skip_without_pythons_headers()
    # Python.h there, but not the configuration header it includes (a partial install)
    (include / "Python.h").write_text('#include "pyconfig.h"\n')
    with pytest.raises(pytest.skip.Exception, match=r"incomplete \(pyconfig\.h not found\)"):
        skip_without_pythons_headers()
    # the real headers, and a source that does not compile: not a reason to skip
    broken = tmp_path / "frame_arena.c"
    broken.write_text("#include <Python.h>\nint broken(void) { return undeclared; }\n")
    real = dataclasses.replace(frame_arena.LIBRARY, source=broken, include_dirs=(sysconfig.get_paths()["include"],))
    monkeypatch.setattr(frame_arena, "LIBRARY", real)
    if (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        with pytest.raises(KernelBuildError, match="undeclared"):
            skip_without_pythons_headers()
