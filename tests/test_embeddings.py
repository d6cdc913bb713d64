"""Pooling (`--runner pooling`): prompts pooled into embeddings through the scheduler (chunked,
batched, prefix-cached where the pooling allows), against transformers' hidden states; and
`/v1/embeddings` on a real server."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.pooling import PoolingConfig, pooling_config
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import ModelConfigError, RequestError

PROMPTS = [[5, 9, 17, 3, 22, 41, 7, 8, 12, 30, 2], [11, 4, 6], [9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


def _with_pooling(source: Path, target: Path, mode: str | None, normalize: bool) -> Path:
    """A copy of the model with sentence-transformers files for `mode` (None: no files)."""
    shutil.copytree(source, target)
    if mode is None:
        return target
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (target / "modules.json").write_text(json.dumps(modules))
    (target / "1_Pooling").mkdir()
    flags = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
    settings = {key: value == mode for key, value in flags.items()}
    (target / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **settings}))
    return target


def _expected(model_dir: Path, prompt: list[int], config: PoolingConfig) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        states = model(torch.tensor([prompt])).last_hidden_state[0]
    pooled = {"mean": states.mean(dim=0), "cls": states[0], "last": states[-1]}[config.mode]
    return torch.nn.functional.normalize(pooled, dim=-1) if config.normalize else pooled


def _pool(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, Any]:
    ids = [engine.add_pooling_request(prompt) for prompt in prompts]
    finals: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return {request_id: finals[request_id] for request_id in ids}


@pytest.mark.parametrize(
    ("mode", "normalize"),
    [("mean", True), ("cls", False), ("last", True), (None, True)],
    ids=["mean", "cls", "last", "default"],
)
def test_pooled_prompts_match_transformers_chunked_and_batched(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, mode: str | None, normalize: bool
) -> None:
    model_dir = _with_pooling(tiny_model_factory("llama"), tmp_path / "model", mode, normalize)
    config = pooling_config(model_dir)
    assert config == PoolingConfig(mode or "last", normalize)
    # Eight tokens a step: the longer prompts are pooled over several chunks, beside each other.
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            runner="pooling",
            enforce_eager=True,
            page_size=4,
            num_pages=64,
            max_num_batched_tokens=8,
        )
    )
    finals = _pool(engine, PROMPTS)
    for prompt, output in zip(PROMPTS, finals.values(), strict=True):
        assert output.finish_reason == "stop" and output.token_ids == [] and output.prompt_token_ids == prompt
        got = torch.tensor(output.embedding)
        torch.testing.assert_close(got, _expected(model_dir, prompt, config), atol=2e-5, rtol=2e-5)
    # A repeated prompt: last-token pooling takes the prefix cache's pages, mean and CLS pooling
    # recompute every token; the embedding is the same either way.
    again = next(iter(_pool(engine, [PROMPTS[2]]).values()))
    assert again.embedding == pytest.approx(finals[next(reversed(finals))].embedding, abs=1e-5)
    assert (again.num_cached_tokens > 0) == (config.mode == "last")


def test_each_runner_refuses_the_others_requests(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("llama")
    pooling = LLMEngine(
        EngineConfig(model=str(model_dir), runner="pooling", enforce_eager=True, page_size=4, num_pages=16)
    )
    with pytest.raises(RequestError, match="makes embeddings, not text"):
        pooling.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match=r"out of range|vocabulary"):
        pooling.add_pooling_request([10**6])
    assert not pooling.has_unfinished_requests()
    generating = LLMEngine(EngineConfig(model=str(model_dir), enforce_eager=True, page_size=4, num_pages=16))
    with pytest.raises(RequestError, match="makes no embeddings"):
        generating.add_pooling_request([1, 2, 3])
    with pytest.raises(ValueError, match="runner must be one of generate, pooling"):
        EngineConfig(runner="embed")
    with pytest.raises(ValueError, match="cannot run with runner pooling"):
        EngineConfig(runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_broken_sentence_transformers_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text(
        json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True})
    )
    with pytest.raises(ModelConfigError, match="must be true"):
        pooling_config(tmp_path)
    (tmp_path / "modules.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="cannot read"):
        pooling_config(tmp_path)
