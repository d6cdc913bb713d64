"""Batched decode of the default model through a pipeline, on the CPU: how much the micro-batches
buy.

    python perf/pipeline_decode.py --pipeline-parallel-size 2 --micro-batches 1 [--batch 16]

Starts `--batch` greedy requests together, runs their prompts, then times the decode steps and
prints the median step's output tokens/s. Run once per setting (one process holds one process
group); `--pipeline-parallel-size 1` is the one-process baseline on the same cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=None, help="default: one per stage")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    config = EngineConfig(
        device="cpu",
        pipeline_parallel_size=args.pipeline_parallel_size,
        pipeline_micro_batches=args.micro_batches,
        enforce_eager=args.enforce_eager or None,
        kv_cache_memory_gib=0.1,
    )
    engine = LLMEngine(config)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request(f"Chapter {i}. The history of the lighthouse begins", params)
        while any(seq.is_prefilling for seq in [*engine.scheduler.waiting, *engine.scheduler.running]):
            engine.step()
        times = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        print(
            f"pipeline_parallel_size {args.pipeline_parallel_size}, micro-batches "
            f"{args.micro_batches or args.pipeline_parallel_size}, batch {args.batch}: "
            f"{args.batch / statistics.median(times):.1f} output tokens/s (median of {len(times)} steps)"
        )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
