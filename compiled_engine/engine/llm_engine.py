"""LLMEngine: one loop that owns every request. `add_request` and `abort_request` only queue
work; `step` runs one iteration: apply aborts -> schedule -> forward -> sample -> emit outputs."""

from __future__ import annotations

import functools
import itertools
import logging
import random
import time
import uuid
from dataclasses import dataclass, field

import torch

from compiled_engine.cache.block_manager import BlockManager
from compiled_engine.config import EngineConfig
from compiled_engine.engine.memory_budget import return_freed_heap
from compiled_engine.engine.model_runner import ModelRunner
from compiled_engine.engine.output_text import SequenceText
from compiled_engine.engine.outputs import CompletionOutput, PromptTokenLogprobs, RequestMetrics, RequestOutput
from compiled_engine.engine.request_validation import check_request, prompt_token_ids
from compiled_engine.engine.sampler import SamplingBatch, TokenLogprobs, make_sampler
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine.scheduler import Scheduler, SchedulerOutput
from compiled_engine.engine.sequence import FinishReason, Sequence
from compiled_engine.engine.step_inputs import logit_count
from compiled_engine.engine.tp_worker import run_worker
from compiled_engine.errors import RequestError
from compiled_engine.lora.adapter import LoRAError
from compiled_engine.lora.manager import LoRAManager, LoRARequest
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.packed_linear import packed_bytes
from compiled_engine.model.shard import TPShard
from compiled_engine.model.source import resolve_model_dir
from compiled_engine.parallel.launch import TensorParallelGroup
from compiled_engine.parallel.threads import set_threads
from compiled_engine.profiling import nvtx_range
from compiled_engine.speculative.draft_model import DraftModel, plan_draft_model
from compiled_engine.speculative.drafts import SpeculativeStats, propose_drafts, update_speculating
from compiled_engine.speculative.rejection import rejection_sample
from compiled_engine.structured.grammar import GrammarCompiler
from compiled_engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n completions


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    texts: list[SequenceText]
    logprobs: list[list[TokenLogprobs]] | None
    metrics: RequestMetrics
    changed: bool = field(default=False)
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None  # with SamplingParams.prompt_logprobs

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        set_threads(config)  # before any weight is read or kernel compiled
        self.model_dir = resolve_model_dir(config.model)
        self.speculative = config.resolved_speculative()
        draft_plan = None
        if self.speculative is not None and self.speculative.model is not None:
            # A draft that cannot draft for this model fails here, before any weight is read.
            draft_dir = resolve_model_dir(self.speculative.model)
            target = ModelConfig.from_model_dir(self.model_dir)
            draft_plan = plan_draft_model(draft_dir, self.model_dir, target, config, config.resolved_dtype())
        shared_pool = None if draft_plan is None else draft_plan.shared_pool
        self.tensor_parallel: TensorParallelGroup | None = None
        if config.tensor_parallel_size > 1:
            # Uneven head counts fail here, before any process starts or weight is read.
            TPShard(0, config.tensor_parallel_size).check(ModelConfig.from_model_dir(self.model_dir))
            self.tensor_parallel = TensorParallelGroup.start(self.model_dir, config, run_worker)
            shard, mesh = self.tensor_parallel.shard, self.tensor_parallel.mesh
            self.runner = ModelRunner(self.model_dir, config, shard, mesh, shared_pool)
        else:
            self.runner = ModelRunner(self.model_dir, config, shared_pool=shared_pool)
        # The draft model, on this rank alone, keeps its K/V under the runner's page ids.
        self.draft = (
            None
            if draft_plan is None
            else DraftModel(draft_plan, config, self.runner.num_pages, self.runner.max_model_len)
        )
        return_freed_heap()
        has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer(self.model_dir) if has_tokenizer else None
        self.eos_token_ids = (
            self.tokenizer.eos_token_ids if self.tokenizer else frozenset(self.runner.model_config.eos_token_ids)
        )
        self.block_manager = BlockManager(self.runner.num_pages, self.runner.page_size, config.enable_prefix_caching)
        self.lora: LoRAManager | None = None
        if self.runner.lora_slots is not None:
            cpu_loras = config.max_cpu_loras or config.max_loras
            self.lora = LoRAManager(self.runner.lora_slots, self.runner.model_config, cpu_loras)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_loras if self.lora is not None else None,
        )
        self.sampler = make_sampler(config.sampler, self.runner.device, config.seed)
        self.speculative_stats = SpeculativeStats()
        self._grammars: GrammarCompiler | None = None
        self._rng = random.Random(config.seed)
        self._requests: dict[str, _Request] = {}
        self._pending_aborts: set[str] = set()
        self.num_aborted_requests = 0  # requests `abort_request` ended before they finished
        self._seq_ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def _runners(self) -> list[ModelRunner]:
        return [self.runner] + ([self.draft.runner] if self.draft is not None else [])

    @functools.cached_property
    def weight_bytes(self) -> int:
        """Weight memory of this process: the model's (and a draft's) tensors (the compiled CPU
        path's packed weights among them), and any packed copy kept beside a dense weight (the
        fallback of model/packed_linear.py). Fixed once the engine is built, so counted once
        (every /metrics scrape reads it)."""
        return sum(runner.weight_bytes for runner in self._runners) + packed_bytes()

    @functools.cached_property
    def kv_cache_bytes(self) -> int:
        return sum(runner.kv_cache_bytes for runner in self._runners)

    def grammar_compiler(self) -> GrammarCompiler:
        """Structured outputs' grammars for this model's tokenizer (built at first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError("structured outputs need the model's tokenizer.json", param="structured_outputs")
            vocab = self.runner.model_config.vocab_size
            self._grammars = GrammarCompiler(self.model_dir / "tokenizer.json", vocab, self.eos_token_ids)
        return self._grammars

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request and return its id. An invalid one raises a RequestError (a PromptError
        for the prompt checks of request_validation, a LoRAError for its adapter) and leaves
        nothing queued. With `lora_request` it runs with that adapter, loaded now if new."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        prompt_ids = prompt_token_ids(prompt, self.tokenizer, str(self.model_dir))
        check_request(
            prompt_ids,
            params,
            self.runner.model_config.vocab_size,
            self.runner.max_model_len,
            self.tokenizer is not None,
        )
        spec = params.structured_outputs
        grammars = [self.grammar_compiler().matcher(spec) for _ in range(params.n)] if spec is not None else None
        lora_name = None
        if lora_request is not None:
            if self.lora is None:
                raise LoRAError("this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)")
            adapter = self.lora.add(lora_request)
            lora_name = lora_request.name
            # The adapter's own KV: never shared with the base model, another adapter, or this
            # one before its files changed.
            cache_salt = f"{cache_salt or ''}\0lora:{adapter.digest}"
        now = time.perf_counter()
        seqs: list[Sequence] = []
        for index in range(params.n):
            base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            seqs.append(
                Sequence(
                    next(self._seq_ids),
                    list(prompt_ids),
                    params,
                    self.eos_token_ids,
                    request_id=request_id,
                    index=index,
                    seed=(base_seed + index * SEED_STRIDE) % (1 << 63),
                    cache_salt=cache_salt,
                    lora_name=lora_name,
                    arrival_time=now,
                    fork_of=seqs[0] if index else None,
                    grammar=None if grammars is None else grammars[index],
                )
            )
        self._requests[request_id] = _Request(
            request_id,
            text,
            prompt_ids,
            seqs,
            [SequenceText(self.tokenizer, prompt_ids, params) for _ in seqs],
            [[] for _ in seqs] if params.logprobs is not None else None,
            RequestMetrics(arrival_time=now),
        )
        if self.lora is not None and lora_name is not None:
            self.lora.acquire(lora_name)
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Ends the request at the next step boundary, returning its pages (unknown ids are ignored:
        the request may have just finished)."""
        if request_id in self._requests:
            self._pending_aborts.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- the loop -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (the engine is unusable afterwards). With a rank
        lost, the others are not told to stop: that broadcast would wait for the lost one until
        the collective timeout."""
        if self.tensor_parallel is not None:
            try:
                if self.tensor_parallel.all_alive():
                    self.runner.stop_workers()
            finally:
                self.tensor_parallel.stop()
                self.tensor_parallel = None

    def step(self) -> list[RequestOutput]:
        if self.tensor_parallel is not None:
            self.tensor_parallel.check_alive()
        self._apply_aborts()
        with nvtx_range("schedule"):
            if self.speculative is not None:
                propose_drafts(self.speculative, self.scheduler.running, self.max_model_len)
            out = self.scheduler.schedule()
        if not out.is_empty:
            try:
                self._run_scheduled(out)
            except BaseException:
                # A failed forward or sampling step (an error in a kernel, a lost rank) ends the
                # step's requests with `abort` and returns every page they held before the error
                # goes on up; the rest of the queue is untouched.
                for item in out.scheduled:
                    request = self._requests.get(item.seq.request_id)
                    for seq in request.seqs if request is not None else [item.seq]:
                        if not seq.is_finished:
                            self.scheduler.finish(seq, FinishReason.ABORT)
                    if request is not None:
                        request.changed = True
                raise
        with nvtx_range("detokenize"):
            return self._collect_outputs()

    def _run_scheduled(self, out: SchedulerOutput) -> None:
        """Draft, run the forward, and sample the scheduled sequences of one step."""
        slots = None
        if self.lora is not None:
            slots = self.lora.slots_for(s.seq.lora_name for s in out.scheduled if s.seq.lora_name is not None)
        draft_probs: dict[int, torch.Tensor] = {}
        if self.draft is not None:
            with nvtx_range("draft"):
                speculating = [item.seq for item in out.scheduled if item.seq.draft_token_ids]
                draft_probs = self.draft.propose(speculating, self.scheduler.running)
        batch = [(item.seq, item.num_tokens) for item in out.scheduled]
        counts = [logit_count(seq, num_new) for seq, num_new in batch]  # logits rows of each
        logits = self.runner.run(batch, slots)
        first_rows, row = {}, 0  # each sequence's first row to sample: it has 1 + drafts
        for (seq, _), count in zip(batch, counts, strict=True):
            if seq.wants_prompt_logprobs:
                self._record_prompt_logprobs(seq, logits[row : row + count])
            first_rows[seq.seq_id] = row + count - 1 - len(seq.draft_token_ids)
            row += count
        due = self.scheduler.advance(out)
        if due:
            with nvtx_range("sample"):
                self._sample(logits, first_rows, due, draft_probs)

    def _apply_aborts(self) -> None:
        for request_id in self._pending_aborts:
            request = self._requests.get(request_id)
            if request is None:
                continue
            unfinished = [seq for seq in request.seqs if not seq.is_finished]
            for seq in unfinished:
                self.scheduler.finish(seq, FinishReason.ABORT)
            if unfinished:  # counted once its pages are back
                self.num_aborted_requests += 1
            request.changed = True
        self._pending_aborts.clear()

    def _sample(
        self,
        logits: torch.Tensor,
        first_rows: dict[int, int],
        due: list[Sequence],
        draft_probs: dict[int, torch.Tensor],
    ) -> None:
        """Sample every due sequence's rows at once: one, or 1 + its drafts, each as if the draft
        tokens before it had been generated (speculative/drafts.py), then emit its tokens up to
        the first that differs from its draft. A sampled sequence whose draft came from a draft
        model (`draft_probs`: the draft's distributions) is verified by rejection sampling
        instead (speculative/rejection.py)."""
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
        if any(seq.grammar is not None for seq in due):
            with nvtx_range("grammar masks"):  # a verified draft position is masked too
                batch.allowed_tokens = [
                    mask
                    for seq in due
                    for mask in (
                        [None] * (1 + len(seq.draft_token_ids))
                        if seq.grammar is None
                        else seq.grammar.masks_along(seq.draft_token_ids)
                    )
                ]
        verified = logits[rows]
        sampled = self.sampler(verified, batch)
        now = time.perf_counter()
        row = 0
        for seq in due:
            draft = list(seq.draft_token_ids)
            span = range(row, row + len(draft) + 1)
            logprobs = [sampled.logprobs[i] for i in span]
            if seq.seq_id in draft_probs:
                target = self.sampler.filtered_logits(verified[row : span.stop], batch.rows(row, span.stop))
                emitted = rejection_sample(target, draft_probs[seq.seq_id], draft, seq.seed, batch.positions[row])
                logprobs = [
                    _relabel(found, token, verified[i])
                    for found, token, i in zip(logprobs, emitted, span, strict=False)
                ]
            else:  # the drafts up to the first that differs from its row's draw, and that draw
                emitted = []
                for ahead, i in enumerate(span):
                    emitted.append(sampled.token_ids[i])
                    if ahead == len(draft) or emitted[-1] != draft[ahead]:
                        break
            accepted = 0
            for ahead, token in enumerate(emitted):
                finished = self._emit(seq, token, logprobs[ahead], now)
                if ahead < len(emitted) - 1:
                    accepted += 1
                if finished:
                    break
            row = span.stop
            if draft:
                self.speculative_stats.record(len(draft), accepted)
                seq.num_draft_tokens += len(draft)
                seq.num_accepted_tokens += accepted
                if not seq.is_finished:
                    self.scheduler.accept_draft(seq, accepted)
                    assert self.speculative is not None
                    update_speculating(self.speculative, seq, len(draft), accepted)

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        """The prompt logprobs a prefill chunk gives: row j of `logits` (the chunk's token at
        position num_computed_tokens + j) predicts the prompt token after it."""
        request = self._requests[seq.request_id]
        prompt = seq.prompt_token_ids
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * len(prompt)
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
            request.prompt_logprobs[start + 1 + j] = PromptTokenLogprobs(token, value, rank, ids, values)

    def _emit(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, now: float) -> bool:
        """Append one sampled token to `seq`; True when that ended it (a stop token or string,
        max_tokens)."""
        request = self._requests[seq.request_id]
        request.changed = True
        if seq.first_token_time is None:
            seq.first_token_time = now
        if request.logprobs is not None and logprobs is not None:
            request.logprobs[seq.index].append(logprobs)
        reason = seq.append_token(token)  # a stop token, or max_tokens
        grammar_done = False
        if seq.grammar is not None and reason is not FinishReason.STOP:
            if not seq.grammar.advance(token):  # the mask allows no such token: never expected
                logger.error("request %s: its grammar refused token %d; it is aborted", seq.request_id, token)
                self.scheduler.finish(seq, FinishReason.ABORT)
                return True
            grammar_done = seq.grammar.finished
        text = request.texts[seq.index]
        stop_string = None if reason is FinishReason.STOP else text.add(token)
        if stop_string is not None:
            seq.stop_reason = stop_string
            reason = FinishReason.STOP
        elif reason is None and grammar_done:  # the grammar is complete: nothing but the end may follow
            reason = FinishReason.STOP
        if reason is None:
            return False
        if stop_string is None:
            text.flush()
        self.scheduler.finish(seq, reason)
        return True

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for request_id in [rid for rid, r in self._requests.items() if r.changed]:
            request = self._requests[request_id]
            request.changed = False
            outputs.append(self._request_output(request))
            if request.finished:
                del self._requests[request_id]
                lora_name = request.seqs[0].lora_name
                if self.lora is not None and lora_name is not None:
                    self.lora.release(lora_name)
        return outputs

    def _request_output(self, request: _Request) -> RequestOutput:
        completions = []
        for seq, text in zip(request.seqs, request.texts, strict=True):
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text.visible(seq.is_finished),
                    token_ids=list(seq.output_token_ids),
                    finish_reason=None if seq.finish_reason is None else str(seq.finish_reason),
                    stop_reason=seq.stop_reason,
                    logprobs=None if request.logprobs is None else list(request.logprobs[seq.index]),
                )
            )
        metrics = request.metrics
        first = request.seqs[0]
        metrics.first_scheduled_time = min(
            (s.first_scheduled_time for s in request.seqs if s.first_scheduled_time is not None), default=None
        )
        metrics.first_token_time = min(
            (s.first_token_time for s in request.seqs if s.first_token_time is not None), default=None
        )
        metrics.num_generated_tokens = max(len(s.output_token_ids) for s in request.seqs)
        metrics.num_draft_tokens = sum(s.num_draft_tokens for s in request.seqs)
        metrics.num_accepted_tokens = sum(s.num_accepted_tokens for s in request.seqs)
        if request.finished:
            metrics.finished_time = max(s.finished_time or 0.0 for s in request.seqs)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=metrics,
            prompt_logprobs=None if request.prompt_logprobs is None else list(request.prompt_logprobs),
        )


def _relabel(found: TokenLogprobs | None, token: int, logits: torch.Tensor) -> TokenLogprobs | None:
    """The logprobs entry of `token` at a row whose sampler drew another (the top ones stand)."""
    if found is None or found.token_id == token:
        return found
    logprob = float(torch.log_softmax(logits.float(), dim=-1)[token])
    return TokenLogprobs(token, logprob, found.top_token_ids, found.top_logprobs)
