"""The default model on CPU against the transformers reference (fp32, on the GGUF's weights
dequantized): identical greedy ids, close logits, batching that changes nothing, and every page
back in the pool. Twice: with the GGUF's own 4-bit weights (the default), and, in the full tier
(`make test-full`), with the dense fp32 conversion (`quantization="none"`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import GenerationResult, Generator
from compiled_engine.engine.sequence import Sequence
from compiled_engine.engine.step_inputs import step_inputs
from compiled_engine.executor.runner import Runner
from compiled_engine.prompts import DEFAULT_PROMPTS
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.verify import report_divergence
from reference_oracle import GoldenResult, ReferenceOracle

MAX_TOKENS = 64


@dataclass
class Run:
    tokenizer: Tokenizer
    runner: Runner
    generator: Generator
    oracle: ReferenceOracle
    prompt_ids: list[list[int]]
    batched: list[GenerationResult]
    golden: list[GoldenResult]


@dataclass
class Reference:
    tokenizer: Tokenizer
    oracle: ReferenceOracle
    prompt_ids: list[list[int]]
    golden: list[GoldenResult]


@pytest.fixture(scope="module")
def reference(default_model_dir: Path, default_oracle: ReferenceOracle) -> Reference:
    tokenizer = Tokenizer(default_model_dir)
    oracle = default_oracle
    prompt_ids = [tokenizer.encode_prompt(p.text, p.chat) for p in DEFAULT_PROMPTS]
    golden = [oracle.greedy(ids, MAX_TOKENS, tokenizer.eos_token_ids) for ids in prompt_ids]
    return Reference(tokenizer, oracle, prompt_ids, golden)


@pytest.fixture(scope="module", params=["gguf-q4_1", pytest.param("dense-fp32", marks=pytest.mark.full)])
def run(request: pytest.FixtureRequest, default_model_dir: Path, reference: Reference) -> Run:
    quantization = None if request.param == "gguf-q4_1" else "none"
    runner = Runner(default_model_dir, EngineConfig(kv_cache_memory_gib=0.25, quantization=quantization))
    assert runner.weights_description.startswith("GGUF" if quantization is None else "dense")
    generator = Generator(runner)
    stop = reference.tokenizer.eos_token_ids
    batched = generator.generate(reference.prompt_ids, MAX_TOKENS, stop, record_logits=True)
    return Run(
        reference.tokenizer, runner, generator, reference.oracle, reference.prompt_ids, batched, reference.golden
    )


def test_prompts_cover_chat_plain_and_non_ascii() -> None:
    assert len(DEFAULT_PROMPTS) >= 8
    assert any(p.chat for p in DEFAULT_PROMPTS) and any(not p.chat for p in DEFAULT_PROMPTS)
    assert any(not p.text.isascii() for p in DEFAULT_PROMPTS)


def test_tokenization_matches_oracle(run: Run) -> None:
    for spec, ids in zip(DEFAULT_PROMPTS, run.prompt_ids, strict=True):
        assert ids == run.oracle.encode(spec.text, spec.chat)


def test_greedy_ids_identical_to_oracle(run: Run) -> None:
    reports = [
        report_divergence(run.tokenizer, i, spec, ours, golden)
        for i, (spec, ours, golden) in enumerate(zip(DEFAULT_PROMPTS, run.batched, run.golden, strict=True))
    ]
    assert [r for r in reports if r] == []
    # Plain prompts run the full budget, so most of the 8 x 64 tokens are really compared.
    assert sum(len(r.token_ids) for r in run.batched) >= 4 * MAX_TOKENS


def test_chat_answer_is_coherent(run: Run) -> None:
    answer = run.tokenizer.decode(run.batched[0].token_ids)
    assert "Paris" in answer
    assert run.batched[0].finish_reason == "stop"
    assert run.batched[0].token_ids[-1] in run.tokenizer.eos_token_ids


def test_prefill_logits_close_to_oracle(run: Run) -> None:
    for ours, golden in zip(run.batched, run.golden, strict=True):
        assert ours.prefill_logits is not None
        assert (ours.prefill_logits - golden.prefill_logits).abs().max().item() <= 1e-3


@torch.inference_mode()
def test_logits_at_every_prompt_position_close_to_oracle(run: Run) -> None:
    ids = run.prompt_ids[4]
    seq = Sequence(10_000, ids)
    run.generator.block_manager.grow(seq.block_table, len(ids))
    try:
        hidden = run.runner.hidden_states(step_inputs([(seq, len(ids))]))
        ours = run.runner.forward.logits(hidden)
    finally:
        run.generator.block_manager.free(seq.block_table)
    theirs = run.oracle.logits(ids)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-3


def test_each_prompt_alone_matches_the_batch(run: Run) -> None:
    stop = run.tokenizer.eos_token_ids
    for ids, batched in zip(run.prompt_ids, run.batched, strict=True):
        [alone] = run.generator.generate([ids], MAX_TOKENS, stop)
        assert alone.token_ids == batched.token_ids


def test_every_page_returns_to_the_pool(run: Run) -> None:
    manager = run.generator.block_manager
    assert manager.num_free_pages == manager.num_pages
    run.generator.generate(run.prompt_ids[:3], 4, frozenset())
    assert manager.num_free_pages == manager.num_pages
