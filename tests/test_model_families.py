"""Every family beside Llama and Qwen3 (Qwen2, Mistral, Gemma 2, Gemma 3, Phi-3), as tiny
random-weight models written by transformers: greedy ids token for token and logits against
transformers fp32, with sliding windows small enough (16) that prompts and outputs cross them,
through the engine (compiled for the families least like Llama) with chunked prefill, batched and
alone, after a prefix-cache hit past the window, with speculation and with LoRA (against PEFT)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from compiled_engine import LoRARequest
from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import Generator
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.executor.runner import Runner
from compiled_engine.llm import LLM
from compiled_engine.model.registry import config_from_model_dir
from reference_oracle import ReferenceOracle
from tests.conftest import TINY_LLAMA

WINDOW = 16
SMALL: dict[str, Any] = dict(TINY_LLAMA, pad_token_id=0)
GEMMA: dict[str, Any] = dict(SMALL, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW)
LONGROPE: dict[str, Any] = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 1.5, 2.2, 3.0, 4.1, 5.5, 7.2, 9.0],
    "original_max_position_embeddings": 32,
}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("qwen2", dict(SMALL)),
    "qwen2-tied-sliding": (
        "qwen2",
        dict(SMALL, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "mistral": ("mistral", dict(SMALL, head_dim=32, sliding_window=WINDOW)),
    "gemma2": ("gemma2", dict(GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": (
        "gemma3_text",
        dict(
            GEMMA,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            },
        ),
    ),
    "phi3-partial-rotary": (
        "phi3",
        dict(SMALL, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    ),
    "phi3-longrope": ("phi3", dict(SMALL, original_max_position_embeddings=32, rope_parameters=LONGROPE)),
}
# Past the window, and (33 on) past longrope's pretraining length of 32: transformers takes the
# long factors for the whole of such a sequence, as the engine does for its context of 256.
PROMPT_LENGTHS = (33, 40, 47)
NEW_TOKENS = 24


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> tuple[str, Path]:
    model_type, overrides = VARIANTS[request.param]
    return request.param, tiny_model_factory(model_type, seed=len(request.param), **overrides)


@pytest.fixture(scope="module")
def oracle(variant: tuple[str, Path]) -> ReferenceOracle:
    return ReferenceOracle(variant[1])


@pytest.fixture(scope="module")
def golden(variant: tuple[str, Path], oracle: ReferenceOracle) -> dict[tuple[int, ...], list[int]]:
    prompts = _prompts(320, seed=1)
    return {tuple(p): oracle.greedy(p, NEW_TOKENS).token_ids for p in prompts}


# Compiled where the family's pieces differ most from Llama's (two kinds of layer, two ropes, soft
# caps, partial rotary); eager elsewhere, to keep the suite's time (a compile is ~25 s here).
COMPILED = ("gemma2", "gemma3", "phi3-partial-rotary")


@pytest.fixture(scope="module")
def engine(variant: tuple[str, Path]) -> LLM:
    # A budget of 16 tokens a step: the longer prompts run in chunks that cross the window.
    compiled = variant[0] in COMPILED
    llm = LLM(model=str(variant[1]), page_size=4, num_pages=128, max_num_batched_tokens=16, enforce_eager=not compiled)
    assert llm.engine.runner.forward.compiled == compiled
    return llm


def test_config_reads_the_family(variant: tuple[str, Path]) -> None:
    name, model_dir = variant
    config = config_from_model_dir(model_dir)
    assert config.architecture == name.split("-")[0]
    if name in ("mistral", "gemma2", "gemma3", "qwen2-tied-sliding"):
        assert config.sliding and max(config.layer_windows) == WINDOW
    assert config.sliding == (name not in ("qwen2", "phi3-partial-rotary", "phi3-longrope"))


def test_batched_chunked_greedy_matches_transformers(engine: LLM, golden: dict[tuple[int, ...], list[int]]) -> None:
    prompts = [list(p) for p in golden]
    outputs = engine.generate(prompts, _greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == golden[tuple(prompt)]


def test_alone_and_after_a_prefix_cache_hit_past_the_window(
    engine: LLM, golden: dict[tuple[int, ...], list[int]]
) -> None:
    prompt = list(next(reversed(golden)))
    first = engine.generate([prompt], _greedy(), use_tqdm=False)[0]
    again = engine.generate([prompt], _greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens > WINDOW
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == golden[tuple(prompt)]
    manager = engine.engine.block_manager
    assert manager.num_free_pages == manager.num_pages


@torch.inference_mode()
def test_eager_logits_at_every_step_match_transformers(variant: tuple[str, Path], oracle: ReferenceOracle) -> None:
    runner = Runner(variant[1], EngineConfig(model=str(variant[1]), page_size=4, num_pages=64, enforce_eager=True))
    prompt = _prompts(320, seed=2)[0]
    [ours] = Generator(runner).generate([prompt], 8, record_logits=True)
    golden = oracle.greedy(prompt, 8)
    assert ours.token_ids == golden.token_ids
    assert ours.prefill_logits is not None
    torch.testing.assert_close(ours.prefill_logits, golden.prefill_logits, atol=1e-4, rtol=1e-4)


def test_speculative_decoding_keeps_greedy_output(variant: tuple[str, Path], oracle: ReferenceOracle) -> None:
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(model=str(variant[1]), page_size=4, num_pages=64, enforce_eager=True, speculative_config=speculative)
    # Most of the vocabulary: whatever the model emits occurred before, so the n-gram drafter
    # proposes at every step.
    prompt = torch.randperm(317, generator=torch.Generator().manual_seed(3))[:200].add(3).tolist()
    out = llm.generate([prompt], _greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == oracle.greedy(prompt, NEW_TOKENS).token_ids
    stats = llm.engine.speculative_stats
    assert stats is not None and stats.draft_tokens > 0


# PEFT's module names: each family's own (Phi-3 fuses q/k/v and gate/up in its checkpoint).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_LORA_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def test_lora_matches_peft(variant: tuple[str, Path], tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    name, model_dir = variant
    targets = PHI3_LORA_TARGETS if name.startswith("phi3") else LORA_TARGETS
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(5)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():  # PEFT's non-zero init is small: make the adapter change the greedy ids
        for param_name, param in peft.named_parameters():
            if "lora_" in param_name:
                param.normal_(0.0, 0.2)
    peft.save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tmp_path / "adapter"
    ).eval()
    prompt = _prompts(320, seed=4)[0]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        generated = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    expected = generated[0, len(prompt) :].tolist()
    llm = LLM(model=str(model_dir), enable_lora=True, enforce_eager=True, page_size=4, num_pages=64)
    lora = LoRARequest("family", str(tmp_path / "adapter"))
    [with_lora, without] = llm.generate([prompt, prompt], _greedy(12), use_tqdm=False, lora_request=[lora, None])
    assert with_lora.outputs[0].token_ids == expected
    assert without.outputs[0].token_ids != expected  # the adapter changed the output
