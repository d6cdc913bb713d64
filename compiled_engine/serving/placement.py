"""Which cores or GPUs each data-parallel replica runs on.

On the CPU the cores this process may use (`os.sched_getaffinity`) are split into contiguous
shares, one a replica (with fewer cores than replicas, replicas share them round robin); each
replica pins itself to its share before its engine starts, and its tensor-parallel ranks split
that share again (executor/threads.py). On CUDA replica i takes the GPUs i*TP .. (i+1)*TP-1 of
those visible, by setting CUDA_VISIBLE_DEVICES before CUDA starts in its process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    cores: tuple[int, ...] | None = None  # CPU: the cores to pin to (None: leave the affinity)
    cuda_devices: str | None = None  # CUDA: the CUDA_VISIBLE_DEVICES value (None: leave it)


def allowed_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux: no pinning
        return []


def cpu_placements(size: int, cores: list[int]) -> list[Placement]:
    """`size` shares of `cores`: contiguous and as even as they can be."""
    if not cores:
        return [Placement() for _ in range(size)]
    if len(cores) < size:
        return [Placement((cores[i % len(cores)],)) for i in range(size)]
    shares, extra = divmod(len(cores), size)
    placements, start = [], 0
    for i in range(size):
        count = shares + (1 if i < extra else 0)
        placements.append(Placement(tuple(cores[start : start + count])))
        start += count
    return placements


def cuda_placements(size: int, tensor_parallel_size: int, visible: list[str]) -> list[Placement]:
    """Replica i: the visible GPUs i*TP .. (i+1)*TP-1; fewer than size*TP is an error."""
    need = size * tensor_parallel_size
    if len(visible) < need:
        raise ValueError(
            f"--data-parallel-size {size} x --tensor-parallel-size {tensor_parallel_size} needs {need} GPUs; "
            f"{len(visible)} are visible"
        )
    step = tensor_parallel_size
    return [Placement(cuda_devices=",".join(visible[i * step : (i + 1) * step])) for i in range(size)]


def placements(size: int, tensor_parallel_size: int, device: str) -> list[Placement]:
    if device == "cuda":
        import torch

        found = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = found.split(",") if found else [str(i) for i in range(torch.cuda.device_count())]
        return cuda_placements(size, tensor_parallel_size, visible)
    return cpu_placements(size, allowed_cores())


def apply(placement: Placement) -> None:
    """In the replica's process, before its engine starts."""
    if placement.cores is not None:
        os.sched_setaffinity(0, placement.cores)
    if placement.cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.cuda_devices


def threads_for(placement: Placement, tensor_parallel_size: int) -> int | None:
    """The CPU threads of each of the replica's processes: its share of the cores, split among its
    tensor-parallel ranks (None: torch's default)."""
    if placement.cores is None:
        return None
    return max(1, len(placement.cores) // tensor_parallel_size)
