"""Batch-1 decode with a LoRA adapter against the base model, as small as it can be measured: two
engines of the default model (one without adapter slots, one with), one request each, their
decode steps taken in turn; medians of the step times and the adapter's extra milliseconds.
Runs against whatever checkout is imported, so two commits can be compared in alternate runs
(`PYTHONPATH=<other checkout>`). The steps are taken as `bench lora` takes them
(`alternated_decode_tokens_per_s`); the figure is the median over rounds of each round's median step.

    .venv/bin/python perf/lora_decode_steps.py
    .venv/bin/python perf/lora_decode_steps.py --rank 8 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from compiled_engine.bench.lora import alternated_decode_tokens_per_s, write_random_adapter
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
        runs = [(plain, None), (lora, LoRARequest("a0", str(adapter)))]
        for engine, lora_request in runs:  # warm: the adapter into its slot, the first steps
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4), lora_request=lora_request)
            while engine.has_unfinished_requests():
                engine.step()
        # the bench's own alternation; each round's median step, then the median of the rounds
        rounds = [alternated_decode_tokens_per_s(runs, prompt, args.output_len) for _ in range(args.rounds)]
    base, adapted = (statistics.median(1000 / figures[i] for figures in rounds) for i in (0, 1))
    print(
        f"rank {args.rank}: base {base:.2f} ms a step, with the adapter {adapted:.2f} ms "
        f"(+{adapted - base:.2f} ms), ratio {base / adapted:.3f}x"
    )


if __name__ == "__main__":
    main()
