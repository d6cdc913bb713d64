"""Starting and stopping the ranks of a tensor-parallel engine.

On one machine, rank 0 (the process that serves) spawns ranks 1..N-1 as child processes that
rendezvous over TCP on loopback. Under `torchrun` (several machines, `env://` rendezvous), every
process is started by torchrun: rank 0 runs the command as usual and the others run the rank's
entry point. That entry point (load the shard, run the broadcast steps) is the engine's
(`engine/tp_worker.py`): rank 0 hands it to `TensorParallelGroup.start`, so this package knows
nothing of the engine. A rank that dies makes the next step fail on rank 0 (the child is checked
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
from compiled_engine.model.shard import TPShard
from compiled_engine.parallel.distributed import init_tensor_parallel

logger = logging.getLogger(__name__)

# What a spawned rank runs: (rank, size, init_method, model_dir, config). A module-level function,
# so that the spawn start method can send it to the child.
RankEntry = Callable[[int, int, str, str, EngineConfig], None]


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def _loopback_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@dataclass
class TensorParallelGroup:
    shard: TPShard
    mesh: DeviceMesh
    workers: list[BaseProcess] = field(default_factory=list)

    @classmethod
    def start(cls, model_dir: Path, config: EngineConfig, entry: RankEntry) -> TensorParallelGroup:
        """Rank 0's side: spawn the other ranks, each running `entry` (unless torchrun did),
        and join the group."""
        size = config.tensor_parallel_size
        device = config.resolved_device()
        if under_torchrun():
            rank = int(os.environ["RANK"])
            if int(os.environ["WORLD_SIZE"]) != size:
                raise ValueError(
                    f"torchrun started {os.environ['WORLD_SIZE']} processes, --tensor-parallel-size is {size}"
                )
            return cls(
                TPShard(rank, size), init_tensor_parallel(rank, size, "env://", device, config.distributed_timeout_s)
            )
        init_method = _loopback_init_method()
        context = multiprocessing.get_context("spawn")
        workers: list[BaseProcess] = []
        for rank in range(1, size):
            worker = context.Process(
                target=entry,
                args=(rank, size, init_method, str(model_dir), config),
                name=f"tp-rank-{rank}",
                daemon=True,
            )
            worker.start()
            workers.append(worker)
        logger.info("tensor parallel: %d ranks on %s (%s)", size, device, "nccl" if device.type == "cuda" else "gloo")
        mesh = init_tensor_parallel(0, size, init_method, device, config.distributed_timeout_s)
        return cls(TPShard(0, size), mesh, workers)

    def check_alive(self) -> None:
        for worker in self.workers:
            if not worker.is_alive():
                raise EngineDeadError(f"tensor-parallel worker {worker.name} exited with code {worker.exitcode}")

    def all_alive(self) -> bool:
        return all(worker.is_alive() for worker in self.workers)

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
