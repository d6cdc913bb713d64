"""Process groups and the per-step broadcast for tensor and pipeline parallelism.

Rank 0 owns the scheduler, the tokenizer and the server. Each step it broadcasts what the step
runs (the engine's `StepInputs`: plain lists; any picklable object goes); every rank builds the
same tensors and runs the forward, whose row-parallel layers all-reduce; rank 0 alone computes
logits and samples. gloo on CPU, NCCL on CUDA; every collective has a timeout, so a dead or hung
rank is an error, never a hang.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from compiled_engine.parallel.pipeline import ParallelLayout

DEFAULT_TIMEOUT_S = 60.0

Step = TypeVar("Step")


def init_ranks(
    layout: ParallelLayout, init_method: str, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S
) -> DeviceMesh:
    """Join the engine's process group; the mesh of this rank's tensor-parallel group (its stage's
    ranks: the `tp` dimension of the `pp x tp` grid)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    rank = layout.rank
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=layout.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    if layout.pipeline_size == 1:
        return init_device_mesh(device.type, (layout.tensor_size,))
    grid = init_device_mesh(device.type, (layout.pipeline_size, layout.tensor_size), mesh_dim_names=("pp", "tp"))
    return grid["tp"]


def broadcast_step(step: Step | None) -> Step | None:
    """Rank 0 sends the step, any picklable object (None = stop); the other ranks pass None and
    receive it."""
    box: list[Step | None] = [step]
    dist.broadcast_object_list(box, src=0)
    return box[0]
