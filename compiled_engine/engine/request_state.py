"""RequestState: what the engine keeps of one request between steps (its sequences, their text,
logprobs and metrics): how a request starts (its n sequences and their seeds), what each sampled
token does to it (text, logprobs, stop strings, grammar) and how it turns into a RequestOutput."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from compiled_engine.engine.feature_state import AdapterKey, GrammarState, PoolingState
from compiled_engine.engine.grammars import GrammarSet
from compiled_engine.engine.output_text import SequenceText
from compiled_engine.engine.outputs import CompletionOutput, PromptTokenLogprobs, RequestMetrics, RequestOutput
from compiled_engine.engine.sampler import TokenLogprobs
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine.sequence import FinishReason, Sequence
from compiled_engine.tokenizer import Tokenizer

SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n completions


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    texts: list[SequenceText]
    logprobs: list[list[TokenLogprobs]] | None
    metrics: RequestMetrics
    adapter: AdapterKey | None = None
    changed: bool = field(default=False)
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None  # with SamplingParams.prompt_logprobs
    embedding: list[float] | None = None  # a pooling request's, once its prompt has run

    @classmethod
    def start(
        cls,
        request_id: str,
        prompt: str | list[int],
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        *,
        seq_ids: Iterator[int],
        rng: random.Random,
        eos_token_ids: frozenset[int],
        cache_salt: str | None,
        adapter: AdapterKey | None,
        grammars: Iterable[GrammarState | None],
        poolings: Iterable[PoolingState | None],
    ) -> RequestState:
        """A new request's state: its `params.n` completions (one a grammar state of `grammars`
        and a pooling state of `poolings`, each its own seed: `params.seed` spread apart, else
        drawn from `rng`), no text yet."""
        now = time.perf_counter()
        seqs: list[Sequence] = []
        for index, (grammar, pooling) in enumerate(zip(grammars, poolings, strict=True)):
            base_seed = params.seed if params.seed is not None else rng.getrandbits(63)
            seqs.append(
                Sequence(
                    next(seq_ids),
                    list(prompt_ids),
                    params,
                    eos_token_ids,
                    request_id=request_id,
                    index=index,
                    seed=(base_seed + index * SEED_STRIDE) % (1 << 63),
                    cache_salt=cache_salt,
                    adapter=adapter,
                    arrival_time=now,
                    fork_of=seqs[0] if index else None,
                    grammar=grammar,
                    pooling=pooling,
                )
            )
        return cls(
            request_id,
            prompt if isinstance(prompt, str) else None,
            prompt_ids,
            seqs,
            [SequenceText(tokenizer, prompt_ids, params) for _ in seqs],
            [[] for _ in seqs] if params.logprobs is not None else None,
            RequestMetrics(arrival_time=now),
            adapter,
        )

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        """The prompt logprobs a prefill chunk gives: row j of `logits` (the chunk's token at
        position num_computed_tokens + j) predicts the prompt token after it."""
        prompt = seq.prompt_token_ids
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(prompt)
        start = seq.num_computed_tokens
        targets = prompt[start + 1 : start + 1 + logits.shape[0]]
        if not targets:
            return
        logprobs = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        wanted = torch.tensor(targets, device=logprobs.device)[:, None]
        picked = logprobs.gather(1, wanted)
        ranks = ((logprobs > picked).sum(dim=1) + 1).tolist()
        top = seq.params.prompt_logprobs or 0
        top_values, top_ids = logprobs.topk(top, dim=-1) if top else (picked[:, :0], wanted[:, :0])
        for j, (token, value, rank, ids, values) in enumerate(
            zip(targets, picked[:, 0].tolist(), ranks, top_ids.tolist(), top_values.tolist(), strict=True)
        ):
            self.prompt_logprobs[start + 1 + j] = PromptTokenLogprobs(token, value, rank, ids, values)

    def embed(self, seq: Sequence, embedding: list[float]) -> None:
        """A pooled sequence's prompt is all in: its embedding is the request's output."""
        self.embedding = embedding
        self.changed = True
        seq.first_token_time = time.perf_counter()

    def append_token(
        self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, now: float, grammars: GrammarSet
    ) -> FinishReason | None:
        """Append one sampled token to `seq`, its text and its logprobs; the reason it ends `seq`,
        if it does (a stop token or string, max_tokens, a complete or refusing grammar), for the
        caller to finish it with."""
        self.changed = True
        if seq.first_token_time is None:
            seq.first_token_time = now
        if self.logprobs is not None and logprobs is not None:
            self.logprobs[seq.index].append(logprobs)
        reason = seq.append_token(token)  # a stop token, or max_tokens
        verdict = None if reason is FinishReason.STOP else grammars.advance(seq, token)
        if verdict is FinishReason.ABORT:
            return verdict
        text = self.texts[seq.index]
        stop_string = None if reason is FinishReason.STOP else text.add(token)
        if stop_string is not None:
            seq.stop_reason = stop_string  # the text ends before it
            return FinishReason.STOP
        reason = reason if reason is not None else verdict  # a complete grammar: only the end may follow
        if reason is not None:
            text.flush()
        return reason

    def output(self) -> RequestOutput:
        completions = []
        for seq, text in zip(self.seqs, self.texts, strict=True):
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text.visible(seq.is_finished),
                    token_ids=list(seq.output_token_ids),
                    finish_reason=None if seq.finish_reason is None else str(seq.finish_reason),
                    stop_reason=seq.stop_reason,
                    logprobs=None if self.logprobs is None else list(self.logprobs[seq.index]),
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            num_cached_tokens=self.seqs[0].num_cached_tokens,
            metrics=self._update_metrics(),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            embedding=self.embedding,
        )

    def _update_metrics(self) -> RequestMetrics:
        metrics, seqs = self.metrics, self.seqs
        metrics.first_scheduled_time = min(
            (s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None), default=None
        )
        metrics.first_token_time = min(
            (s.first_token_time for s in seqs if s.first_token_time is not None), default=None
        )
        metrics.num_generated_tokens = max(len(s.output_token_ids) for s in seqs)
        metrics.num_draft_tokens = sum(s.num_draft_tokens for s in seqs)
        metrics.num_accepted_tokens = sum(s.num_accepted_tokens for s in seqs)
        if self.finished:
            metrics.finished_time = max(s.finished_time or 0.0 for s in seqs)
        return metrics
