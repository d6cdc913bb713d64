"""An engine rank other than 0 (a tensor-parallel rank, a pipeline stage, or both): load this
rank's part of the model, then run each step rank 0 broadcasts, until it says stop. `run_worker` is the rank's entry point: rank 0 hands it to the
launcher (`parallel/launch.py`), which spawns it in each child process, and under torchrun the
command line runs it on ranks 1..N-1."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from compiled_engine.config import EngineConfig
from compiled_engine.engine.model_runner import ModelRunner
from compiled_engine.engine.step_inputs import StepInputs
from compiled_engine.model.shard import TPShard
from compiled_engine.parallel.distributed import broadcast_step, init_ranks
from compiled_engine.parallel.pipeline import ParallelLayout
from compiled_engine.parallel.threads import set_threads


def receive_step() -> StepInputs | None:
    """The step rank 0 broadcasts next; None: stop."""
    step: StepInputs | None = broadcast_step(None)
    return step


def serve_as_worker(runner: ModelRunner) -> None:
    while (inputs := receive_step()) is not None:
        runner.execute(inputs, logits=False)


def run_worker(layout: ParallelLayout, init_method: str, model_dir: str, config: EngineConfig) -> None:
    """Ranks 1..N-1: load this rank's part, then run every step rank 0 broadcasts."""
    set_threads(config)
    mesh = init_ranks(layout, init_method, config.resolved_device(), config.distributed_timeout_s)
    try:
        shard = TPShard(layout.tensor_rank, layout.tensor_size)
        serve_as_worker(ModelRunner(Path(model_dir), config, shard, mesh, layout=layout))
    finally:
        dist.destroy_process_group()
