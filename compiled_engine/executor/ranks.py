"""An engine's ranks. Rank 0 starts the others and builds its own runner (`start_runner`); a rank
other than 0 (a tensor-parallel rank, a pipeline stage, or both) loads its part of the model,
then runs each step rank 0 broadcasts, until it says stop. `run_worker` is the rank's entry
point: rank 0 hands it to the launcher (`executor/launch.py`), which spawns it in each child
process, and under torchrun the command line runs it on ranks 1..N-1. The ranks of a pipeline
stage run a `StageRunner`."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from compiled_engine.config import EngineConfig
from compiled_engine.executor.distributed import Idle, broadcast_step, init_ranks
from compiled_engine.executor.launch import RankGroup
from compiled_engine.executor.pipeline import ParallelLayout, stage_layers
from compiled_engine.executor.prepare import AdapterInstall
from compiled_engine.executor.runner import Runner, SharedPool
from compiled_engine.executor.stage_runner import StageRunner
from compiled_engine.executor.step import StepInputs
from compiled_engine.executor.threads import set_threads
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.model.shard import TPShard


def start_runner(
    config: EngineConfig, model_dir: Path, shared_pool: SharedPool | None, install_adapters: AdapterInstall
) -> tuple[Runner, RankGroup | None]:
    """Rank 0's model runner; with tensor or pipeline parallelism, the other ranks' processes
    first (returned with it)."""
    if config.world_size == 1:
        return Runner(model_dir, config, shared_pool=shared_pool, install_adapters=install_adapters), None
    # Uneven head counts, or more stages than layers, fail here, before any process starts or
    # weight is read.
    model_config = config_from_model_dir(model_dir)
    TPShard(0, config.tensor_parallel_size).check(model_config)
    stage_layers(model_config.num_layers, config.pipeline_parallel_size, 0)
    ranks = RankGroup.start(model_dir, config, run_worker)
    if config.pipeline_parallel_size > 1:  # no draft model, no adapters (the config refuses them)
        return StageRunner(model_dir, config, ranks.shard, ranks.mesh, ranks.layout), ranks
    return Runner(model_dir, config, ranks.shard, ranks.mesh, shared_pool, install_adapters, ranks.layout), ranks


def serve_as_worker(runner: Runner) -> None:
    """Run each step rank 0 broadcasts (Idle: no step yet) until it sends None (stop)."""
    inputs: StepInputs | Idle | None
    while (inputs := broadcast_step(None)) is not None:
        if not isinstance(inputs, Idle):
            runner.execute(inputs)  # a rank other than 0: nothing comes back


def run_worker(layout: ParallelLayout, init_method: str, model_dir: str, config: EngineConfig) -> None:
    """Ranks 1..N-1: load this rank's part, then run every step rank 0 broadcasts."""
    set_threads(config)
    mesh = init_ranks(layout, init_method, config.resolved_device(), config.distributed_timeout_s)
    try:
        shard = TPShard(layout.tensor_rank, layout.tensor_size)
        runner_class = StageRunner if layout.pipeline_size > 1 else Runner
        serve_as_worker(runner_class(Path(model_dir), config, shard, mesh, layout=layout))
    finally:
        dist.destroy_process_group()
