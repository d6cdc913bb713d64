"""The frame-stack arena cache (engine/frame_arena.py): Python's frame-stack chunks come back
from it instead of from mmap, the model runner installs it, and a failed build leaves Python's own
allocator with a warning."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from compiled_engine.engine import frame_arena
from compiled_engine.engine.frame_arena import (
    FrameArenaCounts,
    frame_arena_counts,
    install_frame_arena,
    set_frame_arena_enabled,
)


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


def test_the_model_runner_installs_it(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("llama")
    script = textwrap.dedent(
        f"""
        from pathlib import Path

        from compiled_engine.config import EngineConfig
        from compiled_engine.engine.frame_arena import frame_arena_counts
        from compiled_engine.engine.model_runner import ModelRunner

        assert frame_arena_counts() is None
        ModelRunner(Path({str(model_dir)!r}), EngineConfig(page_size=4, num_pages=16, enforce_eager=True, device="cpu"))
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
