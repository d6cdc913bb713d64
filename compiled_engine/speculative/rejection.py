"""Rejection sampling of a draft model's tokens, for sampled rows.

The draft drew token d_i from its distribution q_i; the target's distribution there is p_i (both
after the row's penalties, temperature, top-k, top-p and min-p). d_i stands with probability
min(1, p_i(d_i) / q_i(d_i)); the first that does not is replaced by a draw from the normalised
max(p_i - q_i, 0), and when all stand one more token is drawn from p_{k+1}. Each emitted token is
then a draw from the target's distribution given the tokens before it, whatever the draft did
(Leviathan et al., 2023; Chen et al., 2023).

The randomness is the sampler's counter-based hash: the acceptance tests use a stream of their
own, the replacement or extra draw the target's noise at its position. An n-gram draft and
greedy rows never come here (speculative/drafts.py says why they need no probabilities).
"""

from __future__ import annotations

import torch

from compiled_engine.engine.sampler import gumbel_noise, hash_uniform

ACCEPT_STREAM = 0x3C6EF372FE94F82B  # xor-ed into a sequence's seed for its acceptance tests


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
