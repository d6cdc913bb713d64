"""Granite-MoE and Granite-MoE-shared as tiny random-weight models written by transformers: several
experts, k > 1, the fused expert tensors, a shared expert (the second), and all four multipliers
away from 1. Greedy ids and logits against transformers fp32, batched with chunked prefill and
alone, eager and compiled (Granite-MoE), quantized experts against their dequantized twin, and the
refusals."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import Generator
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import ModelConfigError
from compiled_engine.executor.compilation import CompiledForward
from compiled_engine.executor.runner import Runner
from compiled_engine.linear import packed_cpu
from compiled_engine.linear.quantized_experts import QuantizedExperts
from compiled_engine.llm import LLM
from compiled_engine.model.registry import check_shard, config_from_dict, config_from_model_dir
from compiled_engine.model.shard import TPShard
from reference_oracle import ReferenceOracle
from tests.conftest import TINY_LLAMA
from tests.test_moe_families import _dense_twin

SMALL: dict[str, Any] = dict(TINY_LLAMA, pad_token_id=0, num_hidden_layers=3)
MULTIPLIERS = {
    "embedding_multiplier": 4.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.5,
    "logits_scaling": 2.0,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "granitemoe": dict(SMALL, num_local_experts=6, num_experts_per_tok=3, intermediate_size=32, **MULTIPLIERS),
    "granitemoeshared": dict(
        SMALL, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.125, logits_scaling=4.0,
    ),
}  # fmt: skip
PROMPT_LENGTHS = (9, 33, 47)
NEW_TOKENS = 20
COMPILED = ("granitemoe",)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> tuple[str, Path]:
    return request.param, tiny_model_factory(request.param, seed=3, **VARIANTS[request.param])


@pytest.fixture(scope="module")
def oracle(variant: tuple[str, Path]) -> ReferenceOracle:
    return ReferenceOracle(variant[1])


@pytest.fixture(scope="module")
def golden(oracle: ReferenceOracle) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): oracle.greedy(p, NEW_TOKENS).token_ids for p in _prompts(1)}


def test_config_reads_the_multipliers_and_the_mixture(variant: tuple[str, Path]) -> None:
    name, model_dir = variant
    config, raw = config_from_model_dir(model_dir), VARIANTS[name]
    assert config.architecture == name and config.moe is not None
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (
        raw["embedding_multiplier"], raw["residual_multiplier"], raw["logits_scaling"],
    )  # fmt: skip
    assert config.softmax_scale == raw["attention_multiplier"]
    assert (config.moe.num_experts, config.moe.top_k) == (raw["num_local_experts"], raw["num_experts_per_tok"])
    assert config.moe.intermediate_size == 32 and config.moe.softmax_after_topk
    assert config.moe.shared_intermediate_size == raw.get("shared_intermediate_size", 0)
    assert not config.moe.shared_gate and config.moe.dense_layers == ()


def test_batched_chunked_greedy_matches_transformers(
    variant: tuple[str, Path], golden: dict[tuple[int, ...], list[int]]
) -> None:
    """Three prompts at once with prefill in chunks of 16 tokens, then each alone; compiled for
    Granite-MoE, eager for the shared variant."""
    compiled = variant[0] in COMPILED
    llm = LLM(model=str(variant[1]), page_size=4, num_pages=128, max_num_batched_tokens=16, enforce_eager=not compiled)
    assert llm.engine.runner.forward.compiled == compiled
    prompts = [list(p) for p in golden]
    outputs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == golden[tuple(prompt)]
    alone = llm.generate([prompts[0]], _greedy(), use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == golden[tuple(prompts[0])]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
@torch.inference_mode()
def test_logits_match_transformers(
    variant: tuple[str, Path], oracle: ReferenceOracle, eager: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The logits after the prompt; compiled, without the native head kernel, so that the one row
    goes through the head's own compiled entry (which must scale the logits too)."""
    if not eager and variant[0] not in COMPILED:
        pytest.skip("one variant carries the compiled checks")
    if not eager:
        monkeypatch.setattr(packed_cpu, "blocked_gemv_operator", lambda: None)
    runner = Runner(variant[1], EngineConfig(model=str(variant[1]), page_size=4, num_pages=64, enforce_eager=eager))
    assert isinstance(runner.forward, CompiledForward) != eager
    assert eager or runner.forward.one_row_head is not None
    prompt = _prompts(2)[1]
    [ours] = Generator(runner).generate([prompt], 8, record_logits=True)
    golden = oracle.greedy(prompt, 8)
    assert ours.token_ids == golden.token_ids
    assert ours.prefill_logits is not None
    torch.testing.assert_close(ours.prefill_logits, golden.prefill_logits, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_quantized_experts_run_as_their_dequantized_twin(variant: tuple[str, Path]) -> None:
    model_dir = variant[1]
    config = EngineConfig(model=str(model_dir), page_size=4, num_pages=64, enforce_eager=True, quantization="int8")
    runner = Runner(model_dir, config)
    assert all(isinstance(layer.mlp.experts, QuantizedExperts) for layer in runner.model.layers)
    prompt = _prompts(4)[1]
    [quantized] = Generator(runner).generate([prompt], 4, record_logits=True)
    for layer in runner.model.layers:
        layer.mlp.experts = _dense_twin(layer.mlp.experts)
    [twin] = Generator(runner).generate([prompt], 4, record_logits=True)
    assert quantized.token_ids == twin.token_ids
    assert quantized.prefill_logits is not None and twin.prefill_logits is not None
    torch.testing.assert_close(quantized.prefill_logits, twin.prefill_logits, atol=1e-4, rtol=1e-4)


def test_tensor_parallelism_is_refused_with_the_reason(variant: tuple[str, Path]) -> None:
    with pytest.raises(
        ModelConfigError, match=r"--tensor-parallel-size 2: not supported for granitemoe.*: its checkpoint fuses"
    ):
        check_shard(config_from_model_dir(variant[1]), TPShard(0, 2))


def _raw(**change: Any) -> dict[str, Any]:
    return {**VARIANTS["granitemoeshared"], "model_type": "granitemoeshared", **change}


def test_missing_multipliers_are_transformers_defaults_and_other_families_ignore_them() -> None:
    raw = {k: v for k, v in _raw().items() if k not in MULTIPLIERS}
    config = config_from_dict(raw)
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (1.0, 1.0, 1.0)
    assert config.softmax_scale == 1.0  # transformers' default attention_multiplier, not 1/sqrt(head_dim)
    llama = config_from_dict({**TINY_LLAMA, "model_type": "llama", **MULTIPLIERS, "residual_multiplier": -1})
    assert (llama.embedding_multiplier, llama.residual_multiplier, llama.logits_scaling) == (1.0, 1.0, 1.0)
    assert llama.softmax_scale == llama.head_dim**-0.5
    plain = config_from_dict({k: v for k, v in raw.items() if k != "shared_intermediate_size"})
    assert plain.moe is not None and plain.moe.shared_intermediate_size == 0
    unshared = config_from_dict({**raw, "model_type": "granitemoe"})  # the field is the shared variant's only
    assert unshared.moe is not None and unshared.moe.shared_intermediate_size == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"embedding_multiplier": 0}, "'embedding_multiplier' must be a positive number, got 0"),
        ({"residual_multiplier": -0.5}, "'residual_multiplier' must be a positive number, got -0.5"),
        ({"attention_multiplier": "1/64"}, "'attention_multiplier' must be a positive number, got '1/64'"),
        ({"logits_scaling": None}, "'logits_scaling' must be a positive number, got None"),
        ({"logits_scaling": True}, "'logits_scaling' must be a positive number, got True"),
        ({"embedding_multiplier": float("nan")}, "'embedding_multiplier' must be a positive number, got nan"),
        ({"num_local_experts": None}, "'num_local_experts' must be a positive integer"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than the 4 experts"),
        ({"intermediate_size": 0}, "'intermediate_size' must be positive"),
        ({"shared_intermediate_size": -48}, "'shared_intermediate_size' must be a positive integer"),
        ({"model_type": "granitemoehybrid"}, "model_type='granitemoehybrid'.*hybrid Mamba and attention layers"),
    ],
)
def test_bad_granite_configs_are_refused_by_name(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        config_from_dict(_raw(**change))
