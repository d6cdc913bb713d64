"""The two offline workloads, for our engine and for the baseline."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from compiled_engine.bench.hf_baseline import hf_generate_seconds
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(vocab: int, num_seqs: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(*input_len))] for _ in range(num_seqs)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_seqs)])


def weight_bytes(engine: LLMEngine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def kv_bytes_per_token(engine: LLMEngine) -> int:
    c = engine.runner.model_config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * engine.runner.kv_cache.element_size()


def run_ours(engine: LLMEngine, workload: Workload) -> dict[str, Any]:
    """All requests at once through the scheduler; counts steps and the bytes they read."""
    for prompt, out_len in zip(workload.prompts, workload.output_lens, strict=True):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    steps = 0
    start = time.perf_counter()
    finished: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
        steps += 1
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    # Each generated token reads its sequence's whole context from the KV cache.
    kv_read = kv_bytes_per_token(engine) * sum(
        len(p) + i for p, n in zip(workload.prompts, workload.output_lens, strict=True) for i in range(n)
    )
    return {
        "seconds": seconds,
        "steps": steps,
        "output_tokens": sum(len(o.token_ids) for o in finished),
        "bytes_read": steps * weight_bytes(engine) + kv_read,
        "ttft_s": [o.metrics.ttft for o in finished if o.metrics is not None and o.metrics.ttft is not None],
        "tpot_s": [o.metrics.tpot for o in finished if o.metrics is not None and o.metrics.tpot is not None],
    }


def run_hf(model: Any, workload: Workload, batch_size: int, device: torch.device) -> dict[str, Any]:
    """Padded batches of `batch_size`, each generating the longest output its rows asked for;
    only the tokens each row asked for count as output."""
    seconds = 0.0
    order = list(range(len(workload.prompts)))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        seconds += hf_generate_seconds(model, [workload.prompts[i] for i in rows], max(workload.output_lens[i] for i in rows), device)
    return {"seconds": seconds, "output_tokens": workload.output_tokens}
