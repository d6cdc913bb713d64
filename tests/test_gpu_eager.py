"""The eager model on CUDA (run by perf/gpu_check.sh; skipped without a GPU): the same weights on
the GPU agree with the CPU run, and the default model in bf16 still answers correctly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import Generator
from compiled_engine.errors import ModelSourceError
from compiled_engine.executor.runner import Runner
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.weights.default_model import load_default_model_dir

pytestmark = pytest.mark.gpu


def test_tiny_llama_fp32_on_cuda_matches_cpu(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("llama")
    prompts = [[5, 17, 42, 99, 3], list(range(10, 50))]
    results = {}
    for device in ("cpu", "cuda"):
        runner = Runner(model_dir, EngineConfig(device=device, dtype="float32", page_size=4, num_pages=64))
        results[device] = Generator(runner).generate(prompts, 16, record_logits=True)
    for cpu, gpu in zip(results["cpu"], results["cuda"], strict=True):
        assert cpu.token_ids == gpu.token_ids
        assert cpu.prefill_logits is not None and gpu.prefill_logits is not None
        torch.testing.assert_close(gpu.prefill_logits, cpu.prefill_logits, atol=1e-3, rtol=1e-3)


def test_default_model_bf16_on_cuda_answers_paris() -> None:
    try:
        default_model_dir = load_default_model_dir()
    except ModelSourceError as exc:  # the device machine has no network to prepare it
        pytest.skip(str(exc))
    runner = Runner(default_model_dir, EngineConfig(device="cuda", kv_cache_memory_gib=0.25))
    assert runner.dtype == torch.bfloat16
    tokenizer = Tokenizer(default_model_dir)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    generator = Generator(runner)
    [result] = generator.generate([prompt], 32, tokenizer.eos_token_ids)
    assert "Paris" in tokenizer.decode(result.token_ids)
    assert generator.block_manager.num_free_pages == generator.block_manager.num_pages
