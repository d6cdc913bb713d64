"""How many CPU threads each process of an engine uses.

torch starts one OpenMP thread per core in every process. With tensor parallelism on the CPU, N
ranks on one machine would then each run as many threads as there are cores, and spend the step
taking the cores from each other (TP = 3 on two cores decoded at 1.1 tokens/s against 28.5 for
one process). So each CPU rank takes its share of the cores this process may run on
(`os.sched_getaffinity`), divided by the ranks on this machine; `--cpu-threads` sets it instead.
"""

from __future__ import annotations

import logging
import os

import torch

from compiled_engine.config import EngineConfig

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_process(config: EngineConfig) -> int | None:
    """The thread count for one of this engine's processes; None leaves torch's default (one
    process on the CPU, or any process that computes on a GPU)."""
    if config.cpu_threads is not None:
        return config.cpu_threads
    if config.world_size == 1 or config.resolved_device().type != "cpu":
        return None
    # Under torchrun only the ranks on this machine share its cores.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size))
    return max(1, usable_cores() // local)


def set_threads(config: EngineConfig) -> None:
    threads = threads_per_process(config)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        logger.info("CPU threads for this process: %d", threads)
