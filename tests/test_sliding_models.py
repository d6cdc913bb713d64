"""Tiny random-weight Mistral (a sliding window on every layer) and Gemma 2 (sliding and full
layers alternating, attention logits soft-capped) written by transformers: the runner hands each
layer's window and soft-cap to the attention backend, and the cpu and torch backends reproduce
transformers' greedy ids and logits with prompts longer than the window."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from compiled_engine.attention.backend import AttentionBackend, AttentionShape
from compiled_engine.attention.selector import get_backend
from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import Generator
from compiled_engine.executor import runner as model_runner
from compiled_engine.executor.runner import Runner
from reference_oracle import ReferenceOracle

VARIANTS = {
    "mistral": ("mistral", {"sliding_window": 6}),
    "gemma2": (
        "gemma2",
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "sliding_window": 5,
            "attn_logit_softcapping": 5.0,  # small, so that it bites
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
        },
    ),
}
KINDS = {"mistral": ((6, 0.0),), "gemma2": ((0, 5.0), (5, 5.0))}


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_ids_match_transformers(tiny_model_factory: Callable[..., Path], variant: str, backend: str) -> None:
    model_type, overrides = VARIANTS[variant]
    model_dir = tiny_model_factory(model_type, seed=3, **overrides)
    config = EngineConfig(model=str(model_dir), page_size=4, num_pages=128, attention_backend=backend)
    runner = Runner(model_dir, config)
    assert runner.backend.name == backend  # no fallback: both run the layers' kinds
    oracle = ReferenceOracle(model_dir)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, runner.model_config.vocab_size, (n,), generator=g).tolist() for n in (1, 5, 13, 33)]
    results = Generator(runner).generate(prompts, 16, record_logits=True)
    for prompt, ours in zip(prompts, results, strict=True):
        golden = oracle.greedy(prompt, 16)
        assert ours.token_ids == golden.token_ids
        assert ours.prefill_logits is not None
        torch.testing.assert_close(ours.prefill_logits, golden.prefill_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_runner_gives_the_backend_the_layer_kinds(
    tiny_model_factory: Callable[..., Path], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_type, overrides = VARIANTS[variant]
    model_dir = tiny_model_factory(model_type, seed=3, **overrides)
    shapes: list[AttentionShape] = []

    def recording_get_backend(name: str | None, shape: AttentionShape) -> AttentionBackend[Any]:
        shapes.append(shape)
        return get_backend(name, shape)

    monkeypatch.setattr(model_runner, "get_backend", recording_get_backend)
    runner = Runner(model_dir, EngineConfig(page_size=4, num_pages=32, enforce_eager=True))
    [shape] = shapes
    assert shape.layer_kinds == KINDS[variant]
    assert shape.softmax_scale == runner.model_config.softmax_scale
