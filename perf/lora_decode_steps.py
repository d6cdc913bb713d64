"""Batch-1 decode with a LoRA adapter against the base model, as small as it can be measured: two
engines of the default model (one without adapter slots, one with), one request each, their
decode steps taken in turn; medians of the step times and the adapter's extra milliseconds.
Runs against whatever checkout is imported, so two commits can be compared in alternate runs
(`PYTHONPATH=<other checkout>`).

    .venv/bin/python perf/lora_decode_steps.py
    .venv/bin/python perf/lora_decode_steps.py --rank 8 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from compiled_engine.bench.lora import write_random_adapter
from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.lora.manager import LoRARequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=100)
    args = parser.parse_args()

    plain = LLMEngine(EngineConfig(enable_prefix_caching=False))
    lora = LLMEngine(EngineConfig(enable_prefix_caching=False, enable_lora=True, max_lora_rank=args.rank))
    prompt = [100 + i % 1000 for i in range(args.prompt_len)]
    with tempfile.TemporaryDirectory() as scratch:
        adapter = write_random_adapter(Path(scratch) / "a0", lora.runner.model_config, args.rank, seed=0)
        request = LoRARequest("a0", str(adapter))
        runs = [(plain, None), (lora, request)]
        for engine, lora_request in runs:  # warm: the adapter into its slot, the first steps
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4), lora_request=lora_request)
            while engine.has_unfinished_requests():
                engine.step()
        times: list[list[float]] = [[], []]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        for _ in range(args.rounds):
            for engine, lora_request in runs:
                engine.add_request(prompt, params, lora_request=lora_request)
                engine.step()  # the prefill
            while any(engine.has_unfinished_requests() for engine, _ in runs):
                for steps, (engine, _) in zip(times, runs, strict=True):
                    if engine.has_unfinished_requests():
                        started = time.perf_counter()
                        engine.step()
                        steps.append(time.perf_counter() - started)
    base, adapted = (statistics.median(steps) * 1000 for steps in times)
    print(
        f"rank {args.rank}: base {base:.2f} ms a step, with the adapter {adapted:.2f} ms "
        f"(+{adapted - base:.2f} ms), ratio {base / adapted:.3f}x"
    )


if __name__ == "__main__":
    main()
