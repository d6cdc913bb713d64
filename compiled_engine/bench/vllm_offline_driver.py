"""Batch-1 latency of vLLM's offline `LLM`, run by path with a vLLM environment's python (it
imports nothing of ours): `bench latency --baseline vllm` starts it once our engine has been
measured and freed.

It builds `LLM` on the model directory in the given dtype, with prefix caching off (every repeat
computes its prompt, as ours does), warms it up, then times, greedy and ignoring end-of-sequence,
a generate of one token on the prefill prompt (the time to first token) and a generate of
`--output-len` tokens on the decode prompt, `--repeats` times each. The prompts are token ids
read from a JSON file ({"prefill": [...], "decode": [...]}), the ones our engine ran. It prints
one line, RESULT_MARKER and then JSON: the seconds of each generate and the tokens each made.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

RESULT_MARKER = "vllm-offline-latency "


def _generate_seconds(llm: Any, sampling_params: Any, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """Wall seconds of one greedy generate of `max_tokens` tokens after `prompt`, and the tokens made."""
    params = sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return seconds, len(outputs[0].outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompts = json.loads(args.prompts.read_text())
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=False,
    )
    _generate_seconds(llm, SamplingParams, prompts["prefill"][:8], 2)  # warm-up
    prefill = [_generate_seconds(llm, SamplingParams, prompts["prefill"], 1) for _ in range(args.repeats)]
    decode = [_generate_seconds(llm, SamplingParams, prompts["decode"], args.output_len) for _ in range(args.repeats)]
    result = {
        "prefill_s": [s for s, _ in prefill],
        "prefill_tokens": [n for _, n in prefill],
        "decode_s": [s for s, _ in decode],
        "decode_tokens": [n for _, n in decode],
    }
    print(RESULT_MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
