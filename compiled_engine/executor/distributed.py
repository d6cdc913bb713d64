"""Process groups and the per-step broadcast for tensor and pipeline parallelism.

Rank 0 owns the scheduler, the tokenizer and the server. Each step it broadcasts what the step
runs (the engine's `StepInputs`: plain lists; any picklable object goes); every rank builds the
same tensors and runs the forward, whose row-parallel layers all-reduce; rank 0 alone computes
logits and samples. gloo on CPU, NCCL on CUDA; every collective has a timeout, so a dead or hung
rank is an error, never a hang.

The other ranks wait for the next step inside that broadcast, a collective like any other: an
engine with nothing to do would reach the timeout there and lose its ranks. So rank 0 sends
`Idle` while no step comes (`StepSender`), often enough that no wait for a step is ever that long.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from compiled_engine.executor.pipeline import ParallelLayout

logger = logging.getLogger(__name__)

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


class Idle:
    """What rank 0 broadcasts while no step comes: the other ranks wait for the next one."""


class StepSender:
    """Rank 0's end of the per-step broadcast. A step's broadcast and everything the ranks then do
    together for it (the forward's all-reduces, a pipeline's sends) run under one lock. Once the
    engine is built (`send_while_idle`), a daemon thread broadcasts `Idle` whenever a quarter of
    the collective timeout has passed since the last broadcast or step ended, so that the other
    ranks' wait for the next step never reaches the timeout, however long the engine idles."""

    def __init__(self, timeout_s: float) -> None:
        self.interval_s = timeout_s / 4
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def send_while_idle(self, ranks_alive: Callable[[], bool]) -> None:
        """Start the idle broadcasts: after everything rank 0 builds (a draft model's CUDA graphs
        are captured in a mode that another thread's work would break). `ranks_alive`: False once
        a rank is known lost (a broadcast to it would only wait for the timeout)."""
        # NCCL's object broadcast stages through the current device, which is per thread.
        cuda_device = torch.cuda.current_device() if dist.get_backend() == "nccl" else None
        self._thread = threading.Thread(
            target=self._send_idle, args=(ranks_alive, cuda_device), name="rank-0-idle", daemon=True
        )
        self._thread.start()

    @contextlib.contextmanager
    def step(self, inputs: object) -> Iterator[None]:
        """Broadcast `inputs`, then hold the ranks for this step until the block ends."""
        with self._lock:
            try:
                broadcast_step(inputs)
                yield
            finally:
                self._last = time.monotonic()

    def close(self, stop_ranks: bool) -> None:
        """No more steps. With `stop_ranks`, tell the other ranks to leave (a broadcast that
        waits for every rank: not with one lost). Waits a while for the idle thread to end, so
        that the group is not torn down under its broadcast."""
        self._closed.set()
        if stop_ranks:
            with self._lock:
                broadcast_step(None)
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s)

    def _send_idle(self, ranks_alive: Callable[[], bool], cuda_device: int | None) -> None:
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        while not self._closed.wait(self.interval_s / 4):
            with self._lock:
                if self._closed.is_set() or time.monotonic() - self._last < self.interval_s:
                    continue
                if not ranks_alive():
                    return  # rank 0's next step reports the lost rank
                try:
                    broadcast_step(Idle())
                except Exception as error:
                    logger.warning("rank 0's idle broadcast failed (%s); the ranks' next step reports why", error)
                    return
                self._last = time.monotonic()
