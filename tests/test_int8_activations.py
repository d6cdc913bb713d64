"""`--cpu-activations int8` on the default model (its GGUF's Q4_1 layers and Q8_0 head): a lossy,
opt-in mode, so it is held to its own contract, never to exactness:
- its fast path (the native 8-bit-activation kernels) gives its slow twin's products (the same
  numerics in torch, `ops.int8_activations_reference`) on the model's own activations;
- it stays close to the exact model: perplexity over short windows (every scored token's
  products in the 8-bit path) within 3% of the exact mode's, and the oracle's first greedy token
  on most prompts;
- every product that can take it does, and the exact mode's table picks none."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.bench.perplexity import TEXT_PATH, perplexity
from compiled_engine.config import EngineConfig
from compiled_engine.linear import quantized_op as ops
from compiled_engine.linear.quantized import INT8_DIRECT_MAX_ROWS, Int8ActivationsLinear, QuantizedLinear
from compiled_engine.linear.table import QUANTIZED_INT8_ACTIVATIONS, QUANTIZED_NATIVE, Product, kernel_for
from compiled_engine.prompts import DEFAULT_PROMPTS
from compiled_engine.tokenizer import Tokenizer
from reference_oracle import ReferenceOracle

MAX_TOKENS = 12
TEXT_TOKENS = 240
WINDOW = 32  # perplexity windows no longer than the direct kernels' rows: all 8-bit products


def _llm(activations: str) -> LLM:
    # No prefix cache: a prompt's numerics in this mode depend on how many of its tokens run
    # together (up to INT8_DIRECT_MAX_ROWS rows 8-bit, more exact), and a cache hit shortens the run.
    return LLM(
        cpu_activations=activations,
        enforce_eager=True,
        kv_cache_memory_gib=0.05,
        max_model_len=512,
        enable_prefix_caching=False,
    )


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer(default_model_dir)
    return [tokenizer.encode_prompt(p.text, p.chat) for p in DEFAULT_PROMPTS]


@pytest.fixture(scope="module")
def int8_llm(default_model_dir: Path) -> Iterator[LLM]:
    llm = _llm("int8")
    yield llm
    llm.engine.shutdown()


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Each prompt alone (batch 1, the decode shape the mode is for)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids) for prompt in prompts]


def _products(llm: LLM) -> list[torch.nn.Module]:
    model = llm.engine.runner.model
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def test_every_product_with_whole_blocks_takes_int8_activations(int8_llm: LLM) -> None:
    products = _products(int8_llm)
    assert len(products) == 30 * 4 + 1  # every layer's four products and the head
    assert all(type(p) is Int8ActivationsLinear for p in products)
    for weight in ("int4", "int8"):  # and the exact mode none
        assert kernel_for(Product(weight, "cpu", False, True, "fp32")) is QUANTIZED_NATIVE
        assert kernel_for(Product(weight, "cpu", False, True, "int8")) is QUANTIZED_INT8_ACTIVATIONS


def test_int8_activations_match_their_twin_and_stay_close_to_the_exact_model(
    int8_llm: LLM,
    prompts: list[list[int]],
    default_model_dir: Path,
    default_oracle: ReferenceOracle,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = Tokenizer(default_model_dir).encode(TEXT_PATH.read_text(encoding="utf-8"))[:TEXT_TOKENS]
    seen: list[tuple[Int8ActivationsLinear, torch.Tensor, torch.Tensor]] = []
    fast = Int8ActivationsLinear.forward

    def recorded(self: Int8ActivationsLinear, x: torch.Tensor) -> torch.Tensor:
        out = fast(self, x)
        if x.shape[0] <= INT8_DIRECT_MAX_ROWS:
            seen.append((self, x.clone(), out.clone()))
        return out

    with monkeypatch.context() as patch:
        patch.setattr(Int8ActivationsLinear, "forward", recorded)
        lossy = perplexity(int8_llm.engine, ids, WINDOW, WINDOW // 2).perplexity
        patch.setattr(Int8ActivationsLinear, "forward", QuantizedLinear.forward)  # the exact kernels
        exact = perplexity(int8_llm.engine, ids, WINDOW, WINDOW // 2).perplexity
    # Each product on the model's own activations, as the run gave them, against its twin. (Runs of
    # the two diverge: rounding x to 8 bits turns fp32-sized differences into whole steps now and
    # then, so only same-input comparisons are tight.)
    assert {p.out_features for p, _, _ in seen} == {960, 576, 3072, 49152}
    for product, x, out in seen[:: max(1, len(seen) // 60)] + seen[-2:]:
        args = (x, product.weight, product.bias)
        expected = ops.int8_activations_reference(*args)
        # fp32 sums of terms as large as the biggest output (activations of 10^4 run through down_proj)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()) + 1e-5)
    assert math.isfinite(lossy) and lossy != exact  # lossy: not the exact products
    assert abs(lossy / exact - 1) < 0.03, (lossy, exact)
    oracle = default_oracle
    eos = Tokenizer(default_model_dir).eos_token_ids
    expected = [oracle.greedy(p, 1, eos).token_ids[:1] for p in prompts]
    first = _greedy(int8_llm, prompts, max_tokens=1)
    agree = sum(a == b for a, b in zip(first, expected, strict=True))
    assert agree >= math.ceil(0.6 * len(prompts)), (first, expected)


def test_int8_activations_are_refused_by_name_and_off_the_cpu() -> None:
    with pytest.raises(ValueError, match="cpu_activations must be one of fp32, int8"):
        EngineConfig(cpu_activations="q8")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="runs on the CPU only"):
            LLM(cpu_activations="int8", device="cuda")
