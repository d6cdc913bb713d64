"""Offline throughput of LLM.generate at a few batch sizes: random-token prompts, greedy,
fixed output length. A quick check until `python -m compiled_engine.bench offline` exists.

    .venv/bin/python perf/offline_batch.py --batch-sizes 1 4 16 --output-len 64
"""

from __future__ import annotations

import argparse
import random
import time

from compiled_engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    llm = LLM(model=args.model, kv_cache_memory_gib=args.kv_cache_memory_gib)
    vocab = llm.engine.runner.model_config.vocab_size
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for n in args.batch_sizes:
        prompts = [
            [rng.randrange(100, vocab) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
            for _ in range(n)
        ]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        out_tokens = sum(len(o.token_ids) for o in outputs)
        in_tokens = sum(len(p) for p in prompts)
        print(
            f"requests={n} prompt_tokens={in_tokens} output_tokens={out_tokens} seconds={seconds:.2f} "
            f"output_tokens_per_s={out_tokens / seconds:.1f} total_tokens_per_s={(in_tokens + out_tokens) / seconds:.1f}"
        )


if __name__ == "__main__":
    main()
