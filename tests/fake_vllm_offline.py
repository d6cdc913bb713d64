"""A stand-in for vLLM's package in the latency and offline benches' tests (vLLM is not installed
in CI): the tests install this file as `vllm/__init__.py` where the fake vLLM python finds it.
`LLM` and `SamplingParams` take the arguments vLLM's do (keywords after the model; an engine
argument vLLM does not know is a TypeError), and `LLM.generate` takes one SamplingParams for all
prompts or a list of one a prompt, and answers token ids in the prompts' order as vLLM's does,
sleeping PREFILL_S for the first token and STEP_S for each after it of its longest request. Every
construction and generate, with the environment variables vLLM reads, goes as one JSON line to
$FAKE_VLLM_OFFLINE_LOG.

$FAKE_VLLM_OFFLINE_FAIL picks a failure: `raise` (LLM cannot be built), `silent` (exits without
a result), `garbled` (a result line that is not JSON), `short` (one token too few), `dropped`
(the last request of a generate goes unanswered), `hang`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

PREFILL_S = 0.05
STEP_S = 0.01
ENGINE_ARGS = {"max_model_len", "enable_prefix_caching", "max_num_seqs"}
READ_ENV = ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "PYTHONPATH")


def _record(entry: dict[str, Any]) -> None:
    with open(os.environ["FAKE_VLLM_OFFLINE_LOG"], "a") as log:
        log.write(json.dumps(entry) + "\n")


@dataclass(kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int | None = 16
    ignore_eos: bool = False
    detokenize: bool = True
    seed: int | None = None


class LLM:
    def __init__(
        self, model: str, *, dtype: str = "auto", seed: int = 0, enforce_eager: bool = False, **kwargs: Any
    ) -> None:
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        failure = os.environ.get("FAKE_VLLM_OFFLINE_FAIL", "")
        env = {name: os.environ.get(name) for name in READ_ENV}
        _record(
            {
                "llm": {"model": model, "dtype": dtype, "seed": seed, "enforce_eager": enforce_eager, **kwargs},
                "env": env,
            }
        )
        if failure == "raise":
            raise ValueError("fake vLLM cannot load this model")
        if failure == "silent":
            sys.exit(0)
        if failure == "garbled":
            print("vllm-driver-result {not json", flush=True)
            sys.exit(0)
        if failure == "hang":
            time.sleep(600)

    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: bool = True, **kwargs: Any) -> list[Any]:
        each = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(each) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        record = [asdict(p) for p in each] if isinstance(sampling_params, list) else asdict(sampling_params)
        _record({"generate": [p["prompt_token_ids"] for p in prompts], "params": record})
        failure = os.environ.get("FAKE_VLLM_OFFLINE_FAIL")
        time.sleep(PREFILL_S + STEP_S * (max(p.max_tokens for p in each) - 1))
        answers = [
            SimpleNamespace(
                prompt_token_ids=prompt["prompt_token_ids"],
                outputs=[SimpleNamespace(token_ids=list(range(params.max_tokens - (failure == "short"))))],
            )
            for prompt, params in zip(prompts, each, strict=True)
        ]
        return answers[:-1] if failure == "dropped" and len(answers) > 1 else answers
