"""Tiny random-weight Llama and Qwen3 models written by transformers: our loader and model must
reproduce transformers' own greedy ids exactly and its logits closely, across page boundaries."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import Generator
from compiled_engine.engine.sequence import Sequence
from compiled_engine.engine.step_inputs import step_inputs
from compiled_engine.executor.runner import Runner
from reference_oracle import ReferenceOracle

VARIANTS = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama3-rope-scaling": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen3-gqa4-bias": ("qwen3", {"num_attention_heads": 8, "num_key_value_heads": 2, "attention_bias": True}),
}


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 13, 33)]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    model_type, overrides = VARIANTS[request.param]
    return tiny_model_factory(model_type, seed=len(request.param), **overrides)


def test_greedy_ids_match_transformers(model_dir: Path) -> None:
    runner = Runner(model_dir, EngineConfig(model=str(model_dir), page_size=4, num_pages=128))
    oracle = ReferenceOracle(model_dir)
    prompts = _prompts(runner.model_config.vocab_size, seed=1)
    results = Generator(runner).generate(prompts, 24, record_logits=True)
    for prompt, ours in zip(prompts, results, strict=True):
        golden = oracle.greedy(prompt, 24)
        assert ours.token_ids == golden.token_ids
        assert ours.prefill_logits is not None
        torch.testing.assert_close(ours.prefill_logits, golden.prefill_logits, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_logits_at_every_position_match_transformers(model_dir: Path) -> None:
    runner = Runner(model_dir, EngineConfig(page_size=4, num_pages=64))
    oracle = ReferenceOracle(model_dir)
    prompt = _prompts(runner.model_config.vocab_size, seed=2)[-1]
    seq = Sequence(0, prompt, block_table=list(range(60, 51, -1)))
    ours = runner.forward.logits(runner.hidden_states(step_inputs([(seq, len(prompt))])))
    torch.testing.assert_close(ours, oracle.logits(prompt), atol=1e-4, rtol=1e-4)


def test_batch_equals_each_alone(model_dir: Path) -> None:
    runner = Runner(model_dir, EngineConfig(page_size=4, num_pages=128))
    generator = Generator(runner)
    prompts = _prompts(runner.model_config.vocab_size, seed=3)
    batched = generator.generate(prompts, 16)
    for prompt, result in zip(prompts, batched, strict=True):
        assert generator.generate([prompt], 16)[0].token_ids == result.token_ids
    assert generator.block_manager.num_free_pages == generator.block_manager.num_pages


def test_bfloat16_run_stays_close_to_float32(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("llama")
    prompt = _prompts(320, seed=4)[2]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = Runner(model_dir, EngineConfig(dtype=dtype, page_size=4, num_pages=32))
        assert runner.kv_cache.dtype == runner.model.embed_tokens.weight.dtype == getattr(torch, dtype)
        [result] = Generator(runner).generate([prompt], 1, record_logits=True)
        assert result.prefill_logits is not None and result.prefill_logits.dtype == torch.float32
        logits[dtype] = result.prefill_logits
    scale = logits["float32"].abs().max().item()
    assert (logits["bfloat16"] - logits["float32"]).abs().max().item() <= 0.05 * scale
    assert logits["bfloat16"].argmax() == logits["float32"].argmax()
