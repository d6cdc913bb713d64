"""A stand-in for vLLM's package in the latency bench's tests (vLLM is not installed in CI): the
tests install this file as `vllm/__init__.py` where the fake vLLM python finds it. `LLM` and
`SamplingParams` take the arguments vLLM's do (keywords after the model; an engine argument vLLM
does not know is a TypeError), and `LLM.generate` answers token ids as vLLM's does, sleeping
PREFILL_S for the first token and STEP_S for each after it. Every construction and generate,
with the environment variables vLLM reads, goes as one JSON line to $FAKE_VLLM_OFFLINE_LOG.

$FAKE_VLLM_OFFLINE_FAIL picks a failure: `raise` (LLM cannot be built), `silent` (exits without
a result), `garbled` (a result line that is not JSON), `short` (one token too few), `hang`.
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
ENGINE_ARGS = {"max_model_len", "enable_prefix_caching"}
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
            print("vllm-offline-latency {not json", flush=True)
            sys.exit(0)
        if failure == "hang":
            time.sleep(600)

    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: bool = True, **kwargs: Any) -> list[Any]:
        _record({"generate": [p["prompt_token_ids"] for p in prompts], "params": asdict(sampling_params)})
        made = sampling_params.max_tokens - (os.environ.get("FAKE_VLLM_OFFLINE_FAIL") == "short")
        time.sleep(PREFILL_S + STEP_S * (sampling_params.max_tokens - 1))
        outputs = [SimpleNamespace(token_ids=list(range(made)))]
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=outputs) for p in prompts]
