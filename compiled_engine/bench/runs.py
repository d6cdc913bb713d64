"""A workload run through our engine directly, or through transformers as the baseline."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import torch

from compiled_engine.bench.hf_baseline import hf_generate_seconds, hf_generate_token_times
from compiled_engine.bench.serving import RequestRecord
from compiled_engine.bench.workload import Workload
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.linear.packed_cpu import BlockedEmbedding, CpuLinear
from compiled_engine.linear.quantized import QuantizedEmbedding, QuantizedLinear
from compiled_engine.linear.quantized_experts import QuantizedExperts
from compiled_engine.lora.manager import LoRARequest
from compiled_engine.model.layers import DecoderModel
from compiled_engine.model.moe import Experts


def weight_bytes(engine: LLMEngine) -> int:
    return model_weight_bytes(engine.runner.model)


def model_weight_bytes(model: DecoderModel) -> int:
    """Weight bytes one forward step of `model` (a Transformer) reads for one token: every
    parameter, quantized buffer and packed weight once, except the embedding table, of which a
    step reads only its tokens' rows (a tied head reads that whole table as its weight), and a
    mixture's experts, of which a token reads the k its router picks (k / experts of their bytes:
    the active parameters)."""
    held_in_buffers = (QuantizedLinear, QuantizedEmbedding, CpuLinear, BlockedEmbedding, QuantizedExperts)

    def weights(module: torch.nn.Module) -> list[torch.Tensor]:
        holders = [m for m in module.modules() if isinstance(m, held_in_buffers)]
        return [*module.parameters(), *(b for m in holders for b in m.buffers(recurse=False))]

    head = {id(t) for t in weights(model.get_submodule("lm_head"))}
    embedding = {id(t) for t in weights(model.get_submodule("embed_tokens"))} - head
    moe = model.config.moe
    experts = [m for m in model.modules() if isinstance(m, Experts | QuantizedExperts)]
    chosen = {id(t): moe.top_k / moe.num_experts for m in experts for t in weights(m)} if moe else {}
    seen: set[int] = set()
    total = 0.0
    for t in weights(model):
        if id(t) in seen or id(t) in embedding:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size() * chosen.get(id(t), 1.0)
    return round(total)


def kv_bytes_per_token(engine: LLMEngine) -> int:
    c = engine.runner.model_config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * engine.runner.kv_cache.element_size()


def run_ours(
    engine: LLMEngine,
    workload: Workload,
    on_tokens: Callable[[int], None] | None = None,
    loras: Sequence[LoRARequest | None] | None = None,
) -> dict[str, Any]:
    """All requests at once through the scheduler; counts steps and the bytes they read.
    `on_tokens` hears how many output tokens each step produced (for a progress bar); `loras`:
    each request's adapter (None: the base model for all)."""
    adapters = loras if loras is not None else [None] * len(workload.prompts)
    for prompt, out_len, lora in zip(workload.prompts, workload.output_lens, adapters, strict=True):
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(prompt, params, lora_request=lora)
    steps = 0
    start = time.perf_counter()
    finished: list[RequestOutput] = []
    seen: dict[str, int] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        finished.extend(o for o in outputs if o.finished)
        steps += 1
        if on_tokens is not None:
            fresh = 0
            for o in outputs:
                count = len(o.outputs[0].token_ids)
                fresh += count - seen.get(o.request_id, 0)
                seen[o.request_id] = count
            on_tokens(fresh)
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
        seconds += hf_generate_seconds(
            model, [workload.prompts[i] for i in rows], max(workload.output_lens[i] for i in rows), device
        )
    return {"seconds": seconds, "output_tokens": workload.output_tokens}


def run_hf_as_server(
    model: Any, workload: Workload, concurrency: int, device: torch.device
) -> tuple[list[RequestRecord], float]:
    """transformers behind a static-batching server: `concurrency` requests at a time in one
    padded `generate`, the next batch once it ends. Each request's times count from its batch's
    start, as a closed-loop client at that concurrency would see them."""
    records: list[RequestRecord] = []
    seconds = 0.0
    for start in range(0, len(workload.prompts), concurrency):
        prompts = workload.prompts[start : start + concurrency]
        lens = workload.output_lens[start : start + concurrency]
        times = hf_generate_token_times(model, prompts, max(lens), device)
        seconds += times[-1]
        for prompt, n in zip(prompts, lens, strict=True):
            own = times[:n]
            records.append(
                RequestRecord(
                    prompt_tokens=len(prompt),
                    ok=True,
                    ttft_s=own[0],
                    e2e_s=own[-1],
                    output_tokens=n,
                    itl_s=[b - a for a, b in pairwise(own)],
                )
            )
    return records, seconds
