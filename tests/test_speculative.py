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
from compiled_engine.config import EngineConfig, SpeculativeConfig
from compiled_engine.speculative.drafts import SpeculativeStats
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
        ('{"method": "draft_model"}', 'draft_model method needs "model"'),
        ('{"method": "ngram", "model": "x"}', '"model" is for the draft_model method'),
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
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 2})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/models/draft", 2)


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile with `df` degrees of freedom at the standard normal quantile `z`
    (3.09: the 0.1% upper tail), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_rejection_sampling_emits_the_target_distribution_whatever_the_draft() -> None:
    """A draft distribution q far from the target's p, over six tokens: the first emitted token
    (the draft's, accepted with probability min(1, p/q), or a draw from max(p - q, 0)) follows p
    (chi-square goodness of fit at the 0.1% level over 6000 seeds), and the draft is accepted
    as often as the sum of min(p, q) says."""
    from compiled_engine.engine.verifier import rejection_sample

    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04], [0.1, 0.1, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.05, 0.10, 0.15, 0.20, 0.20, 0.30]])
    draws = 6000
    generator = torch.Generator().manual_seed(0)
    drafted = torch.multinomial(q[0], draws, replacement=True, generator=generator).tolist()
    first: Counter[int] = Counter()
    accepted = 0
    for seed, token in enumerate(drafted):
        emitted = rejection_sample(p.log(), q, [token], seed, 0)
        first[emitted[0]] += 1
        accepted += len(emitted) == 2
    statistic = sum((first[t] - draws * float(p[0, t])) ** 2 / (draws * float(p[0, t])) for t in range(6))
    assert statistic < _chi_square_critical(5), f"chi-square {statistic:.1f}: {dict(first)}"
    rate = float(torch.minimum(p[0], q[0]).sum())  # 0.55
    assert abs(accepted / draws - rate) < 4 * math.sqrt(rate * (1 - rate) / draws)


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


def _since(llm: LLM, before: SpeculativeStats) -> SpeculativeStats:
    """The engine's speculative counts since `before` (a copy taken earlier): what a test's own
    requests did, whatever other tests ran on the module's engine first."""
    now = llm.engine.speculative_stats
    earlier = before.accepted_at + [0] * (len(now.accepted_at) - len(before.accepted_at))
    return SpeculativeStats(
        now.drafts - before.drafts,
        now.draft_tokens - before.draft_tokens,
        now.accepted_tokens - before.accepted_tokens,
        [n - e for n, e in zip(now.accepted_at, earlier, strict=True)],
    )


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _abort_midway(llm: LLM, prompts: list[Any], params: SamplingParams) -> None:
    """Start the requests, abort them after four steps (drafts verified and rolled back by
    then), and check that every page came back."""
    engine = llm.engine
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    for _ in range(4):
        engine.step()
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    _pool_is_whole(llm)


def test_greedy_output_is_unchanged_alone_and_batched(smol_plain: LLM, smol_spec: LLM) -> None:
    expected = _ids(smol_plain, LOOPS, GREEDY)
    before = smol_spec.engine.speculative_stats.copy()
    for prompt, want in zip(LOOPS, expected, strict=True):
        assert _ids(smol_spec, [prompt], GREEDY) == [want]
    assert _ids(smol_spec, LOOPS, GREEDY) == expected
    stats = _since(smol_spec, before)
    assert stats.accepted_tokens > stats.draft_tokens / 2  # mostly accepted: whole runs verified
    assert stats.accepted_at[0] >= stats.accepted_at[-1] > 0 and 2 < stats.mean_acceptance_length <= 5
    _pool_is_whole(smol_spec)


def test_mostly_wrong_drafts_change_nothing(plain: LLM, spec: LLM) -> None:
    expected = _ids(plain, TINY_PROMPTS, GREEDY)
    before = spec.engine.speculative_stats.copy()
    assert _ids(spec, TINY_PROMPTS, GREEDY) == expected
    assert [_ids(spec, [prompt], GREEDY)[0] for prompt in TINY_PROMPTS] == expected
    stats = _since(spec, before)
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


@pytest.mark.full  # the quick tier checks the rejection sampler's distribution on its own (above)
def test_the_sampled_distribution_is_the_target_distribution(smol_plain: LLM, smol_spec: LLM) -> None:
    """Two samples of 200 requests each, with different seeds: the tokens at output position 4
    (drawn in verification, the drafts before it accepted or not) follow one distribution.
    Pearson's two-sample chi-square at the 0.1% level (Wilson-Hilferty's critical value)."""
    prompt = LOOPS[1]
    draws, at_once = 200, 100

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
    critical = _chi_square_critical(df)
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
    _abort_midway(small, prompts[:3], params)


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


def test_the_draft_length_follows_each_sequences_acceptance() -> None:
    from compiled_engine.engine.sequence import Sequence
    from compiled_engine.speculative.drafts import propose_drafts, update_speculating

    config = SpeculativeConfig.parse(NGRAM)  # up to 4
    seq = Sequence(0, [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0, max_tokens=50))
    seq.num_computed_tokens = seq.num_tokens - 1
    lengths = []
    for drafted, accepted in [(4, 1), (3, 0), (2, 2), (4, 0), (3, 0), (2, 0), (1, 0), (1, 1)]:
        propose_drafts(config, [seq], 100)
        assert len(seq.draft_token_ids) == drafted  # the lookup always finds 4 here: the limit cuts it
        update_speculating(config, seq, drafted, accepted)
        lengths.append(seq.draft_length)
    assert lengths == [3, 2, 4, 3, 2, 1, 1, 3]
    fixed = SpeculativeConfig.parse({**NGRAM, "adaptive_draft_length": False})
    other = Sequence(1, list(seq.prompt_token_ids), seq.params)
    other.num_computed_tokens = other.num_tokens - 1
    update_speculating(fixed, other, 4, 0)
    propose_drafts(fixed, [other], 100)
    assert len(other.draft_token_ids) == 4


def test_speculation_switches_off_above_the_batch_size_and_when_rejected(model_dir: Path) -> None:
    capped = _llm(model_dir, {**WRONG_DRAFTS, "disable_by_batch_size": 2})
    _ids(capped, TINY_PROMPTS, GREEDY)  # three at once: no drafts while all three run
    alone = capped.engine.speculative_stats.draft_tokens
    _ids(capped, [TINY_PROMPTS[0]], GREEDY)
    assert capped.engine.speculative_stats.draft_tokens > alone
    picky = _llm(model_dir, {**WRONG_DRAFTS, "min_acceptance_rate": 1.0, "acceptance_probe": 4})
    [out] = picky.generate([TINY_PROMPTS[2]], GREEDY, use_tqdm=False)
    assert 4 <= out.metrics.num_draft_tokens < 8  # it stopped after the first rejections


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft_model", marks=pytest.mark.full)])
def test_the_server_speculates_with_the_same_output_and_reports_it(
    method: str, smol_plain: LLM, default_model_dir: Path, tmp_path: Path
) -> None:
    """The draft_model run drafts with the default model itself, so its drafts are accepted."""
    import httpx

    from tests.server_process import running_server

    expected = smol_plain.generate([LOOPS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
    config = NGRAM if method == "ngram" else _draft(default_model_dir, num_speculative_tokens=4)
    args = ["--kv-cache-memory-gib", "0.05", "--enforce-eager", "--speculative-config", json.dumps(config)]
    with running_server(tmp_path, *args) as server:
        body = {"prompt": LOOPS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
        metrics = httpx.get(f"{server.url}/metrics").text
    if method == "ngram":
        _every_dashboard_metric_is_exported(metrics)
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


# -- draft_model: a second model drafts, under the target's page ids --------------------------


def _draft(model: Path, **options: Any) -> dict[str, Any]:
    return {
        "method": "draft_model",
        "model": str(model),
        "num_speculative_tokens": 3,
        "disable_by_batch_size": None,
        **options,
    }


@pytest.fixture(scope="module")
def wrong_draft(model_dir: Path, tiny_model_factory: Callable[..., Path]) -> LLM:
    """Another random model of the same shape: its drafts are almost always rejected."""
    return _llm(model_dir, _draft(tiny_model_factory("llama", seed=1)))


@pytest.fixture(scope="module")
def self_draft(model_dir: Path) -> LLM:
    """The target drafting for itself: its greedy drafts are accepted."""
    return _llm(model_dir, _draft(model_dir))


@pytest.fixture(scope="module")
def near_draft_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's weights plus noise: a draft that is right often, but not always."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("near_draft")
    for source in model_dir.iterdir():
        if source.suffix != ".safetensors":
            (path / source.name).write_bytes(source.read_bytes())
    generator = torch.Generator().manual_seed(7)
    for source in model_dir.glob("*.safetensors"):
        tensors = load_file(source)
        noisy = {
            name: t + 0.03 * torch.randn(t.shape, generator=generator) if t.dim() > 1 else t
            for name, t in tensors.items()
        }
        save_file(noisy, path / source.name, metadata={"format": "pt"})
    return path


def test_a_draft_model_keeps_greedy_output_alone_and_batched(plain: LLM, wrong_draft: LLM, self_draft: LLM) -> None:
    expected = _ids(plain, TINY_PROMPTS, GREEDY)
    before = {llm: llm.engine.speculative_stats.copy() for llm in (wrong_draft, self_draft)}
    for llm in (wrong_draft, self_draft):
        assert _ids(llm, TINY_PROMPTS, GREEDY) == expected
        assert [_ids(llm, [prompt], GREEDY)[0] for prompt in TINY_PROMPTS] == expected
        _pool_is_whole(llm)
    wrong, right = _since(wrong_draft, before[wrong_draft]), _since(self_draft, before[self_draft])
    assert wrong.draft_tokens > 5 * wrong.accepted_tokens  # the rejection path
    assert right.accepted_tokens > 0.9 * right.draft_tokens  # whole runs accepted
    assert right.accepted_at[0] >= right.accepted_at[2] > 0 and right.mean_acceptance_length > 3


def test_a_draft_models_sampled_rows_keep_the_target_distribution(
    plain: LLM, model_dir: Path, near_draft_dir: Path
) -> None:
    """The tokens at output position 2, drawn after drafts accepted or replaced by rejection
    sampling, follow the distribution of plain sampling (two-sample chi-square at 0.1%)."""
    near = _llm(model_dir, _draft(near_draft_dir))
    draws, at_once, prompt = 400, 50, TINY_PROMPTS[2]

    def sample(llm: LLM, first_seed: int) -> Counter[int]:
        found: Counter[int] = Counter()
        for start in range(0, draws, at_once):
            seeds = range(first_seed + start, first_seed + start + at_once)
            params = [SamplingParams(temperature=1.0, top_k=6, seed=s, max_tokens=4, ignore_eos=True) for s in seeds]
            found.update(ids[2] for ids in _ids(llm, [prompt] * at_once, params))
        return found

    ours, theirs = sample(near, 0), sample(plain, 50_000)
    stats = near.engine.speculative_stats
    assert 0.2 * stats.draft_tokens < stats.accepted_tokens < 0.95 * stats.draft_tokens, stats  # both paths ran
    cells = [(ours[t], theirs[t]) for t in ours.keys() | theirs.keys()]
    big = [(a, b) for a, b in cells if a + b >= 10]
    rest = (draws - sum(a for a, _ in big), draws - sum(b for _, b in big))
    cells = [cell for cell in [*big, rest] if sum(cell) > 0]
    statistic = sum((a - b) ** 2 / (a + b) for a, b in cells)
    df = len(cells) - 1
    assert df >= 2, "too few distinct tokens to test"
    assert statistic < _chi_square_critical(df), f"chi-square {statistic:.1f} with {df} degrees of freedom"
    # Each token's logprob is the target's, whether its draft stood or rejection sampling replaced
    # it: the plain engine's prompt logprob of the same token after the same tokens. top_k=6 keeps
    # every token among the target's 6 most likely, so it is always among the 6 reported too.
    seeded = [
        SamplingParams(temperature=1.0, top_k=6, seed=s, max_tokens=8, ignore_eos=True, logprobs=6) for s in range(4)
    ]
    for seed, out in enumerate(near.generate([prompt] * len(seeded), seeded, use_tqdm=False)):
        tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        assert logprobs is not None and len(logprobs) == len(tokens) > 0
        [scored] = plain.generate([prompt + tokens], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        assert scored.prompt_logprobs is not None
        for position, (token, entry) in enumerate(zip(tokens, logprobs, strict=True)):
            assert entry.token_id == token  # a replaced draw reports its own token
            target = scored.prompt_logprobs[len(prompt) + position]
            assert target is not None and target.token_id == token
            assert entry.logprob == pytest.approx(target.logprob, abs=1e-4), (seed, position)
            assert entry.logprob == pytest.approx(entry.top_logprobs[entry.top_token_ids.index(token)], abs=1e-5)
    _pool_is_whole(near)


def test_a_draft_model_stops_inside_an_accepted_run(plain: LLM, self_draft: LLM) -> None:
    full = _ids(plain, [TINY_PROMPTS[2]], GREEDY)[0]
    for max_tokens in (2, 3, 5):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert _ids(self_draft, [TINY_PROMPTS[2]], params) == [full[:max_tokens]]
    stop = full[6]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop,), ignore_eos=True)
    [got] = self_draft.generate([TINY_PROMPTS[2]], params, use_tqdm=False)
    assert got.outputs[0].token_ids == full[: full.index(stop) + 1] and got.outputs[0].stop_reason == stop
    _pool_is_whole(self_draft)


@pytest.mark.parametrize("draft", ["self", "wrong"])
def test_a_draft_model_through_preemption_and_aborts_leaves_no_pages_behind(
    draft: str, model_dir: Path, plain: LLM, tiny_model_factory: Callable[..., Path]
) -> None:
    draft_dir = model_dir if draft == "self" else tiny_model_factory("llama", seed=1)
    small = _llm(model_dir, _draft(draft_dir), num_pages=24)  # six sequences of ~50 tokens preempt
    prompts = [TINY_PROMPTS[i % 3] for i in range(6)]
    assert _ids(small, prompts, GREEDY) == _ids(plain, prompts, GREEDY)
    assert small.engine.scheduler.num_preemptions > 0 and small.engine.speculative_stats.draft_tokens > 0
    _pool_is_whole(small)
    _abort_midway(small, prompts[:3], GREEDY)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vocab_size": 256}, r"vocabulary \(256 tokens.*differs from the target's \(320 tokens\)"),
        ({"max_position_embeddings": 64}, r"context \(64 tokens\) is shorter than the target's max_model_len \(256\)"),
    ],
)
def test_a_draft_model_that_cannot_draft_for_the_target_is_refused_at_start(
    overrides: dict[str, Any], message: str, model_dir: Path, tiny_model_factory: Callable[..., Path]
) -> None:
    from compiled_engine.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match=message):
        _llm(model_dir, _draft(tiny_model_factory("llama", seed=1, **overrides)))


def test_a_compiled_draft_model_equals_eager_and_never_recompiles(model_dir: Path, plain: LLM) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = _llm(model_dir, _draft(model_dir), enforce_eager=False, compile_cache=False)
    graphs = counters["stats"]["unique_graphs"]
    assert _ids(compiled, TINY_PROMPTS, GREEDY) == _ids(plain, TINY_PROMPTS, GREEDY)
    assert _ids(compiled, [TINY_PROMPTS[0]], GREEDY) == _ids(plain, [TINY_PROMPTS[0]], GREEDY)
    assert compiled.engine.speculative_stats.accepted_tokens > 0
    assert counters["stats"]["unique_graphs"] == graphs, "drafting or verifying recompiled"


def _every_dashboard_metric_is_exported(metrics: str) -> None:
    """docs/grafana-dashboard.json queries only metrics this server exports (here with
    speculation on, so that its speculative-decoding panel has its series too), each with the
    `model_name` label it filters on."""
    import re

    dashboard = json.loads((Path(__file__).parent.parent / "docs" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"vllm:[a-z0-9_]+", expr)}
    assert len(queried) >= 15
    exported = {line.split("{")[0].split(" ")[0] for line in metrics.splitlines() if line.startswith("vllm:")}
    missing = sorted(name for name in queried if name not in exported)
    assert not missing, missing
    assert all('model_name="' in line for line in metrics.splitlines() if line.startswith("vllm:"))
