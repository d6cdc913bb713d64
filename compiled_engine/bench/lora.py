"""`bench lora`: adapters beside the base model, in the same run.

Random PEFT-format adapters (every one of the seven products, `--lora-rank`) are written to a
scratch directory, so the workload needs neither PEFT nor a download. Three figures, each against
the same workload on the base model: batch-1 decode with one adapter (the two engines' steps
taken in turn); a batch that spreads its requests over `--num-adapters` distinct adapters; and
the time to load one adapter, as a runtime load does (read, check, lay out; the first step then
writes it into a slot).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from compiled_engine.bench.runs import run_ours
from compiled_engine.bench.workload import random_workload
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.lora.adapter import CONFIG_NAME, TARGETS, WEIGHTS_NAME, WHOLE, product_shapes
from compiled_engine.lora.manager import LoRAManager, LoRARequest
from compiled_engine.model.config import ModelConfig


def write_random_adapter(directory: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter on all seven products, with random A and B (so it changes outputs)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = product_shapes(config)
    sliced = {module: target for module, target in TARGETS.items() if target[2] != WHOLE}
    tensors = {}
    for layer in range(config.num_layers):
        for module, (block, product, piece) in sliced.items():
            in_features, widths = shapes[f"{block}.{product}"]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(widths[piece], rank, generator=generator) * 0.02
    save_file(tensors, directory / WEIGHTS_NAME)
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(sliced)}
    (directory / CONFIG_NAME).write_text(json.dumps(adapter_config))
    return directory


def alternated_decode_tokens_per_s(
    runs: list[tuple[LLMEngine, LoRARequest | None]], prompt: list[int], output_len: int
) -> list[float]:
    """Batch-1 decode speed of each (engine, adapter), one request each, their steps taken in
    turn (one step of each, then again) so that the machine's drift falls on all alike: one
    over the median time of a decode step, in tokens/s."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for engine, lora_request in runs:
        engine.add_request(prompt, params, lora_request=lora_request)
        engine.step()  # the prefill
    steps: list[list[float]] = [[] for _ in runs]
    while any(engine.has_unfinished_requests() for engine, _ in runs):
        for times, (engine, _) in zip(steps, runs, strict=True):
            if engine.has_unfinished_requests():
                started = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - started)
    return [1 / statistics.median(times) for times in steps]


def bench_lora_runs(
    plain: LLMEngine,
    lora: LLMEngine,
    rank: int,
    num_adapters: int,
    batch: int,
    prompt_len: int,
    output_len: int,
    seed: int,
    rounds: int = 3,
) -> dict[str, Any]:
    """The figures of `bench lora`: `plain` runs the base model without adapter slots, `lora`
    the same model with them. Each figure is measured `rounds` times, the two engines alternated
    within a round, so that the machine's drift falls on both; figures are medians over the
    rounds, and ratios the medians of each round's ratio."""
    config = lora.runner.model_config
    vocab = config.vocab_size
    with tempfile.TemporaryDirectory() as scratch:
        paths = [write_random_adapter(Path(scratch) / f"a{i}", config, rank, seed + i) for i in range(num_adapters)]
        assert isinstance(lora.adapters, LoRAManager)
        started = time.perf_counter()
        lora.adapters.add(LoRARequest("a0", str(paths[0])))
        load_s = time.perf_counter() - started
        requests = [LoRARequest(f"a{i}", str(path)) for i, path in enumerate(paths)]
        one = random_workload(vocab, 1, (prompt_len, prompt_len), (output_len, output_len), seed)
        many = random_workload(vocab, batch, (prompt_len, prompt_len), (output_len, output_len), seed + 1)
        warm_up = random_workload(vocab, 1, (8, 8), (2, 2), seed + 2)
        for engine in (plain, lora):
            run_ours(engine, warm_up)
        run_ours(lora, warm_up, loras=requests[:1])
        spread = [requests[i % num_adapters] for i in range(batch)]
        measured: dict[str, list[float]] = {}
        for _ in range(rounds):
            prompt = one.prompts[0]
            base, adapter = alternated_decode_tokens_per_s([(plain, None), (lora, requests[0])], prompt, output_len)
            (slots_base,) = alternated_decode_tokens_per_s([(lora, None)], prompt, output_len)
            base_many = run_ours(plain, many)["seconds"]
            lora_many = run_ours(lora, many, loras=spread)["seconds"]
            round_figures = {
                "base_batch1": base,
                "adapter_batch1": adapter,
                "slots_batch1_base_request": slots_base,
                "base_batch_output_tokens_per_s": many.output_tokens / base_many,
                "adapters_batch_output_tokens_per_s": many.output_tokens / lora_many,
                "ratio_batch1": adapter / base,
                "ratio_batch": base_many / lora_many,  # output tokens/s, adapters over base
            }
            for key, value in round_figures.items():
                measured.setdefault(key, []).append(value)
    figures = {key: statistics.median(values) for key, values in measured.items()}
    return {"load_seconds": load_s, "rounds": rounds, **figures, "per_round": measured}
