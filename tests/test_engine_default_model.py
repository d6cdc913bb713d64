"""The scheduled engine on the default model (its GGUF's 4-bit weights, fp32 activations, CPU): 16 concurrent requests through chunked
prefill (chunks of 1, 7 and 64 tokens crossing pages), prefix-cache hits and forced preemption
give exactly the oracle's greedy tokens, which are also each request's tokens alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from compiled_engine import LLM, SamplingParams
from compiled_engine.prompts import DEFAULT_PROMPTS
from compiled_engine.tokenizer import Tokenizer
from reference_oracle import ReferenceOracle

MAX_TOKENS = 10
SHARED = "You are a careful assistant. Answer in one short sentence, in English, and do not add anything else. "
QUESTIONS = ["Why is the sea salty?", "What is a prime number?", "Who wrote Hamlet?", "Name a red fruit."]


def _prompts(tokenizer: Tokenizer) -> list[list[int]]:
    prompts = [tokenizer.encode_prompt(p.text, p.chat) for p in DEFAULT_PROMPTS]
    prompts += [tokenizer.encode_prompt(SHARED + q, chat=True) for q in QUESTIONS]  # shared prefix
    prompts += [tokenizer.encode("Hi"), tokenizer.encode("1, 2, 3, 4,"), prompts[0], prompts[8]]  # repeats
    assert len(prompts) == 16 and len({len(p) for p in prompts}) > 8
    return prompts


@pytest.fixture(scope="module")
def golden(default_model_dir: Path, default_oracle: ReferenceOracle) -> dict[str, Any]:
    tokenizer = Tokenizer(default_model_dir)
    oracle = default_oracle
    prompts = _prompts(tokenizer)
    tokens = [oracle.greedy(p, MAX_TOKENS, tokenizer.eos_token_ids).token_ids for p in prompts]
    return {"prompts": prompts, "tokens": tokens}


CONFIGS = {
    "chunk1-page4-prefix": dict(max_num_batched_tokens=1, page_size=4, num_pages=400),
    # the torch reference backend here; the others take the CPU default (the native decode kernel)
    "chunk7-page4-no-prefix-torch": dict(
        max_num_batched_tokens=7, page_size=4, num_pages=400, enable_prefix_caching=False, attention_backend="torch"
    ),
    "chunk64-page16-preempt": dict(max_num_batched_tokens=64, page_size=16, num_pages=12),
    "chunk64-page4-preempt-no-prefix": dict(
        max_num_batched_tokens=64, page_size=4, num_pages=30, enable_prefix_caching=False
    ),
}


# The quick tier runs a prefix-caching config and a preempting one; the full tier the other two.
FULL_TIER_CONFIGS = {"chunk7-page4-no-prefix-torch", "chunk64-page4-preempt-no-prefix"}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=pytest.mark.full) if name in FULL_TIER_CONFIGS else name for name in sorted(CONFIGS)
    ],
)
def llm(request: pytest.FixtureRequest, default_model_dir: Path) -> Iterator[tuple[str, LLM]]:
    yield request.param, LLM(**CONFIGS[request.param])


def test_concurrent_requests_match_the_oracle(llm: tuple[str, LLM], golden: dict[str, Any]) -> None:
    name, engine = llm
    assert engine.engine.runner.backend.name == ("torch" if name.endswith("-torch") else "cpu")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = engine.generate(golden["prompts"], params, use_tqdm=False)
    for i, (output, expected) in enumerate(zip(outputs, golden["tokens"], strict=True)):
        assert output.token_ids == expected, f"request {i} differs under {name}"
        assert output.prompt_token_ids == golden["prompts"][i]
    core = engine.engine
    manager = core.block_manager
    assert manager.num_free_pages == manager.num_pages
    manager.check_consistency([])
    if "preempt" in name:
        assert core.scheduler.num_preemptions > 0
    if manager.enable_prefix_caching:
        assert manager.stats.hit_tokens > 0
        assert any(o.num_cached_tokens > 0 for o in outputs)
        # The shared-prefix questions part mid-page: K/V copied from inside cached pages.
        assert manager.stats.copied_tokens > 0
    else:
        assert manager.stats.hit_tokens == 0 and manager.stats.copied_tokens == 0
    # A second round is served from the prefix cache where it is on, with the same tokens: with
    # nothing evicted, each repeated prompt computes its last token only.
    again = engine.generate(golden["prompts"][:4], params, use_tqdm=False)
    assert [o.token_ids for o in again] == golden["tokens"][:4]
    if manager.enable_prefix_caching and "preempt" not in name:
        assert [o.num_cached_tokens for o in again] == [len(p) - 1 for p in golden["prompts"][:4]]
