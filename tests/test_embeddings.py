"""Pooling (`--runner pooling`): prompts pooled into embeddings through the scheduler (chunked,
batched, prefix-cached where the pooling allows), against transformers' hidden states; and
`/v1/embeddings` on a real server."""

from __future__ import annotations

import base64
import json
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.pooler import PoolingConfig
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import ModelConfigError, RequestError
from compiled_engine.pooling.embedding import pooling_config
from tests.conftest import API_KEY
from tests.server_process import ServerProcess, running_server

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


# -- /v1/embeddings on a real server -----------------------------------------------------------

KEY = "embeddings-key"
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors."]


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("pooling"), "--api-key", KEY, "--runner", "pooling", "--kv-cache-memory-gib", "0.05"
    ) as process:
        yield process


def test_embeddings_are_the_last_tokens_normalized_hidden_states(
    pooling_server: ServerProcess, default_oracle: Any
) -> None:
    client = openai.OpenAI(base_url=f"{pooling_server.url}/v1", api_key=KEY, max_retries=0)
    reply = client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS)
    assert [item.index for item in reply.data] == [0, 1] and reply.object == "list"
    ids = [default_oracle.encode(text, chat=False) for text in TEXTS]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(i) for i in ids)
    for item, prompt in zip(reply.data, ids, strict=True):
        with torch.no_grad():
            states = default_oracle.model.model(torch.tensor([prompt])).last_hidden_state[0]
        expected = torch.nn.functional.normalize(states[-1], dim=-1)
        torch.testing.assert_close(torch.tensor(item.embedding), expected, atol=2e-4, rtol=1e-3)
    # Token ids give the same vectors; base64 is the same floats; dimensions keep the first
    # values, renormalized.
    as_ids = client.embeddings.create(model="SmolLM2-135M-Instruct", input=ids)
    for by_ids, by_text in zip(as_ids.data, reply.data, strict=True):
        assert by_ids.embedding == pytest.approx(by_text.embedding, abs=1e-6)
    one = httpx.post(
        f"{pooling_server.url}/v1/embeddings",
        json={"input": ids[0], "encoding_format": "base64"},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    raw = base64.b64decode(one["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert decoded == pytest.approx(reply.data[0].embedding, abs=1e-6)
    short = client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS[0], dimensions=32).data[0].embedding
    first = torch.tensor(reply.data[0].embedding[:32])
    assert len(short) == 32 and short == pytest.approx((first / first.norm()).tolist(), abs=1e-5)


GOOD = {"input": "hello"}


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"input": []}, 400, "must not be empty"),
        ({"input": ["a", 3]}, 400, "a list of strings or of token-id lists"),
        ({"input": [[1, 2], "x", [True]]}, 400, "a list of strings or of token-id lists"),
        ({"input": "hi", "dimensions": 0}, 400, "dimensions must be in [1, 576]"),
        ({"input": "hi", "dimensions": 10_000}, 400, "dimensions must be in [1, 576]"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "hi", "colour": "red"}, 400, "unknown field"),
        ({"input": [10**7]}, 400, "vocab"),
        ({"input": "hi", "model": "text-embedding-3-small"}, 404, "does not exist"),
    ],
)
def test_bad_embedding_requests_are_refused_and_the_server_keeps_serving(
    pooling_server: ServerProcess, body: dict[str, Any], status: int, message: str
) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{pooling_server.url}/v1/embeddings", json=body, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    assert httpx.post(f"{pooling_server.url}/v1/embeddings", json=GOOD, headers=headers, timeout=60).status_code == 200


def test_generation_routes_refuse_on_a_pooling_server_and_embeddings_on_a_generating_one(
    pooling_server: ServerProcess, api_server: ServerProcess
) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    refused = httpx.post(f"{pooling_server.url}/v1/chat/completions", json=chat, headers=headers, timeout=60)
    assert refused.status_code == 400 and "serves /v1/embeddings" in refused.json()["error"]["message"]
    messages = httpx.post(
        f"{pooling_server.url}/v1/messages", json={**chat, "model": "SmolLM2-135M-Instruct"}, headers={"x-api-key": KEY}
    )
    assert messages.status_code == 400 and messages.json()["error"]["type"] == "invalid_request_error"
    generating = httpx.post(
        f"{api_server.url}/v1/embeddings", json={"input": "hi"}, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert generating.status_code == 400 and "--runner pooling" in generating.json()["error"]["message"]
