"""Profile one greedy generation with torch.profiler (CPU, and CUDA when present): prints the top
operators by self time and writes a Chrome trace.

    .venv/bin/python perf/torch_profile.py --prompt "The three primary colors are" --max-tokens 32
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from compiled_engine.config import EngineConfig
from compiled_engine.engine.generator import Generator
from compiled_engine.engine.model_runner import ModelRunner
from compiled_engine.model.source import resolve_model_dir
from compiled_engine.tokenizer import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--prompt", default="The three primary colors are")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--trace", type=Path, default=Path("torch_trace.json"))
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()

    config = EngineConfig(model=args.model, device=args.device, kv_cache_memory_gib=0.25)
    model_dir = resolve_model_dir(config.model)
    generator = Generator(ModelRunner(model_dir, config))
    prompt = Tokenizer(model_dir).encode(args.prompt)
    generator.generate([prompt], 2)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        generator.generate([prompt], args.max_tokens)
    sort_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_key, row_limit=args.top))
    prof.export_chrome_trace(str(args.trace))
    print(f"trace written to {args.trace}")


if __name__ == "__main__":
    main()
