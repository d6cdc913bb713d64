"""Batch-1 decode speed of the default model at one tensor-parallel size, on the CPU.

    python perf/tp_decode_rate.py --tensor-parallel-size 3 [--cpu-threads N] [--enforce-eager]

Prints the median decode step's tokens/s over `--max-tokens` greedy tokens (after the prefill),
and each rank's thread count. Run it once per size: one process holds one process group.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.executor.threads import threads_per_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    config = EngineConfig(
        device="cpu",
        tensor_parallel_size=args.tensor_parallel_size,
        cpu_threads=args.cpu_threads,
        enforce_eager=args.enforce_eager or None,
        kv_cache_memory_gib=0.05,
    )
    engine = LLMEngine(config)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        engine.add_request("The history of the lighthouse begins", params)
        engine.step()  # the prefill
        times = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        share = threads_per_process(config)
        print(
            f"tensor_parallel_size {args.tensor_parallel_size}: {1 / statistics.median(times):.1f} decode tokens/s "
            f"(median of {len(times)} steps); threads per rank {share if share is not None else torch.get_num_threads()}"
        )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
