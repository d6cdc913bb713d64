"""NVTX ranges around the phases of an engine step, for Nsight Systems (`perf/nsys_profile.sh`).

Off unless `COMPILED_ENGINE_NVTX=1` and CUDA is present, so the hot path pays one branch.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

import torch

NVTX_ENV = "COMPILED_ENGINE_NVTX"


def nvtx_enabled() -> bool:
    return os.environ.get(NVTX_ENV) == "1" and torch.cuda.is_available()


_ENABLED = nvtx_enabled()


def nvtx_range(name: str) -> AbstractContextManager[object]:
    """A named NVTX range when profiling is on, otherwise a context that does nothing."""
    if _ENABLED:
        return torch.cuda.nvtx.range(name)
    return nullcontext()
