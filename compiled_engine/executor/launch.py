"""Starting and stopping the ranks of a multi-process engine: tensor-parallel ranks, pipeline
stages, or a grid of both (`ParallelLayout`).

On one machine, rank 0 (the process that serves) spawns ranks 1..N-1 as child processes that
rendezvous over TCP on loopback. Under `torchrun` (several machines, `env://` rendezvous), every
process is started by torchrun: rank 0 runs the command as usual and the others run the rank's
entry point. That entry point (load the shard, run the broadcast steps) is in
`executor/ranks.py`: rank 0 hands it to `RankGroup.start`, so this file knows nothing of the
runner. A rank that dies makes the next step fail on rank 0 (the child is checked
before every step, and collectives time out), so the engine reports itself dead instead of
hanging.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from compiled_engine.config import EngineConfig
from compiled_engine.errors import EngineDeadError
from compiled_engine.executor.distributed import init_ranks
from compiled_engine.executor.pipeline import ParallelLayout
from compiled_engine.model.shard import TPShard

logger = logging.getLogger(__name__)

# What a spawned rank runs: (its layout, init_method, model_dir, config). A module-level function,
# so that the spawn start method can send it to the child.
RankEntry = Callable[[ParallelLayout, str, str, EngineConfig], None]


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def _loopback_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def layout_of(rank: int, config: EngineConfig) -> ParallelLayout:
    return ParallelLayout(rank, config.pipeline_parallel_size, config.tensor_parallel_size)


@dataclass
class RankGroup:
    """Rank 0's view of the engine's other ranks: its own place in the grid, its tensor-parallel
    mesh, and the processes it spawned."""

    layout: ParallelLayout
    mesh: DeviceMesh
    workers: list[BaseProcess] = field(default_factory=list)

    @property
    def shard(self) -> TPShard:
        return TPShard(self.layout.tensor_rank, self.layout.tensor_size)

    @classmethod
    def start(cls, model_dir: Path, config: EngineConfig, entry: RankEntry) -> RankGroup:
        """Rank 0's side: spawn the other ranks, each running `entry` (unless torchrun did),
        and join the group."""
        size = config.world_size
        device = config.resolved_device()
        timeout_s = config.distributed_timeout_s
        if under_torchrun():
            rank = int(os.environ["RANK"])
            if int(os.environ["WORLD_SIZE"]) != size:
                raise ValueError(
                    f"torchrun started {os.environ['WORLD_SIZE']} processes; --pipeline-parallel-size "
                    f"{config.pipeline_parallel_size} x --tensor-parallel-size {config.tensor_parallel_size} is {size}"
                )
            layout = layout_of(rank, config)
            return cls(layout, init_ranks(layout, "env://", device, timeout_s))
        init_method = _loopback_init_method()
        context = multiprocessing.get_context("spawn")
        workers: list[BaseProcess] = []
        for rank in range(1, size):
            worker = context.Process(
                target=entry,
                args=(layout_of(rank, config), init_method, str(model_dir), config),
                name=f"rank-{rank}",
                daemon=True,
            )
            worker.start()
            workers.append(worker)
        logger.info(
            "%d ranks (pipeline %d x tensor %d) on %s (%s)",
            size,
            config.pipeline_parallel_size,
            config.tensor_parallel_size,
            device,
            "nccl" if device.type == "cuda" else "gloo",
        )
        layout = layout_of(0, config)
        return cls(layout, init_ranks(layout, init_method, device, timeout_s), workers)

    def check_alive(self) -> None:
        for worker in self.workers:
            if not worker.is_alive():
                raise EngineDeadError(f"engine rank {worker.name} exited with code {worker.exitcode}")

    def all_alive(self) -> bool:
        return all(worker.is_alive() for worker in self.workers)

    def shutdown(self, end_steps: Callable[[bool], None]) -> None:
        """End rank 0's steps (`end_steps`) telling the other ranks to stop if all are alive,
        then stop the group. With a rank lost, the others are not told: that broadcast would
        wait for the lost one until the collective timeout."""
        try:
            end_steps(self.all_alive())
        finally:
            self.stop()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` for each worker to leave (after rank 0 told them to), then kill
        it. Once a rank is lost the group is broken: the others can only be waiting in a
        collective that will never complete, so they are killed without waiting."""
        if not self.all_alive():
            timeout_s = 0.0
        for worker in self.workers:
            worker.join(timeout=timeout_s)
            if worker.is_alive():
                worker.kill()
                worker.join()
        if dist.is_initialized():
            dist.destroy_process_group()
