"""The loop of a tensor-parallel rank other than 0: run each step rank 0 broadcasts, until it
says stop."""

from __future__ import annotations

from compiled_engine.engine.model_runner import ModelRunner
from compiled_engine.parallel.distributed import broadcast_step


def serve_as_worker(runner: ModelRunner) -> None:
    while (inputs := broadcast_step(None)) is not None:
        runner.execute(inputs, logits=False)
