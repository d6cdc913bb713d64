"""Sampler: penalties, filters, seeded Gumbel-max draws and logprobs, checked against hand-computed
values and, for the random parts, against the distributions they must reproduce."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from compiled_engine.engine.sampler import Sampler, SamplingBatch, TokenLogprobs, gumbel_noise
from compiled_engine.engine.sampling_params import SamplingParams

# Upper 1e-4 quantiles of chi-square by degrees of freedom. Draws are a pure function of the seed,
# so each test is deterministic: a correct sampler fails one only with probability 1e-4, once.
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}
N_DRAWS = 20_000
PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.01]


def batch_of(params: list[SamplingParams], **fields: Any) -> SamplingBatch:
    rows = len(params)
    return SamplingBatch(
        params=params,
        seeds=fields.get("seeds", [p.seed if p.seed is not None else 1234 for p in params]),
        positions=fields.get("positions", [0] * rows),
        prompt_token_ids=fields.get("prompt", [[] for _ in range(rows)]),
        output_token_ids=fields.get("output", [[] for _ in range(rows)]),
        banned_token_ids=fields.get("banned", [[] for _ in range(rows)]),
    )


def sample_one(logits: list[float], params: SamplingParams, **fields: list[Any]) -> int:
    out = Sampler()(torch.tensor([logits]), batch_of([params], **fields))
    return out.token_ids[0]


def draw_counts(
    logits: torch.Tensor, params: SamplingParams, n: int = N_DRAWS, banned: list[int] | None = None
) -> torch.Tensor:
    """Empirical counts of n independent draws: one row per position, all in one batch."""
    vocab = logits.shape[-1]
    batch = batch_of([params] * n, seeds=[99] * n, positions=list(range(n)), banned=[banned or [] for _ in range(n)])
    out = Sampler()(logits.expand(n, vocab).contiguous(), batch)
    return torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Tokens with probability 0 never drawn; the rest pass a chi-square goodness-of-fit test."""
    probs = probs.double() / probs.sum()
    kept = probs > 0
    assert counts[~kept].sum() == 0, f"excluded tokens drawn: {counts.tolist()}"
    expected = probs[kept] * counts.sum()
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
    df = int(kept.sum()) - 1
    if df == 0:
        return
    assert chi2 < CHI2_CRIT[df], f"chi2={chi2:.1f} df={df}: {counts.tolist()} vs {expected.tolist()}"


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log() + 3.0  # the offset must not matter


# ---------------------------------------------------------------- greedy and penalties


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, batch_of([SamplingParams(temperature=0)] * 6))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize(
    ("logits", "penalty", "seen", "expected"),
    [
        ([2.0, 1.5, 0.0], 1.0, [0], 0),
        ([2.0, 1.5, 0.0], 1.4, [0], 1),  # 2.0 / 1.4 = 1.43 < 1.5, flips
        ([2.0, 1.5, 0.0], 1.3, [0], 0),  # 2.0 / 1.3 = 1.54 > 1.5, stays
        ([-1.0, -0.6, -3.0], 1.5, [1], 1),  # -0.6 * 1.5 = -0.9 > -1.0, stays
        ([-1.0, -0.6, -3.0], 1.8, [1], 0),  # -0.6 * 1.8 = -1.08 < -1.0; dividing would have kept it
        ([-1.0, -0.6, -3.0], 0.5, [0], 0),  # penalty < 1 rewards: -1.0 * 0.5 = -0.5 > -0.6
    ],
)
def test_repetition_penalty_greedy(logits: list[float], penalty: float, seen: list[int], expected: int) -> None:
    params = SamplingParams(temperature=0, repetition_penalty=penalty)
    # The penalty applies to tokens seen in the prompt or in the output alike.
    assert sample_one(logits, params, prompt=[seen]) == expected
    assert sample_one(logits, params, output=[seen]) == expected


@pytest.mark.parametrize(
    ("presence", "frequency", "output", "expected"),
    [
        (0.15, 0.0, [0], 0),  # 1.0 - 0.15 = 0.85 > 0.8
        (0.25, 0.0, [0], 1),  # 0.75 < 0.8
        (0.25, 0.0, [0, 0, 0, 2], 1),  # presence does not grow with the count
        (0.0, 0.06, [0, 0, 0], 0),  # 1.0 - 3 * 0.06 = 0.82 > 0.8
        (0.0, 0.07, [0, 0, 0], 1),  # 1.0 - 3 * 0.07 = 0.79 < 0.8
        (0.1, 0.04, [0, 0], 0),  # 1.0 - 0.1 - 2 * 0.04 = 0.82
        (0.1, 0.06, [0, 0], 1),  # 1.0 - 0.1 - 2 * 0.06 = 0.78
        (-0.3, 0.0, [1], 1),  # negative presence rewards: 0.8 + 0.3 = 1.1 > 1.0
    ],
)
def test_presence_and_frequency_penalties_greedy(
    presence: float, frequency: float, output: list[int], expected: int
) -> None:
    params = SamplingParams(temperature=0, presence_penalty=presence, frequency_penalty=frequency)
    assert sample_one([1.0, 0.8, 0.0], params, output=[output]) == expected


def test_presence_and_frequency_ignore_the_prompt() -> None:
    params = SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    assert sample_one([1.0, 0.8, 0.0], params, prompt=[[0, 0, 0]]) == 0


def test_banned_ids_never_drawn() -> None:
    logits = [5.0, 4.0, 0.0, 0.0]
    assert sample_one(logits, SamplingParams(temperature=0), banned=[[0]]) == 1
    assert sample_one(logits, SamplingParams(temperature=0), banned=[[0, 1]]) in (2, 3)
    counts = draw_counts(torch.tensor(logits), SamplingParams(temperature=3.0), banned=[0, 2])
    assert_matches(counts, torch.tensor([0.0, math.exp(4.0 / 3), 0.0, 1.0]))


# ---------------------------------------------------------------- reproducibility


def test_same_seed_and_position_same_token_whatever_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=gen)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 13, 14, 15)]
    positions = [0, 3, 7, 7, 100]
    full = Sampler()(logits, batch_of(params, positions=positions)).token_ids
    assert full == Sampler()(logits, batch_of(params, positions=positions)).token_ids
    for i in range(5):
        alone = Sampler()(logits[i : i + 1], batch_of([params[i]], positions=[positions[i]]))
        assert alone.token_ids == [full[i]]
    perm = [3, 0, 4, 2, 1]
    permuted = Sampler()(logits[perm], batch_of([params[i] for i in perm], positions=[positions[i] for i in perm]))
    assert permuted.token_ids == [full[i] for i in perm]


def test_positions_and_seeds_give_different_draws() -> None:
    vocab, steps = 1000, 200
    flat = torch.zeros(steps, vocab)
    by_position = Sampler()(flat, batch_of([SamplingParams(seed=5)] * steps, positions=list(range(steps)))).token_ids
    by_seed = Sampler()(flat, batch_of([SamplingParams()] * steps, seeds=list(range(steps)))).token_ids
    # 200 uniform draws from 1000 give about 181 distinct values; a stuck stream gives 1.
    assert len(set(by_position)) > 160
    assert len(set(by_seed)) > 160
    assert sum(a == b for a, b in zip(by_position, by_seed, strict=True)) < 5


def test_high_seed_bits_matter() -> None:
    flat = torch.zeros(64, 1000)
    low = batch_of([SamplingParams()] * 64, seeds=[7] * 64, positions=list(range(64)))
    high = batch_of([SamplingParams()] * 64, seeds=[7 + 2**40] * 64, positions=list(range(64)))
    assert Sampler()(flat, low).token_ids != Sampler()(flat, high).token_ids


# ---------------------------------------------------------------- distributions


def test_plain_sampling_matches_softmax() -> None:
    logits = torch.randn(8, generator=torch.Generator().manual_seed(3))
    assert_matches(draw_counts(logits, SamplingParams()), torch.softmax(logits, -1))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_sharpens_and_flattens(temperature: float) -> None:
    logits = logits_of(PROBS)
    counts = draw_counts(logits, SamplingParams(temperature=temperature))
    assert_matches(counts, torch.softmax(logits / temperature, -1))
    top_share = counts[0].item() / N_DRAWS
    assert (top_share > PROBS[0] + 0.1) if temperature < 1 else (top_share < PROBS[0] - 0.1)


@pytest.mark.parametrize("top_k", [1, 3, 5])
def test_top_k(top_k: int) -> None:
    probs = torch.tensor(PROBS)[torch.tensor([3, 0, 6, 1, 7, 2, 5, 4])]  # unsorted vocab order
    kept = probs.clone()
    kept[probs.argsort(descending=True)[top_k:]] = 0
    assert_matches(draw_counts(probs.log(), SamplingParams(top_k=top_k)), kept)


@pytest.mark.parametrize(
    ("top_p", "n_kept"),
    [
        (0.3, 1),  # the top token alone exceeds 0.3
        (0.6, 2),  # 0.4 < 0.6 <= 0.65
        (0.7, 3),  # 0.65 < 0.7 <= 0.8
        (0.93, 5),  # 0.9 < 0.93 <= 0.95
        (0.985, 7),  # 0.98 < 0.985 <= 0.99
    ],
)
def test_top_p(top_p: float, n_kept: int) -> None:
    probs = torch.tensor(PROBS)
    kept = torch.where(torch.arange(8) < n_kept, probs, 0.0)
    assert_matches(draw_counts(logits_of(PROBS), SamplingParams(top_p=top_p)), kept)


@pytest.mark.parametrize(("min_p", "n_kept"), [(0.2, 4), (0.3, 3), (0.1, 5), (0.9, 1)])
def test_min_p(min_p: float, n_kept: int) -> None:
    # threshold = min_p * 0.4: 0.08 keeps 0.1, 0.12 drops it, 0.04 keeps 0.05, 0.36 keeps the top only.
    probs = torch.tensor(PROBS)
    kept = torch.where(torch.arange(8) < n_kept, probs, 0.0)
    assert_matches(draw_counts(logits_of(PROBS), SamplingParams(min_p=min_p)), kept)


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    # After top_k=2 the pair is (0.615, 0.385): top_p=0.6 keeps one. On the raw 0.4 it would keep two.
    probs = torch.tensor(PROBS)
    counts = draw_counts(logits_of(PROBS), SamplingParams(top_k=2, top_p=0.6))
    assert_matches(counts, torch.where(torch.arange(8) < 1, probs, 0.0))
    counts = draw_counts(logits_of(PROBS), SamplingParams(top_k=4, top_p=0.75, temperature=0.9))
    tempered = torch.softmax(logits_of(PROBS) / 0.9, -1)
    assert_matches(counts, torch.where(torch.arange(8) < 3, tempered, 0.0))


def test_gumbel_noise_is_standard_gumbel() -> None:
    g = gumbel_noise(torch.full((4000,), 3), torch.arange(4000), 50).double()
    assert torch.isfinite(g).all()
    assert g.mean().item() == pytest.approx(0.5772, abs=0.01)  # Euler-Mascheroni
    assert g.var().item() == pytest.approx(math.pi**2 / 6, rel=0.02)


# ---------------------------------------------------------------- logprobs


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(4)) * 3
    params = [
        SamplingParams(temperature=0, logprobs=5, repetition_penalty=2.0),
        SamplingParams(temperature=0.7, top_k=3, logprobs=20, presence_penalty=1.0),
        SamplingParams(logprobs=None),
        SamplingParams(temperature=0, logprobs=0),
    ]
    out = Sampler()(
        logits, batch_of(params, prompt=[[int(logits[0].argmax())], [], [], []], output=[[], [1, 2], [], []])
    )
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-6)
        n = params[i].logprobs or 0
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == n
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        values, ids = raw[i].topk(n)
        assert lp.top_token_ids == ids.tolist()
        assert lp.top_logprobs == pytest.approx(values.tolist(), abs=1e-6)
    # The repetition penalty moved the greedy choice off the raw argmax; its logprob is still raw.
    assert out.token_ids[0] != int(logits[0].argmax())


# ---------------------------------------------------------------- mixed batches


def assert_same_logprobs(a: TokenLogprobs | None, b: TokenLogprobs | None) -> None:
    if a is None or b is None:
        assert a is b
        return
    assert (a.token_id, a.top_token_ids) == (b.token_id, b.top_token_ids)
    assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
    assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-6)


def test_mixed_batch_matches_rows_sampled_alone() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 64
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(top_k=5, seed=2),
        SamplingParams(top_p=0.9, min_p=0.05, seed=3),
        SamplingParams(temperature=1.3, frequency_penalty=0.5, repetition_penalty=1.2, logprobs=3),
        SamplingParams(temperature=1.5, top_k=10, top_p=0.8),
    ]
    rows = len(params)
    seeds = [p.seed if p.seed is not None else 1000 + i for i, p in enumerate(params)]
    prompt = [torch.randint(vocab, (10,), generator=gen).tolist() for _ in range(rows)]
    output = [torch.randint(vocab, (6,), generator=gen).tolist() for _ in range(rows)]
    banned = [[], [3], [], [7, 8], [], [], [1, 2, 3]]
    for step in range(30):
        logits = torch.randn(rows, vocab, generator=gen) * 2
        positions = [step + i for i in range(rows)]
        fields: dict[str, list[Any]] = dict(
            seeds=seeds, positions=positions, prompt=prompt, output=output, banned=banned
        )
        together = Sampler()(logits, batch_of(params, **fields))
        for i in range(rows):
            one = {k: v[i : i + 1] for k, v in fields.items()}
            alone = Sampler()(logits[i : i + 1], batch_of(params[i : i + 1], **one))
            assert alone.token_ids == [together.token_ids[i]], (step, i)
            assert_same_logprobs(alone.logprobs[0], together.logprobs[i])
            assert together.token_ids[i] not in banned[i]


def test_batch_fields_must_match_rows() -> None:
    batch = batch_of([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="3 rows"):
        Sampler()(torch.zeros(3, 10), batch)


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(64, 5000, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.0 if i % 4 == 0 else 1.0, top_k=50 * (i % 3), top_p=0.9 if i % 5 == 0 else 1.0)
        for i in range(64)
    ]
    batch = batch_of(params, seeds=[2**62 + i for i in range(64)], positions=list(range(64)))
    cpu = Sampler()(logits, batch).token_ids
    cuda = Sampler()(logits.cuda(), batch).token_ids
    assert cpu == cuda
    seeds, positions = torch.arange(100) * 2**40, torch.arange(100)
    noise = gumbel_noise(seeds, positions, 1000)
    assert torch.allclose(noise, gumbel_noise(seeds.cuda(), positions.cuda(), 1000).cpu(), atol=1e-5)


# ---------------------------------------------------------------- FlashInfer sampling


class FakeFlashInferSampling:
    """Stands in for flashinfer.sampling on the CPU: records what it was given and draws the
    argmax of the logits it sees, so the tests can tell which rows it served."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.Tensor, Any, Any]] = []

    def sampling_from_logits(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        assert isinstance(generator, torch.Generator)
        self.calls.append(("plain", logits.clone(), None, None))
        return logits.argmax(-1).to(torch.int32)

    def top_k_top_p_sampling_from_logits(
        self,
        logits: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        filter_apply_order: str = "",
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        assert filter_apply_order == "top_k_first" and isinstance(generator, torch.Generator)
        self.calls.append(("top_k_top_p", logits.clone(), top_k.tolist(), top_p.tolist()))
        return logits.argmin(-1).to(torch.int32)  # distinguishable from the plain path


def test_flashinfer_takes_only_unseeded_rows_without_min_p() -> None:
    fake = FakeFlashInferSampling()
    sampler = Sampler(fake, seed=3)  # type: ignore[arg-type]
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0),  # greedy: argmax, never sampled
        SamplingParams(temperature=2.0),  # unseeded: FlashInfer
        SamplingParams(temperature=1.0, seed=7),  # its own seed: the hash, reproducible
        SamplingParams(temperature=1.0, min_p=0.1),  # min-p: the hash
        SamplingParams(temperature=0.5),  # unseeded: FlashInfer
    ]
    out = sampler(logits, batch_of(params))
    assert len(fake.calls) == 1
    kind, seen, _, _ = fake.calls[0]
    assert kind == "plain"
    torch.testing.assert_close(seen, torch.stack([logits[1] / 2.0, logits[4] / 0.5]))
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1] == int(logits[1].argmax()) and out.token_ids[4] == int(logits[4].argmax())
    alone = Sampler()(logits[2:4], batch_of(params[2:4])).token_ids
    assert out.token_ids[2:4] == alone  # the seeded and min-p rows drew exactly as without FlashInfer


def test_flashinfer_gets_per_row_top_k_and_top_p() -> None:
    fake = FakeFlashInferSampling()
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_p=0.8)]
    out = Sampler(fake)(logits, batch_of(params))  # type: ignore[arg-type]
    kind, _, top_k, top_p = fake.calls[0]
    assert kind == "top_k_top_p" and top_k == [5, 30] and top_p == pytest.approx([1.0, 0.8])
    assert out.token_ids == logits.argmin(-1).tolist()


def test_make_sampler_choices(caplog: pytest.LogCaptureFixture) -> None:
    from compiled_engine.config import EngineConfig
    from compiled_engine.engine.sampler import make_sampler

    cpu = torch.device("cpu")
    assert make_sampler(None, cpu).flashinfer is None
    assert make_sampler("torch", cpu).flashinfer is None
    with caplog.at_level("WARNING"):
        assert make_sampler("flashinfer", cpu).flashinfer is None
    assert "sampler: torch, because FlashInfer sampling needs a CUDA device" in caplog.text
    with pytest.raises(ValueError, match="unknown sampler 'fast'"):
        make_sampler("fast", cpu)
    with pytest.raises(ValueError, match="sampler must be torch or flashinfer"):
        EngineConfig(sampler="fast")


@pytest.mark.gpu
def test_flashinfer_sampling_distribution() -> None:
    pytest.importorskip("flashinfer")
    from compiled_engine.engine.sampler import make_sampler

    sampler = make_sampler("flashinfer", torch.device("cuda"), seed=0)
    assert sampler.flashinfer is not None
    probs = torch.tensor(PROBS)
    logits = logits_of(PROBS).cuda()
    n = N_DRAWS
    for params, expected in [
        (SamplingParams(temperature=1.0), probs),
        (SamplingParams(temperature=1.0, top_k=3), torch.tensor(PROBS[:3] + [0.0] * 5)),
        (SamplingParams(temperature=1.0, top_p=0.5), torch.tensor(PROBS[:2] + [0.0] * 6)),
    ]:
        out = sampler(logits.expand(n, len(PROBS)).contiguous(), batch_of([params] * n))
        assert_matches(torch.bincount(torch.tensor(out.token_ids), minlength=len(PROBS)).double(), expected)
