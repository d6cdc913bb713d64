"""Speculative decoding (speculative/): prompt-lookup drafts verified in one forward. Greedy and
seeded output equal the output without speculation token for token (eager and compiled, alone
and batched, through preemption); the sampled distribution is the same; stops inside an
accepted run end the output there; rejected drafts leave no pages behind."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.config import EngineConfig
from compiled_engine.speculative.config import SpeculativeConfig
from compiled_engine.speculative.ngram import propose_ngram

# No batch-size limit: the tests batch up to 40 speculating sequences.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
    "disable_by_batch_size": None,
}
# On the tiny random-weight model output hardly repeats: single-token lookups give drafts that
# are almost always wrong (the rejection path).
WRONG_DRAFTS = {**NGRAM, "prompt_lookup_min": 1}
TINY_PROMPTS = [[5, 6, 7, 8, 9] * 5, [40, 41, 42, 40, 41, 42, 40, 41], [11, 300, 17, 250, 3, 90, 61, 7]]
# The default model continues these loops, so there the drafts are mostly right.
LOOPS = ["1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2", "red green blue red green blue red green blue red"]


def test_ngram_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], 2, 4, 3) == [4, 1, 2]  # the later [1, 2, 3]
    assert propose_ngram([1, 2, 5, 3, 2, 9, 3, 2], 2, 4, 2) == [9, 3]  # only the 2-gram [3, 2] recurs
    assert propose_ngram([1, 2, 3, 4, 5], 2, 4, 3) == []
    assert propose_ngram([7, 7, 7, 7], 2, 3, 4) == [7, 7, 7, 7]  # a loop runs on into the draft
    assert propose_ngram([1, 2, 1, 2], 3, 4, 2) == []  # shorter than prompt_lookup_min


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"method": "eagle"}', "method 'eagle' is not supported"),
        ('{"method": "draft_model", "model": "x"}', "method 'draft_model' is not supported"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be at least 1"),
        (
            '{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ('{"method": "ngram", "lookahead": 3}', "unknown field `lookahead`"),
        ("ngram", "not JSON"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_bad_speculative_configs_are_refused_before_any_work(config: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)


def test_the_config_reads_vllms_shape() -> None:
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 6}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 1, 6)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


def _llm(model_dir: Path | None, speculative: dict[str, Any] | None, **options: Any) -> LLM:
    """Eager unless told; the tiny model in a small pool of small pages."""
    tiny = {"page_size": 4, "num_pages": 64, "max_num_batched_tokens": 64} if model_dir is not None else {}
    return LLM(
        str(model_dir) if model_dir is not None else None,
        speculative_config=speculative,
        **{"enforce_eager": True, "kv_cache_memory_gib": 0.05, **tiny, **options},
    )


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> LLM:
    return _llm(model_dir, None)


@pytest.fixture(scope="module")
def spec(model_dir: Path) -> LLM:
    return _llm(model_dir, WRONG_DRAFTS)


@pytest.fixture(scope="module")
def smol_plain(default_model_dir: Path) -> LLM:
    return _llm(None, None)


@pytest.fixture(scope="module")
def smol_spec(default_model_dir: Path) -> LLM:
    return _llm(None, NGRAM)


def _ids(llm: LLM, prompts: list[Any], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def _pool_is_whole(llm: LLM) -> None:
    manager = llm.engine.block_manager
    assert manager.num_free_pages == manager.num_pages
    manager.check_consistency([])
    assert not llm.engine.has_unfinished_requests()


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_greedy_output_is_unchanged_alone_and_batched(smol_plain: LLM, smol_spec: LLM) -> None:
    expected = _ids(smol_plain, LOOPS, GREEDY)
    for prompt, want in zip(LOOPS, expected, strict=True):
        assert _ids(smol_spec, [prompt], GREEDY) == [want]
    assert _ids(smol_spec, LOOPS, GREEDY) == expected
    stats = smol_spec.engine.speculative_stats
    assert stats.accepted_tokens > stats.draft_tokens / 2  # mostly accepted: whole runs verified
    assert stats.accepted_at[0] >= stats.accepted_at[-1] > 0 and 2 < stats.mean_acceptance_length <= 5
    _pool_is_whole(smol_spec)


def test_mostly_wrong_drafts_change_nothing(plain: LLM, spec: LLM) -> None:
    expected = _ids(plain, TINY_PROMPTS, GREEDY)
    assert _ids(spec, TINY_PROMPTS, GREEDY) == expected
    assert [_ids(spec, [prompt], GREEDY)[0] for prompt in TINY_PROMPTS] == expected
    stats = spec.engine.speculative_stats
    assert stats.draft_tokens > 3 * stats.accepted_tokens  # rejected: the rollback ran
    _pool_is_whole(spec)


def test_each_request_reports_its_own_drafts(smol_spec: LLM) -> None:
    [out] = smol_spec.generate([LOOPS[0]], GREEDY, use_tqdm=False)
    assert out.metrics.num_draft_tokens >= out.metrics.num_accepted_tokens > 0
    [none] = smol_spec.generate([LOOPS[0]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert none.metrics.num_draft_tokens == 0  # one token to make: no room for a draft


def test_seeded_sampling_is_unchanged_token_for_token(smol_plain: LLM, smol_spec: LLM) -> None:
    """Each verified row is drawn by the ordinary sampler with the noise of its position, so
    penalties, top-k/top-p/min-p and seeds act at every position as without speculation."""
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=5, min_p=0.05, seed=4, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.2, seed=5, max_tokens=20),
    ]
    prompts = [LOOPS[0], LOOPS[1], LOOPS[0]]
    accepted = smol_spec.engine.speculative_stats.accepted_tokens
    assert _ids(smol_spec, prompts, params) == _ids(smol_plain, prompts, params)
    assert smol_spec.engine.speculative_stats.accepted_tokens > accepted


def test_logprobs_and_min_tokens_apply_at_every_verified_position(smol_plain: LLM, smol_spec: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, logprobs=2)
    want = smol_plain.generate([LOOPS[1]], params, use_tqdm=False)[0].outputs[0]
    got = smol_spec.generate([LOOPS[1]], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert got.logprobs is not None and want.logprobs is not None
    for mine, theirs in zip(got.logprobs, want.logprobs, strict=True):
        assert mine.top_token_ids == theirs.top_token_ids
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)


def test_the_sampled_distribution_is_the_target_distribution(smol_plain: LLM, smol_spec: LLM) -> None:
    """Two samples of 200 requests each, with different seeds: the tokens at output position 4
    (drawn in verification, the drafts before it accepted or not) follow one distribution.
    Pearson's two-sample chi-square at the 0.1% level (Wilson-Hilferty's critical value)."""
    prompt = LOOPS[1]
    draws, at_once = 200, 40

    def sample(llm: LLM, first_seed: int) -> Counter[int]:
        found: Counter[int] = Counter()
        for start in range(0, draws, at_once):
            seeds = range(first_seed + start, first_seed + start + at_once)
            params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True) for seed in seeds]
            found.update(ids[4] for ids in _ids(llm, [prompt] * at_once, params))
        return found

    stats = smol_spec.engine.speculative_stats
    drafted, accepted = stats.draft_tokens, stats.accepted_tokens
    ours, theirs = sample(smol_spec, 0), sample(smol_plain, 10_000)
    assert stats.draft_tokens > drafted + draws // 2 and stats.accepted_tokens > accepted
    tokens = [t for t in ours.keys() | theirs.keys() if ours[t] + theirs[t] >= 10]  # cells with enough counts
    rest_ours = draws - sum(ours[t] for t in tokens)
    rest_theirs = draws - sum(theirs[t] for t in tokens)
    cells = [(ours[t], theirs[t]) for t in tokens] + [(rest_ours, rest_theirs)]
    cells = [(a, b) for a, b in cells if a + b > 0]
    statistic = sum((a - b) ** 2 / (a + b) for a, b in cells)  # equal sample sizes
    df = len(cells) - 1
    assert df >= 2, "too few distinct tokens to test"
    z = 3.09  # the 0.1% upper quantile of the standard normal
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert statistic < critical, f"chi-square {statistic:.1f} above {critical:.1f} with {df} degrees of freedom"


def test_max_tokens_and_stops_inside_an_accepted_run_end_the_output_there(smol_plain: LLM, smol_spec: LLM) -> None:
    full = _ids(smol_plain, [LOOPS[0]], GREEDY)[0]
    for max_tokens in (2, 3, 6, 7):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert _ids(smol_spec, [LOOPS[0]], params) == [full[:max_tokens]]
    stop = full[9]  # a token well inside the drafts' runs
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop,))
    [got] = smol_spec.generate([LOOPS[0]], params, use_tqdm=False)
    assert got.outputs[0].token_ids == full[: full.index(stop) + 1]
    assert got.outputs[0].finish_reason == "stop" and got.outputs[0].stop_reason == stop
    text = smol_plain.tokenizer.decode(full[:12])
    words = SamplingParams(temperature=0, max_tokens=24, stop=[text[-4:]])
    assert smol_spec.generate([LOOPS[0]], words, use_tqdm=False)[0].outputs[0].text == (
        smol_plain.generate([LOOPS[0]], words, use_tqdm=False)[0].outputs[0].text
    )
    _pool_is_whole(smol_spec)


def test_preemption_and_aborts_leave_no_pages_behind(model_dir: Path, plain: LLM) -> None:
    small = _llm(model_dir, WRONG_DRAFTS, num_pages=24)  # 96 slots: six sequences of ~50 tokens preempt
    prompts = [TINY_PROMPTS[i % 2] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert _ids(small, prompts, params) == _ids(plain, prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    _pool_is_whole(small)
    engine = small.engine
    ids = [engine.add_request(prompt, params) for prompt in prompts[:3]]
    for _ in range(4):
        engine.step()
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    _pool_is_whole(small)


def test_compiled_speculation_equals_eager_and_never_recompiles(model_dir: Path, plain: LLM) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = _llm(model_dir, WRONG_DRAFTS, enforce_eager=False, compile_cache=False)
    graphs = counters["stats"]["unique_graphs"]
    assert _ids(compiled, TINY_PROMPTS, GREEDY) == _ids(plain, TINY_PROMPTS, GREEDY)
    assert _ids(compiled, [TINY_PROMPTS[1]], GREEDY) == _ids(plain, [TINY_PROMPTS[1]], GREEDY)
    assert compiled.engine.speculative_stats.draft_tokens > 0
    assert counters["stats"]["unique_graphs"] == graphs, "verifying drafts recompiled"


def test_each_step_drafts_afresh_and_not_above_the_batch_size() -> None:
    from compiled_engine.engine.sequence import Sequence
    from compiled_engine.speculative.drafts import propose_drafts

    config = SpeculativeConfig.parse({**NGRAM, "disable_by_batch_size": 1})
    params = SamplingParams(temperature=0, max_tokens=50)
    seqs = [Sequence(i, [1, 2, 3, 1, 2], params) for i in range(2)]
    for seq in seqs:
        seq.num_computed_tokens = 4  # decoding: its last token not computed yet
    propose_drafts(config, seqs[:1], 100)
    assert seqs[0].draft_token_ids == [3, 1, 2, 3]
    propose_drafts(config, seqs, 100)  # two running: above the limit
    assert seqs[0].draft_token_ids == [] and seqs[1].draft_token_ids == []  # the kept draft is dropped


def test_speculation_switches_off_above_the_batch_size_and_when_rejected(model_dir: Path) -> None:
    capped = _llm(model_dir, {**WRONG_DRAFTS, "disable_by_batch_size": 2})
    _ids(capped, TINY_PROMPTS, GREEDY)  # three at once: no drafts while all three run
    alone = capped.engine.speculative_stats.draft_tokens
    _ids(capped, [TINY_PROMPTS[0]], GREEDY)
    assert capped.engine.speculative_stats.draft_tokens > alone
    picky = _llm(model_dir, {**WRONG_DRAFTS, "min_acceptance_rate": 1.0, "acceptance_probe": 4})
    [out] = picky.generate([TINY_PROMPTS[2]], GREEDY, use_tqdm=False)
    assert 4 <= out.metrics.num_draft_tokens < 8  # it stopped after the first rejections


def test_the_server_speculates_with_the_same_output_and_reports_it(smol_plain: LLM, tmp_path: Path) -> None:
    import httpx

    from tests.server_process import running_server

    expected = smol_plain.generate([LOOPS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
    args = ["--kv-cache-memory-gib", "0.05", "--enforce-eager", "--speculative-config", json.dumps(NGRAM)]
    with running_server(tmp_path, *args) as server:
        body = {"prompt": LOOPS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
        metrics = httpx.get(f"{server.url}/metrics").text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("compiled_engine_spec")
    }
    assert values["compiled_engine_spec_decode_accepted_tokens_total"] > 0
    assert (
        values["compiled_engine_spec_decode_draft_tokens_total"]
        >= values["compiled_engine_spec_decode_accepted_tokens_total"]
    )
    assert values['compiled_engine_spec_decode_accepted_tokens_per_position_total{position="0"}'] > 0
    assert 1 < values["compiled_engine_spec_decode_mean_acceptance_length"] <= 5


def test_bench_spec_reports_each_workload_on_against_off(default_model_dir: Path, tmp_path: Path) -> None:
    from compiled_engine.bench.__main__ import main

    out = tmp_path / "spec.json"
    args = ["spec", "--enforce-eager", "--kv-cache-memory-gib", "0.05", "--num-requests", "1", "--concurrency", "2"]
    assert main([*args, "--output-len", "12", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    for name in ("repetitive", "random", "concurrent"):
        assert results[f"{name}_off"] > 0 and results[f"{name}_on"] > 0
        assert results[f"{name}_ratio"] == pytest.approx(results[f"{name}_on"] / results[f"{name}_off"])
    assert results["repetitive_draft_tokens"] > 0 and 0 < results["repetitive_acceptance_rate"] <= 1
    assert json.loads(report["workload"]["speculative_config"])["method"] == "ngram"
    assert main(["spec", "--num-requests", "0"]) != 0  # a bad count is refused before any work
