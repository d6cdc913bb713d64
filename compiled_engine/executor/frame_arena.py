"""A cache in front of CPython's arena allocator (`kernels/frame_arena.c`), so that the
interpreter's frame stack does not map and unmap a 16 KiB chunk whenever a hot loop's calls cross
a chunk's edge. At an unlucky stack depth a decode step of the compiled model crosses one per
layer, or several (docs/benchmarks.md, "Python's frame stack"). Installed once per process by the
model runner; when it cannot be built, a warning says so and Python's own allocator stays.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from compiled_engine.native_build import KernelBuildError, NativeLibrary

__all__ = ["LIBRARY", "FrameArenaCounts", "frame_arena_counts", "install_frame_arena", "set_frame_arena_enabled"]

logger = logging.getLogger(__name__)

LIBRARY = NativeLibrary(
    Path(__file__).with_name("kernels") / "frame_arena.c",
    "frame-stack arena cache",
    include_dirs=(sysconfig.get_paths()["include"],),
)


@dataclass(frozen=True)
class FrameArenaCounts:
    """Small arena requests since the cache was installed: served from it, or passed on to
    Python's allocator (mmap)."""

    reused: int
    passed: int


@cache
def _library() -> ctypes.PyDLL | None:
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        logger.info("the frame-stack arena cache needs the GIL; not installed in this free-threaded Python")
        return None
    try:
        # PyDLL: the calls keep the GIL, which the allocator swap and the counters need.
        library = ctypes.PyDLL(str(LIBRARY.path()))
    except (KernelBuildError, OSError) as error:
        logger.warning("Python's frame stack keeps its own allocator (slower at some call depths), because %s", error)
        return None
    library.frame_arena_install.restype = None
    library.frame_arena_installed.restype = ctypes.c_int
    library.frame_arena_enable.restype = None
    library.frame_arena_reused.restype = ctypes.c_longlong
    library.frame_arena_passed.restype = ctypes.c_longlong
    return library


def install_frame_arena() -> bool:
    """Put the cache in front of Python's arena allocator, once per process (building it once
    per machine). False, with one warning, when it cannot be built or loaded."""
    library = _library()
    if library is None:
        return False
    library.frame_arena_install()
    return True


def frame_arena_counts() -> FrameArenaCounts | None:
    """The cache's counters, or None when it is not installed in this process."""
    library = _library()
    if library is None or not library.frame_arena_installed():
        return None
    return FrameArenaCounts(library.frame_arena_reused(), library.frame_arena_passed())


def set_frame_arena_enabled(enabled: bool) -> None:
    """Turn the installed cache off (its blocks are returned, and every request goes to Python's
    allocator) or on again: for measurements and tests that compare the two in one process."""
    library = _library()
    if library is None or not library.frame_arena_installed():
        raise RuntimeError("the frame-stack arena cache is not installed in this process")
    library.frame_arena_enable(int(enabled))
