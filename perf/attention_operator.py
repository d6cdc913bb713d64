"""Batch-1 decode of the default model, compiled, with decode attention reached through the native
`paged_attention` operator (no Python per layer) against the same kernel called from Python per
layer (the operator not loaded). Each variant runs in its own process (the operator's CPU kernel,
once loaded, serves the whole process), alternated, so that both see the same moments of the
machine.

    .venv/bin/python perf/attention_operator.py --prompt-len 512 --output-len 128 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def measure(prompt_len: int, output_len: int, repeats: int) -> dict[str, float]:
    from compiled_engine.bench.runs import run_ours
    from compiled_engine.bench.workload import random_workload
    from compiled_engine.config import EngineConfig
    from compiled_engine.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(enable_prefix_caching=False))
    vocab = engine.runner.model_config.vocab_size
    run_ours(engine, random_workload(vocab, 1, (8, 8), (2, 2), 2))  # warm-up (and compile)
    decode = random_workload(vocab, 1, (prompt_len, prompt_len), (output_len, output_len), 1)
    tpots = [run_ours(engine, decode)["tpot_s"][0] for _ in range(repeats)]
    return {"tpot_ms": statistics.median(tpots) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="decode runs per process (median)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per variant, alternated")
    parser.add_argument("--variant", choices=["operator", "python"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        if args.variant == "python":
            import compiled_engine.attention.cpu_backend as cpu_backend

            cpu_backend.load_native_operator = lambda: False  # the kernel stays reachable through ctypes only
        print(json.dumps(measure(args.prompt_len, args.output_len, args.repeats)))
        return
    results: dict[str, list[float]] = {"operator": [], "python": []}
    for _ in range(args.rounds):
        for variant in results:
            command = [sys.executable, __file__, "--variant", variant, "--prompt-len", str(args.prompt_len)]
            command += ["--output-len", str(args.output_len), "--repeats", str(args.repeats)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            results[variant].append(json.loads(done.stdout.strip().splitlines()[-1])["tpot_ms"])
    for variant, tpots in results.items():
        shown = ", ".join(f"{t:.2f}" for t in tpots)
        print(f"{variant:>9}: decode {shown} ms a token (tok/s {1000 / statistics.median(tpots):.1f})")


if __name__ == "__main__":
    main()
