"""Sampler: turns one step's logits into one token per sequence, for the whole batch at once.

Every vocab-sized operation runs once over the batch; per-row settings become [rows, 1] tensors.
Randomness comes from a counter-based hash of (seed, position, token id) rather than a
torch.Generator, so a row's draw does not depend on its batch mates, its row index or the device.

On CUDA with FlashInfer installed, rows of requests that set no seed of their own, and no min-p,
are drawn by FlashInfer's fused top-k / top-p kernels instead (rejection sampling, no sort of the
vocabulary). Their draws depend on the row's index and a generator shared by the batch, so a
request with its own `seed` always takes the hash above and reproduces exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from compiled_engine.config import SAMPLERS
from compiled_engine.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a value below 2**32 times one stays below 2**63, so int64 never overflows.
_MUL_A = 0x7FEB352D
_MUL_B = 0x2C1B3C6D
_GOLDEN = 0x9E3779B9


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplingBatch:
    params: list[SamplingParams]
    seeds: list[int]
    positions: list[int]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    banned_token_ids: list[list[int]]
    # Structured outputs: each row's allowed tokens, bool [vocab] (None: any); None: no row has one.
    allowed_tokens: list[torch.Tensor | None] | None = None

    def rows(self, start: int, stop: int) -> SamplingBatch:
        """Rows [start, stop) alone."""
        return SamplingBatch(
            self.params[start:stop],
            self.seeds[start:stop],
            self.positions[start:stop],
            self.prompt_token_ids[start:stop],
            self.output_token_ids[start:stop],
            self.banned_token_ids[start:stop],
            None if self.allowed_tokens is None else self.allowed_tokens[start:stop],
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xor-shift / multiply rounds) on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [rows, vocab]; entry (r, t) depends only on seeds[r], positions[r] and t."""
    key = _mix32(_mix32(_mix32(seeds & _MASK32) ^ (seeds >> 32)) ^ (positions & _MASK32))
    key2 = _mix32(key ^ _GOLDEN)
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _mix32(_mix32(tokens ^ key[:, None]) ^ key2[:, None])
    # 23 bits plus a half step are exact in fp32, so u lies strictly inside (0, 1) and log never sees 0 or 1.
    u = ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One Uniform(0, 1) value per row, fp32 [rows], from the same counter-based hash as
    `gumbel_noise` (pass a seed of another stream to make it independent of that noise)."""
    key = _mix32(_mix32(_mix32(seeds & _MASK32) ^ (seeds >> 32)) ^ (positions & _MASK32))
    h = _mix32(key ^ _GOLDEN)
    return ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23


def _row_index(pairs: list[tuple[int, list[int]]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten (row, token ids) pairs into the two index tensors of an advanced-indexing write."""
    rows = [r for r, ids in pairs for _ in ids]
    cols = [t for _, ids in pairs for t in ids]
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(cols, dtype=torch.int64, device=device))


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def make_sampler(name: str | None, device: torch.device, seed: int | None = None) -> Sampler:
    """`name` None uses FlashInfer on CUDA when it is installed; an explicit "flashinfer" that
    cannot run (no CUDA, not installed) falls back to the torch sampler with a warning."""
    if name is not None and name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r} (available: {', '.join(SAMPLERS)})")
    if name == "torch" or (name is None and device.type != "cuda"):
        return Sampler()
    module = flashinfer_sampling_module() if device.type == "cuda" else None
    if module is None:
        reason = "FlashInfer sampling needs a CUDA device" if device.type != "cuda" else "flashinfer is not installed"
        (logger.warning if name == "flashinfer" else logger.info)("sampler: torch, because %s", reason)
        return Sampler()
    return Sampler(module, seed)


def flashinfer_sampling_module() -> ModuleType | None:
    """`flashinfer.sampling`, or None when FlashInfer is not installed."""
    try:
        import flashinfer.sampling
    except ImportError:
        return None
    return flashinfer.sampling


class Sampler:
    def __init__(self, flashinfer: ModuleType | None = None, seed: int | None = None) -> None:
        """`flashinfer`: the `flashinfer.sampling` module (make_sampler passes it on CUDA only),
        to draw unseeded rows with it; `seed` seeds the generator those draws share."""
        self.flashinfer = flashinfer
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self._generators[device] = generator
        return self._generators[device]

    def uses_flashinfer(self, params: SamplingParams) -> bool:
        """Whether a sampled (non-greedy) row with these params is drawn by FlashInfer."""
        return self.flashinfer is not None and params.seed is None and params.min_p == 0.0

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
        rows = logits.shape[0]
        params = batch.params
        fields: tuple[list[Any], ...] = (
            batch.seeds,
            batch.positions,
            batch.prompt_token_ids,
            batch.output_token_ids,
            batch.banned_token_ids,
        )
        if batch.allowed_tokens is not None:
            fields = (*fields, batch.allowed_tokens)
        if any(len(f) != rows for f in (params, *fields)):
            raise ValueError(f"SamplingBatch fields must all have {rows} rows (one per logits row)")
        device = logits.device
        logits = logits.float()

        # OpenAI and vLLM report logprobs of the model's own distribution, before penalties or filters.
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None

        logits = self._adjust_logits(logits, batch)

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        token_ids = logits.argmax(dim=-1) if greedy_rows else torch.zeros(rows, dtype=torch.int64, device=device)
        fast_rows = [i for i in sampled_rows if self.uses_flashinfer(params[i])]
        hashed_rows = [i for i in sampled_rows if not self.uses_flashinfer(params[i])]
        if hashed_rows:
            hashed = logits if len(hashed_rows) == rows else logits[hashed_rows]
            draws = self._sample(
                hashed,
                [params[i] for i in hashed_rows],
                [batch.seeds[i] for i in hashed_rows],
                [batch.positions[i] for i in hashed_rows],
            )
            token_ids[hashed_rows] = draws
        if fast_rows:
            fast = logits if len(fast_rows) == rows else logits[fast_rows]
            token_ids[fast_rows] = self._sample_flashinfer(fast, [params[i] for i in fast_rows])

        chosen = token_ids.tolist()
        out_logprobs: list[TokenLogprobs | None] = [None] * rows
        if raw_logprobs is not None:
            picked = raw_logprobs.gather(1, token_ids[lp_rows][:, None])[:, 0].tolist()
            top_n = max(params[i].logprobs or 0 for i in lp_rows)
            top_vals, top_ids = raw_logprobs.topk(top_n, dim=-1)
            top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
            for j, i in enumerate(lp_rows):
                n = params[i].logprobs or 0
                out_logprobs[i] = TokenLogprobs(chosen[i], picked[j], top_ids_l[j][:n], top_vals_l[j][:n])
        return SamplerOutput(token_ids=chosen, logprobs=out_logprobs)

    @staticmethod
    def _adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logits after each row's grammar mask, logit bias, banned tokens and repetition,
        presence and frequency penalties."""
        params, device = batch.params, logits.device
        masked = [(i, m) for i, m in enumerate(batch.allowed_tokens or []) if m is not None]
        if masked:
            rows = torch.tensor([i for i, _ in masked], device=device)
            allowed = torch.stack([m for _, m in masked]).to(device)
            width = min(allowed.shape[1], logits.shape[1])
            keep = torch.zeros((len(masked), logits.shape[1]), dtype=torch.bool, device=device)
            keep[:, :width] = allowed[:, :width]
            logits = logits.index_put((rows,), logits[rows].masked_fill(~keep, float("-inf")))
        biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
        if biased:
            index = _row_index([(i, [t for t, _ in pairs]) for i, pairs in biased], device)
            values = torch.tensor([b for _, pairs in biased for _, b in pairs], device=device)
            logits = logits.index_put(index, values, accumulate=True)
        banned = [(i, ids) for i, ids in enumerate(batch.banned_token_ids) if ids]
        if banned:
            logits = logits.index_put(_row_index(banned, device), torch.tensor(float("-inf"), device=device))

        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep_rows:
            seen = torch.zeros_like(logits, dtype=torch.bool)
            pairs = [(i, batch.prompt_token_ids[i] + batch.output_token_ids[i]) for i in rep_rows]
            seen.index_put_(_row_index(pairs, device), torch.tensor(True, device=device))
            penalty = _column([p.repetition_penalty for p in params], device)
            # HF semantics: always push a seen token's logit towards "less likely", whatever its sign.
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalised, logits)

        pf_rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        if pf_rows:
            counts = torch.zeros_like(logits)
            pairs = [(i, batch.output_token_ids[i]) for i in pf_rows]
            counts.index_put_(_row_index(pairs, device), torch.ones((), device=device), accumulate=True)
            freq = _column([p.frequency_penalty for p in params], device)
            pres = _column([p.presence_penalty for p in params], device)
            logits = logits - freq * counts - pres * (counts > 0).to(logits.dtype)
        return logits

    def _sample_flashinfer(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, then top-k before top-p (renormalised), as `_sample` filters."""
        fi: Any = self.flashinfer
        device, vocab = logits.device, logits.shape[-1]
        logits = logits / _column([p.temperature for p in params], device)
        generator = self._generator(device)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k or vocab for p in params], dtype=torch.int32, device=device)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
            draws = fi.top_k_top_p_sampling_from_logits(
                logits, top_k, top_p, filter_apply_order="top_k_first", generator=generator
            )
        else:
            draws = fi.sampling_from_logits(logits, generator=generator)
        return draws.to(torch.int64)

    def filtered_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logits each row is drawn from, fp32 [rows, vocab]: after the bans and penalties,
        and for sampled rows after temperature, top-k, top-p and min-p (filtered tokens are -inf).
        A greedy row's choice is their argmax; a sampled row's distribution is their softmax
        (what speculative decoding's rejection sampling compares)."""
        logits = self._adjust_logits(logits.float(), batch)
        sampled_rows = [i for i, p in enumerate(batch.params) if not p.greedy]
        if sampled_rows:
            logits = logits.clone()
            logits[sampled_rows] = self._filter(logits[sampled_rows], [batch.params[i] for i in sampled_rows])
        return logits

    @classmethod
    def _sample(
        cls, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
    ) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[-1]
        logits = cls._filter(logits, params)
        seed_t = torch.tensor(seeds, dtype=torch.int64, device=device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=device)
        return (logits + gumbel_noise(seed_t, pos_t, vocab)).argmax(dim=-1)

    @staticmethod
    def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, then top-k, top-p (of what top-k left) and min-p: filtered tokens -inf."""
        device, vocab = logits.device, logits.shape[-1]
        logits = logits / _column([p.temperature for p in params], device)
        neg_inf = torch.tensor(float("-inf"), device=device)

        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
            rank = torch.arange(vocab, device=device)
            top_k = torch.tensor([p.top_k or vocab for p in params], device=device)[:, None]
            drop = rank >= top_k
            # top-p works on the distribution top-k left behind, hence the renormalising softmax here.
            probs = torch.softmax(torch.where(drop, neg_inf, sorted_logits), dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            # The top token has zero mass before it and top_p > 0, so it always survives. top_p = 1
            # becomes inf, since a cumsum rounding up to 1.0 must not cut a row that asked for no cut.
            top_p = _column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device)
            drop |= mass_before >= top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))

        if any(p.min_p > 0.0 for p in params):
            # p < min_p * p_max  <=>  logit < max_logit + log(min_p); no softmax needed.
            log_min_p = torch.log(_column([p.min_p for p in params], device))
            floor = logits.max(dim=-1, keepdim=True).values + log_min_p
            logits = logits.masked_fill(logits < floor, float("-inf"))
        return logits
