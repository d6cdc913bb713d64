"""RequestState: what the engine keeps of one request between steps (its sequences, their text,
logprobs and metrics) and how it turns them into a RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compiled_engine.engine.adapters import AdapterKey
from compiled_engine.engine.output_text import SequenceText
from compiled_engine.engine.outputs import CompletionOutput, PromptTokenLogprobs, RequestMetrics, RequestOutput
from compiled_engine.engine.sampler import TokenLogprobs
from compiled_engine.engine.sequence import Sequence


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
