"""Profile the engine with torch.profiler (CPU, and CUDA when present): a batch of greedy
requests through LLMEngine after a warm-up; prints the top operators by self time and writes a
Chrome trace.

    .venv/bin/python perf/torch_profile.py --max-tokens 32
    .venv/bin/python perf/torch_profile.py --batch 16 --enforce-eager --trace eager.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--prompt", default="The three primary colors are")
    parser.add_argument("--batch", type=int, default=1, help="requests running together")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--trace", type=Path, default=Path("torch_trace.json"))
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, kv_cache_memory_gib=0.25, enforce_eager=True if args.enforce_eager else None))

    def run(max_tokens: int) -> None:
        for _ in range(args.batch):
            engine.add_request(args.prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

    run(2)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run(args.max_tokens)
    sort_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_key, row_limit=args.top))
    prof.export_chrome_trace(str(args.trace))
    print(f"trace written to {args.trace}")


if __name__ == "__main__":
    main()
