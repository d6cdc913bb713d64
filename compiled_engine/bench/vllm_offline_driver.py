"""vLLM's offline `LLM` on our prompts, run by path with a vLLM environment's python (it imports
nothing of ours): `bench latency --baseline vllm` and `bench offline --baseline vllm` start it
once our engine has been measured and freed.

It builds `LLM` on the model directory in the given dtype, with prefix caching off unless
`--enable-prefix-caching` (ours had it on), warms it up on a short prompt, then, greedy and
ignoring end-of-sequence, on the token ids our engine ran (read from the `--prompts` JSON file):

- `--mode latency` ({"prefill": [...], "decode": [...]}): times a generate of one token on the
  prefill prompt (the time to first token) and a generate of `--output-len` tokens on the decode
  prompt, `--repeats` times each;
- `--mode offline` ({"prompts": [[...], ...], "output_lens": [...]}): times one generate of every
  prompt at once, each with its own output length.

It prints one line, RESULT_MARKER and then JSON: the seconds of each generate and the tokens each
request made.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

RESULT_MARKER = "vllm-driver-result "


def _generate_seconds(llm: Any, sampling_params: Any, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """Wall seconds of one greedy generate of `max_tokens` tokens after `prompt`, and the tokens made."""
    params = sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return seconds, len(outputs[0].outputs[0].token_ids)


def _latency(llm: Any, sampling_params: Any, prompts: dict[str, Any], output_len: int, repeats: int) -> dict[str, Any]:
    prefill = [_generate_seconds(llm, sampling_params, prompts["prefill"], 1) for _ in range(repeats)]
    decode = [_generate_seconds(llm, sampling_params, prompts["decode"], output_len) for _ in range(repeats)]
    return {
        "prefill_s": [s for s, _ in prefill],
        "prefill_tokens": [n for _, n in prefill],
        "decode_s": [s for s, _ in decode],
        "decode_tokens": [n for _, n in decode],
    }


def _offline(llm: Any, sampling_params: Any, prompts: dict[str, Any]) -> dict[str, Any]:
    """One generate of every prompt, each request with its own output length."""
    params = [
        sampling_params(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in prompts["output_lens"]
    ]
    requests = [{"prompt_token_ids": p} for p in prompts["prompts"]]
    started = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "output_tokens": [len(o.outputs[0].token_ids) for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["latency", "offline"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's")
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--output-len", type=int, default=1, help="latency mode's decode length")
    parser.add_argument("--repeats", type=int, default=3, help="latency mode's runs of each generate")
    args = parser.parse_args()
    prompts = json.loads(args.prompts.read_text())
    from vllm import LLM, SamplingParams

    engine_args: dict[str, Any] = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        **engine_args,
    )
    first = prompts["prefill"] if args.mode == "latency" else prompts["prompts"][0]
    _generate_seconds(llm, SamplingParams, first[:8], 2)  # warm-up
    if args.mode == "latency":
        result = _latency(llm, SamplingParams, prompts, args.output_len, args.repeats)
    else:
        result = _offline(llm, SamplingParams, prompts)
    print(RESULT_MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
