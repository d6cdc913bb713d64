"""Stand-ins for torch.cuda's graph API, so the CUDA-graph runner's protocol (what runs before,
inside and after a capture) can be checked on the CPU."""

from __future__ import annotations

import pytest
import torch


class RecordingGraph:
    """Stands in for torch.cuda.CUDAGraph: counts replays; `capturing` is true inside a capture."""

    capturing = False

    def __init__(self) -> None:
        self.replays = 0

    def pool(self) -> tuple[int, int]:
        return (0, 0)

    def replay(self) -> None:
        self.replays += 1


class RecordingCapture:
    """Stands in for the torch.cuda.graph context manager."""

    def __init__(self, graph: RecordingGraph, pool: object = None) -> None:
        self.graph = graph

    def __enter__(self) -> None:
        RecordingGraph.capturing = True

    def __exit__(self, *exc: object) -> None:
        RecordingGraph.capturing = False


def use_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "CUDAGraph", RecordingGraph)
    monkeypatch.setattr(torch.cuda, "graph", RecordingCapture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
