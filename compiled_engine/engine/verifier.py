"""Verification: the tokens each due sequence emits this step, from its sample rows.

A sequence with no draft has one row, and emits the token sampled there. A sequence with a draft
of k tokens has 1 + k rows (its last token and each draft token), each sampled as if the draft
tokens before it had been generated. Two ways to verify:
- the greedy walk: draft token i stands while it equals the token sampled at its row, and the
  first row that differs gives the sequence its next token instead. Each emitted token is then a
  draw from the target model given the tokens before it, exactly as without speculation (for an
  n-gram draft this is rejection sampling with a draft probability of 1), and with the sampler's
  seeded hash noise the very same tokens;
- rejection sampling, for a draft drawn from a draft model's distributions q_i (the drafter's
  `fill` returns them): d_i stands with probability min(1, p_i(d_i) / q_i(d_i)) under the
  target's filtered distribution p_i; the first that does not is replaced by a draw from the
  normalised max(p_i - q_i, 0), and when all stand one more token is drawn from p_{k+1}
  (Leviathan et al., 2023; Chen et al., 2023).
Both draw their randomness from the sampler's counter-based hash: the acceptance tests from a
stream of their own, the replacement or extra draw from the target's noise at its position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled_engine.engine.drafting import DraftProbs
from compiled_engine.engine.grammars import GrammarSet
from compiled_engine.engine.sampler import Sampler, SamplingBatch, TokenLogprobs, gumbel_noise, hash_uniform
from compiled_engine.engine.sequence import Sequence
from compiled_engine.profiling import nvtx_range

ACCEPT_STREAM = 0x3C6EF372FE94F82B  # xor-ed into a sequence's seed for its acceptance tests


@dataclass(frozen=True)
class Verified:
    """What one sequence emits this step: its standing draft tokens, then one more."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Verifier:
    def __init__(self, sampler: Sampler, grammars: GrammarSet) -> None:
        self.sampler = sampler
        self.grammars = grammars

    def verify(
        self, logits: torch.Tensor, first_rows: dict[int, int], due: list[Sequence], draft_probs: DraftProbs
    ) -> list[Verified]:
        """Sample every due sequence's rows at once (`first_rows`: each one's first row of
        `logits`), then keep what each emits."""
        rows, batch = sample_rows(first_rows, due)
        with nvtx_range("grammar masks"):  # a verified draft position is masked too
            batch.allowed_tokens = self.grammars.masks(due)
        verified = logits[rows]
        sampled = self.sampler(verified, batch)
        out, row = [], 0
        for seq in due:
            draft = list(seq.draft_token_ids)
            span = range(row, row + len(draft) + 1)
            logprobs = [sampled.logprobs[i] for i in span]
            probs = draft_probs.get(seq.seq_id)
            if probs is None:
                emitted = greedy_walk([sampled.token_ids[i] for i in span], draft)
            else:
                target = self.sampler.filtered_logits(verified[row : span.stop], batch.rows(row, span.stop))
                emitted = rejection_sample(target, probs, draft, seq.seed, batch.positions[row])
                logprobs = [
                    _relabel(found, token, verified[i])
                    for found, token, i in zip(logprobs, emitted, span, strict=False)
                ]
            out.append(Verified(seq, emitted, logprobs[: len(emitted)]))
            row = span.stop
        return out


def sample_rows(first_rows: dict[int, int], due: list[Sequence]) -> tuple[list[int], SamplingBatch]:
    """The logits rows of each due sequence (1 + its draft tokens), and their sampling batch: each
    row drawn as if the draft tokens before it had been generated."""
    rows: list[int] = []
    batch = SamplingBatch(
        params=[], seeds=[], positions=[], prompt_token_ids=[], output_token_ids=[], banned_token_ids=[]
    )
    for seq in due:
        draft = seq.draft_token_ids
        for ahead in range(len(draft) + 1):
            rows.append(first_rows[seq.seq_id] + ahead)
            batch.params.append(seq.params)
            batch.seeds.append(seq.seed)
            batch.positions.append(len(seq.output_token_ids) + ahead)
            batch.prompt_token_ids.append(seq.prompt_token_ids)
            batch.output_token_ids.append(seq.output_token_ids + draft[:ahead] if ahead else seq.output_token_ids)
            batch.banned_token_ids.append(seq.banned_token_ids(ahead))
    return rows, batch


def greedy_walk(sampled: list[int], draft: list[int]) -> list[int]:
    """The draft tokens up to the first that differs from its row's draw, and that draw."""
    differs = [i for i, (got, proposed) in enumerate(zip(sampled, draft, strict=False)) if got != proposed]
    return sampled[: (differs[0] if differs else len(draft)) + 1]


def rejection_sample(
    target_logits: torch.Tensor, draft_probs: torch.Tensor, draft: list[int], seed: int, first_position: int
) -> list[int]:
    """The tokens a sampled sequence emits: its standing draft tokens, then one more.
    `target_logits` [k + 1, vocab]: the target's filtered logits at the k draft positions and
    after them; `draft_probs` [k, vocab]: the draft's distributions that drew `draft`;
    `first_position`: the output index of the first (the noise's position, as the sampler's)."""
    k = len(draft)
    if target_logits.shape[0] != k + 1 or draft_probs.shape[0] != k:
        raise ValueError(
            f"need {k + 1} target rows and {k} draft rows, got {target_logits.shape[0]} and {draft_probs.shape[0]}"
        )
    device, vocab = target_logits.device, target_logits.shape[-1]
    target_probs = torch.softmax(target_logits.float(), dim=-1)
    positions = torch.arange(first_position, first_position + k + 1, device=device)
    seeds = torch.full((k + 1,), seed, dtype=torch.int64, device=device)
    ids = torch.tensor(draft, dtype=torch.int64, device=device)
    rows = torch.arange(k, device=device)
    p, q = target_probs[rows, ids], draft_probs.float().to(device)[rows, ids]
    uniforms = hash_uniform(seeds[:k] ^ ACCEPT_STREAM, positions[:k])
    stands = (uniforms * q <= p).tolist()
    accepted = stands.index(False) if False in stands else k
    noise = gumbel_noise(seeds[accepted : accepted + 1], positions[accepted : accepted + 1], vocab)[0]
    if accepted == k:
        choice = target_logits[k].float() + noise
    else:
        residual = (target_probs[accepted] - draft_probs[accepted].float().to(device)).clamp_min(0)
        if not residual.sum() > 0:  # p == q up to rounding: the test above accepts then, but be safe
            residual = target_probs[accepted]
        choice = residual.log() + noise
    return [*draft[:accepted], int(choice.argmax())]


def _relabel(found: TokenLogprobs | None, token: int, logits: torch.Tensor) -> TokenLogprobs | None:
    """The logprobs entry of `token` at a row whose sampler drew another (the top ones stand)."""
    if found is None or found.token_id == token:
        return found
    logprob = float(torch.log_softmax(logits.float(), dim=-1)[token])
    return TokenLogprobs(token, logprob, found.top_token_ids, found.top_logprobs)
