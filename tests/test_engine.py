"""LLMEngine and the LLM API: sampling features end to end, seeds that ignore batch mates, n > 1,
logprobs, aborts in every state, request validation, metrics and the progress bar."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.errors import ModelConfigError, PromptError, PromptProblem, RequestError
from reference_oracle import ReferenceOracle


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[..., Path]) -> LLM:
    return LLM(model=str(tiny_model_factory("llama")), page_size=4, num_pages=48, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def smol(default_model_dir: Path) -> LLM:
    return LLM(kv_cache_memory_gib=0.05)


def _pool_is_whole(llm: LLM) -> None:
    manager = llm.engine.block_manager
    assert manager.num_free_pages == manager.num_pages
    manager.check_consistency([])
    assert not llm.engine.has_unfinished_requests()


PROMPTS = [[5, 9, 13, 200, 7], list(range(30, 60)), [1], [100, 101, 102, 103, 104, 105, 106, 107, 108]]


def test_seeded_sampling_ignores_batch_mates(tiny: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    alone = tiny.generate([PROMPTS[1]], params, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=20), SamplingParams(temperature=0, max_tokens=5)]
    crowd = tiny.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], [others[0], params, others[1]], use_tqdm=False)
    assert crowd[1].token_ids == alone
    unseeded = [
        tiny.generate([PROMPTS[1]], SamplingParams(temperature=1.0, max_tokens=12), use_tqdm=False)[0].token_ids
        for _ in range(3)
    ]
    assert len({tuple(t) for t in unseeded}) > 1  # without a seed, runs differ
    _pool_is_whole(tiny)


def test_n_completions_share_the_prompt_and_differ(tiny: LLM) -> None:
    [out] = tiny.generate(
        [PROMPTS[1]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    [again] = tiny.generate(
        [PROMPTS[1]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    _pool_is_whole(tiny)


def test_greedy_logprobs_match_the_reference(tiny: LLM, tiny_model_factory: Callable[..., Path]) -> None:
    prompt = PROMPTS[3]
    [out] = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)
    assert out.logprobs is not None and len(out.logprobs) == 4
    reference = torch.log_softmax(ReferenceOracle(tiny_model_factory("llama")).logits(prompt + out.token_ids[:-1]), -1)
    for step, entry in enumerate(out.logprobs):
        row = reference[len(prompt) - 1 + step]
        assert entry.token_id == out.token_ids[step] == int(row.argmax())
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert entry.top_token_ids == row.topk(3).indices.tolist()
        assert entry.top_logprobs == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


def test_stop_token_ids_and_min_tokens(tiny: LLM) -> None:
    greedy = tiny.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].token_ids
    stop_at = greedy[1]
    [out] = tiny.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_at]), use_tqdm=False
    )
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_at], min_tokens=4)
    [late] = tiny.generate([PROMPTS[0]], params, use_tqdm=False)
    assert stop_at not in late.token_ids[:4] and len(late.token_ids) >= 4


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding"])
def test_abort_in_every_state(tiny: LLM, state: str) -> None:
    engine = tiny.engine
    busy = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40))
    long_prompt = list(range(100, 160))
    target = engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=40))
    if state != "waiting":
        for _ in range(200):  # capped: a regression fails instead of hanging
            engine.step()
            seq = engine._requests[target].seqs[0]
            if state == "prefilling" and seq.num_computed_tokens > 0 and seq.is_prefilling:
                break
            if state == "decoding" and seq.output_token_ids:
                break
        else:
            pytest.fail(f"the request never reached {state}")
    engine.abort_request(target)
    outputs = engine.step()
    aborted = [o for o in outputs if o.request_id == target]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    engine.abort_request(busy)
    engine.step()
    _pool_is_whole(tiny)


@pytest.mark.parametrize(
    ("prompt", "params", "message", "problem", "param"),
    [
        ([], SamplingParams(), "the prompt is empty", PromptProblem.EMPTY, "prompt"),
        (
            [5, 999],
            SamplingParams(),
            "token id 999 is outside the vocabulary (0..319) at prompt position 1",
            PromptProblem.OUT_OF_VOCABULARY,
            "prompt",
        ),
        (
            [-1],
            SamplingParams(),
            "token id -1 is outside the vocabulary (0..319) at prompt position 0",
            PromptProblem.OUT_OF_VOCABULARY,
            "prompt",
        ),
        (
            list(range(190)),
            SamplingParams(max_tokens=10),
            "the prompt has 190 tokens and max_tokens is 10: 200 exceeds the context length 192",
            PromptProblem.CONTEXT_LENGTH_EXCEEDED,
            "max_tokens",
        ),
        # The prompt alone fills the context: no max_tokens would help, so the message is about the prompt.
        (
            list(range(250)),
            SamplingParams(max_tokens=10),
            "the prompt has 250 tokens; this model's context length is 192 tokens",
            PromptProblem.TOO_LONG,
            "prompt",
        ),
        (
            list(range(192)),
            SamplingParams(max_tokens=1),
            "the prompt has 192 tokens; this model's context length is 192 tokens",
            PromptProblem.TOO_LONG,
            "prompt",
        ),
        ("text", SamplingParams(), "has no tokenizer: pass token ids", PromptProblem.NO_TOKENIZER, "prompt"),
        (
            [1, 2],
            SamplingParams(stop=["x"]),
            "stop strings need a tokenizer; this model has none",
            PromptProblem.NO_TOKENIZER,
            "stop",
        ),
        (
            [True, 1],
            SamplingParams(),
            "a token-id prompt must be a list of integers; item 0 is bool True",
            PromptProblem.NOT_TOKEN_IDS,
            "prompt",
        ),
        (
            5,
            SamplingParams(),
            "a prompt must be a string or a list of token ids, got int",
            PromptProblem.NOT_TOKEN_IDS,
            "prompt",
        ),
    ],
)
def test_bad_requests_are_refused_clearly(
    tiny: LLM, prompt: list[int] | str, params: SamplingParams, message: str, problem: PromptProblem, param: str
) -> None:
    free = tiny.engine.block_manager.num_free_pages
    with pytest.raises(PromptError, match=re.escape(message)) as refused:
        tiny.engine.add_request(prompt, params)
    assert refused.value.problem is problem and refused.value.param == param
    assert not tiny.engine.has_unfinished_requests() and not tiny.engine.scheduler.waiting
    assert tiny.engine.block_manager.num_free_pages == free


def test_a_prompt_that_just_fits_the_context_is_accepted(tiny: LLM) -> None:
    [out] = tiny.generate(
        [list(range(182))], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    assert len(out.token_ids) == 10  # 182 + 10 = 192, the context length
    _pool_is_whole(tiny)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature must be finite and >= 0"),
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"top_p": 0}, "top_p must be in"),
        ({"top_k": -2}, "top_k must be"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens must be in"),
        ({"n": 0}, "n must be at least 1"),
        ({"logprobs": 21}, "logprobs must be in"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"presence_penalty": 3}, "presence_penalty must be in"),
        ({"repetition_penalty": 0}, "repetition_penalty must be finite and > 0"),
        ({"seed": -1}, "seed must be in"),
        ({"stop_token_ids": [-3]}, "stop_token_ids must be non-negative"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(RequestError, match=message) as refused:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert refused.value.param == message.split()[0]  # the field at fault, for the server's `param`


def test_context_is_capped_to_what_the_kv_cache_holds(tiny: LLM, tiny_model_factory: Callable[..., Path]) -> None:
    # 48 pages of 4 tokens: a 256-position model can only be offered 192 tokens of context.
    assert tiny.engine.max_model_len == 192
    with pytest.raises(
        ModelConfigError, match="max_model_len=256 needs 256 tokens of KV cache, but 48 pages of 4 hold 192"
    ):
        LLM(model=str(tiny_model_factory("llama")), page_size=4, num_pages=48, max_model_len=256)


def test_duplicate_request_id_and_param_count(tiny: LLM) -> None:
    tiny.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="same")
    with pytest.raises(RequestError, match="request id 'same' is already in use"):
        tiny.engine.add_request([1, 2, 3], request_id="same")
    for _ in range(100):
        if not tiny.engine.has_unfinished_requests():
            break
        tiny.engine.step()
    assert not tiny.engine.has_unfinished_requests()
    with pytest.raises(RequestError, match="2 sampling params given for 3 prompts"):
        tiny.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])
    with pytest.raises(RequestError, match="a prompt must be a string or a list of token ids"):
        tiny.generate([[1], 5.0])  # type: ignore[list-item]
    _pool_is_whole(tiny)


def test_a_rejected_prompt_in_a_batch_leaves_nothing_behind(tiny: LLM) -> None:
    with pytest.raises(RequestError, match="the prompt is empty"):
        tiny.generate([[1, 2, 3], [4, 5], []], SamplingParams(max_tokens=3))
    _pool_is_whole(tiny)


def test_chat_answers_and_metrics(smol: LLM) -> None:
    [out] = smol.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=20)
    )
    assert "Paris" in out.text and out.finish_reason == "stop" and out.outputs[0].stop_reason is None
    m = out.metrics
    assert m is not None and m.queue_time is not None and m.ttft is not None and m.e2e is not None
    assert 0 <= m.queue_time <= m.ttft <= m.e2e
    assert m.tpot is not None and 0 < m.tpot < m.e2e
    [forced] = smol.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )
    assert forced.finish_reason == "length" and len(forced.token_ids) == 12
    assert forced.token_ids[: len(out.token_ids)] == out.token_ids
    assert forced.num_cached_tokens > 0  # the same chat prompt again: its full pages were cached


def test_stop_string_spanning_tokens_is_cut_and_never_shown(smol: LLM) -> None:
    prompt = "def fibonacci(n):"
    [full] = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    tokenizer = smol.engine.tokenizer
    assert tokenizer is not None
    pieces = [tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # A stop string made of the end of one token and the start of the next.
    k = next(
        i
        for i in range(2, len(pieces) - 1)
        if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i]) >= 2
    )
    stop = pieces[k][-2:] + pieces[k + 1][len(pieces[k]) : len(pieces[k]) + 2]
    expected = full.text[: full.text.index(stop)]
    engine = smol.engine
    request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop, "never-there"]))
    shown = []
    final = None
    for _ in range(100):  # 24 tokens at most: capped so that a regression fails instead of hanging
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            assert output.request_id == request_id
            shown.append(output.text)
            final = output
    assert not engine.has_unfinished_requests()
    assert final is not None and final.finished
    assert final.text == expected and final.finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert all(stop not in text and expected.startswith(text) for text in shown)


def test_progress_bar_only_when_asked(smol: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    smol.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "requests" not in capsys.readouterr().err
    smol.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=2))
    assert "requests" in capsys.readouterr().err


def test_an_error_inside_a_forward_ends_that_steps_requests_and_returns_every_page(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(tiny_model_factory("llama")), enforce_eager=True, page_size=4, num_pages=32)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7, 8, 9], params) for _ in range(2)]
    engine.step()  # both prefill
    run = engine.runner.execute
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a kernel failed")
        return run(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", failing)
    engine.step()
    with pytest.raises(RuntimeError, match="a kernel failed"):
        engine.step()
    manager = engine.block_manager
    assert manager.num_free_pages == manager.num_pages
    manager.check_consistency([])
    outputs = {out.request_id: out for out in engine.step()}  # the next step reports them ended
    assert set(outputs) == set(ids) and all(out.outputs[0].finish_reason == "abort" for out in outputs.values())
    assert not engine.has_unfinished_requests()
    later = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))  # it serves on
    done = [out for _ in range(10) for out in engine.step() if out.finished]
    assert [out.request_id for out in done] == [later]


def test_an_engine_without_the_optional_features_runs_their_no_op_seams(tiny: LLM) -> None:
    """No adapters: a request naming one is refused with its parameter and nothing is queued.
    No speculation: no drafts and no draft counts for the metrics."""
    from compiled_engine import LoRARequest

    engine = tiny.engine
    with pytest.raises(RequestError, match="serves no LoRA adapters: start it with enable_lora") as refused:
        engine.add_request([1, 2, 3], lora_request=LoRARequest("any", "/nonexistent"))
    assert refused.value.param == "lora_request"
    assert not engine.has_unfinished_requests()
    assert engine.drafter.snapshot() is None and engine.speculative_stats is None
    out = tiny.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    _pool_is_whole(tiny)


def test_a_feature_nobody_registered_is_refused_by_name(tiny_model_factory: Callable[..., Path]) -> None:
    """The registry names what it has when a config asks for something it lacks."""
    from compiled_engine.config import EngineConfig
    from compiled_engine.engine.feature_plan import REGISTRY, plan_features

    config = EngineConfig(model=str(tiny_model_factory("llama")), speculative_config={"method": "ngram"})
    saved = REGISTRY.drafters.pop("ngram")
    try:
        with pytest.raises(
            ModelConfigError, match=r"no speculative method 'ngram' is registered \(registered: draft_model\)"
        ):
            plan_features(config, tiny_model_factory("llama"))
    finally:
        REGISTRY.drafters["ngram"] = saved
    assert type(plan_features(config, tiny_model_factory("llama")).drafter).__name__ == "NgramDrafter"


def test_every_registered_feature_names_what_it_runs() -> None:
    """Registrations are names ("module:attribute"), imported only when picked: each must name a
    callable that exists, or the first engine to pick it would fail."""
    import compiled_engine.registrations  # noqa: F401  (the lines under test)
    from compiled_engine.engine.feature_plan import REGISTRY, _registered

    tables = {"drafters": REGISTRY.drafters, "adapters": REGISTRY.adapters, "grammars": REGISTRY.grammars}
    tables["poolers"] = REGISTRY.poolers
    found = {kind: sorted(table) for kind, table in tables.items()}
    assert found == {
        "drafters": ["draft_model", "ngram"],
        "adapters": ["lora"],
        "grammars": ["llguidance"],
        "poolers": ["embed"],
    }
    for kind, table in tables.items():
        for name in table:
            assert callable(_registered(table, name, kind)), (kind, name)
    table = {"broken": "compiled_engine.speculative.drafts:NoSuchDrafter.plan"}
    with pytest.raises(AttributeError, match="NoSuchDrafter"):
        _registered(table, "broken", "speculative method")
