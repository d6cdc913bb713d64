"""Generator: the simple reference loop that the scheduled engine is tested against. It runs a
set of prompts to completion together, greedily: one forward prefills every prompt whole, then
each forward decodes one token for every unfinished sequence; no chunking, no prefix cache, no
preemption. It also records logits for `verify`. Every page goes back to the pool when the call
ends, however it ends."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from compiled_engine.cache.block_manager import BlockManager
from compiled_engine.engine.request_validation import check_prompt
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine.sequence import FinishReason, Sequence, SequenceStatus
from compiled_engine.engine.step_inputs import ScheduledBatch, step_inputs
from compiled_engine.errors import RequestError
from compiled_engine.executor.runner import Runner
from compiled_engine.executor.step import Logits

TOP_K_RECORDED = 5


@dataclass(frozen=True)
class StepLogits:
    """The highest logits after one step, for divergence reports."""

    token_ids: list[int]
    values: list[float]


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    prefill_logits: torch.Tensor | None = None  # fp32 [vocab], after the last prompt token
    top_logits: list[StepLogits] = field(default_factory=list)  # one per generated token


class Generator:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.block_manager = BlockManager(runner.num_pages, runner.page_size)
        self._seq_ids = itertools.count()

    def _logits(self, batch: ScheduledBatch) -> torch.Tensor:
        output = self.runner.execute(step_inputs(batch))
        assert isinstance(output, Logits)  # one rank: it answers
        return output.rows

    def validate_prompt(self, prompt: list[int], max_tokens: int) -> None:
        if max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}")
        check_prompt(prompt, max_tokens, self.runner.model_config.vocab_size, self.runner.max_model_len)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
        record_logits: bool = False,
    ) -> list[GenerationResult]:
        for prompt in prompts:
            self.validate_prompt(prompt, max_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        seqs = [Sequence(next(self._seq_ids), list(p), params, stop_token_ids) for p in prompts]
        results = {seq.seq_id: GenerationResult(seq.prompt_token_ids, [], FinishReason.LENGTH) for seq in seqs}
        try:
            batch = [(seq, seq.num_tokens) for seq in seqs]
            for seq in seqs:
                self.block_manager.grow(seq.block_table, seq.num_tokens)
            logits = self._logits(batch)
            if record_logits:
                for i, seq in enumerate(seqs):
                    results[seq.seq_id].prefill_logits = logits[i].cpu()
            self._advance(batch, logits, results, record_logits)
            while running := [seq for seq in seqs if not seq.is_finished]:
                for seq in running:
                    self.block_manager.grow(seq.block_table, seq.num_tokens)
                batch = [(seq, 1) for seq in running]
                logits = self._logits(batch)
                self._advance(batch, logits, results, record_logits)
        finally:
            for seq in seqs:
                self.block_manager.free(seq.block_table)
        for seq in seqs:
            assert seq.finish_reason is not None
            results[seq.seq_id].token_ids = list(seq.output_token_ids)
            results[seq.seq_id].finish_reason = seq.finish_reason
        return [results[seq.seq_id] for seq in seqs]

    @staticmethod
    def _advance(
        batch: list[tuple[Sequence, int]],
        logits: torch.Tensor,
        results: dict[int, GenerationResult],
        record_logits: bool,
    ) -> None:
        next_tokens = logits.argmax(dim=-1).tolist()
        if record_logits:
            top = logits.topk(TOP_K_RECORDED, dim=-1)
            for i, (seq, _) in enumerate(batch):
                results[seq.seq_id].top_logits.append(StepLogits(top.indices[i].tolist(), top.values[i].tolist()))
        for i, (seq, num_new) in enumerate(batch):
            seq.num_computed_tokens += num_new
            reason = seq.append_token(next_tokens[i])
            if reason is not None:
                seq.finish_reason = reason
                seq.status = SequenceStatus.FINISHED
