"""LLMEngine: one loop that owns every request. `add_request` and `abort_request` only queue
work; `step` runs one iteration:

    aborts -> drafter.propose -> schedule -> drafter.fill -> runner.execute -> pooler.pool -> sample -> verify -> emit

The optional features (a drafter, an adapter set, a grammar set, a pooler) are declared in engine/
and picked once, when the engine is built (engine/feature_plan.py); the loop calls them the same
way whether they do anything or not."""

from __future__ import annotations

import functools
import itertools
import random
import time
import uuid

from compiled_engine.cache.block_manager import BlockManager
from compiled_engine.cache.events import CacheEvent
from compiled_engine.config import EngineConfig
from compiled_engine.engine.adapters import AdapterRequest
from compiled_engine.engine.drafting import DraftStats
from compiled_engine.engine.feature_plan import plan_features
from compiled_engine.engine.feature_state import PoolingState
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.request_state import RequestState
from compiled_engine.engine.request_validation import check_request, prompt_token_ids
from compiled_engine.engine.sampler import TokenLogprobs, make_sampler
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine.scheduler import Scheduler, SchedulerOutput
from compiled_engine.engine.sequence import FinishReason, Sequence
from compiled_engine.engine.step_inputs import logit_count, step_inputs
from compiled_engine.engine.verifier import Verifier
from compiled_engine.errors import RequestError
from compiled_engine.executor.kv_pool import return_freed_heap
from compiled_engine.executor.ranks import start_runner
from compiled_engine.executor.step import NoOutput
from compiled_engine.executor.threads import set_threads
from compiled_engine.linear.packed_cpu import packed_bytes
from compiled_engine.profiling import nvtx_range
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.weights.source import resolve_model_dir


class LLMEngine:
    def __init__(self, config: EngineConfig, record_cache_events: bool = False) -> None:
        """`record_cache_events`: keep the prefix cache's events for `take_cache_events` (a
        data-parallel replica's front end and a KV-event publisher follow the cache by them)."""
        if config.data_parallel_size != 1:
            raise ValueError(
                "an engine is one replica: data parallelism runs replicas behind the server's front end "
                "(serve --data-parallel-size)"
            )
        self.config = config
        set_threads(config)  # before any weight is read or kernel compiled
        self.model_dir = resolve_model_dir(config.model)
        features = plan_features(config, self.model_dir)
        self.runner, self.ranks = start_runner(
            config, self.model_dir, features.drafter.shared_pool, features.adapters.install
        )
        self.drafter = features.drafter.start(self.runner)
        self.adapters = features.adapters.start(self.runner.adapter_slots, self.runner.model_config)
        self.pooler = features.pooler
        self.pooling = self.pooler.config  # what its clients are told (/v1/embeddings); None: it generates text
        return_freed_heap()
        has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer(self.model_dir) if has_tokenizer else None
        self.eos_token_ids = (
            self.tokenizer.eos_token_ids if self.tokenizer else frozenset(self.runner.model_config.eos_token_ids)
        )
        tokenizer_file = self.model_dir / "tokenizer.json" if has_tokenizer else None
        self.grammars = features.grammars(tokenizer_file, self.runner.model_config.vocab_size, self.eos_token_ids)
        self.block_manager = BlockManager(
            self.runner.num_pages, self.runner.page_size, config.enable_prefix_caching, record_cache_events
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.adapters.must_wait,
            self.pooler.reads_whole_prompt,
        )
        self.sampler = make_sampler(config.sampler, self.runner.device, config.seed)
        self.verifier = Verifier(self.sampler, self.grammars)
        self._rng = random.Random(config.seed)
        self._requests: dict[str, RequestState] = {}
        self._pending_aborts: set[str] = set()
        self.num_aborted_requests = 0  # requests ended before they finished: aborted, or in a failed step
        self._seq_ids = itertools.count()
        if self.ranks is not None:  # all built: rank 0's idle broadcasts may start
            self.runner.send_while_idle(self.ranks.all_alive)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def speculative_stats(self) -> DraftStats | None:
        return self.drafter.stats

    @functools.cached_property
    def weight_bytes(self) -> int:
        """Weight memory of this process: the model's (and a draft's) tensors (the compiled CPU
        path's packed weights among them), and any packed copy kept beside a dense weight (the
        fallback of linear/packed_cpu.py). Fixed once the engine is built, so counted once
        (every /metrics scrape reads it)."""
        return sum(runner.weight_bytes for runner in [self.runner, *self.drafter.runners]) + packed_bytes()

    @functools.cached_property
    def kv_cache_bytes(self) -> int:
        return sum(runner.kv_cache_bytes for runner in [self.runner, *self.drafter.runners])

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: AdapterRequest | None = None,
    ) -> str:
        """Queue a request and return its id. An invalid one raises a RequestError (a PromptError
        for the prompt checks of request_validation, a LoRAError for its adapter) and leaves
        nothing queued. With `lora_request` it runs with that adapter, loaded now if new."""
        params = params or SamplingParams()
        poolings = self.pooler.states(False, params.n)  # a pooling engine refuses it
        return self._queue(prompt, params, request_id, cache_salt, lora_request, poolings)

    def add_pooling_request(
        self,
        prompt: str | list[int],
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: AdapterRequest | None = None,
    ) -> str:
        """Queue a prompt to pool into one embedding (an engine with runner pooling); its last
        output carries `embedding`. The prompt checks are add_request's."""
        params = SamplingParams(temperature=0.0, max_tokens=1)
        poolings = self.pooler.states(True, params.n)  # a generating engine refuses it
        return self._queue(prompt, params, request_id, cache_salt, lora_request, poolings)

    def _queue(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None,
        cache_salt: str | None,
        lora_request: AdapterRequest | None,
        poolings: list[PoolingState | None],
    ) -> str:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        prompt_ids = prompt_token_ids(prompt, self.tokenizer, str(self.model_dir))
        vocab_size, has_tokenizer = self.runner.model_config.vocab_size, self.tokenizer is not None
        check_request(prompt_ids, params, vocab_size, self.runner.max_model_len, has_tokenizer)
        spec = params.structured_outputs
        constraints = self.grammars.states(spec, params.n) if spec is not None else [None] * params.n
        adapter = self.adapters.admit(lora_request)  # held from here until the request finishes
        request = RequestState.start(
            request_id, prompt, prompt_ids, params, self.tokenizer,
            seq_ids=self._seq_ids, rng=self._rng, eos_token_ids=self.eos_token_ids, cache_salt=cache_salt,
            adapter=adapter, grammars=constraints, poolings=poolings,
        )  # fmt: skip
        self._requests[request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Ends the request at the next step boundary, returning its pages (unknown ids are ignored:
        the request may have just finished)."""
        if request_id in self._requests:
            self._pending_aborts.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached page (`POST /reset_prefix_cache`); False while requests hold pages."""
        return self.block_manager.reset_prefix_cache()

    def take_cache_events(self) -> list[CacheEvent]:
        """The prefix cache's events since the last call (none unless `record_cache_events`)."""
        return self.block_manager.take_events()

    # -- the loop -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the other ranks, if any (the engine is unusable afterwards)."""
        if self.ranks is not None:
            ranks, self.ranks = self.ranks, None
            ranks.shutdown(self.runner.stop_workers)

    def step(self) -> list[RequestOutput]:
        if self.ranks is not None:
            self.ranks.check_alive()
        self._apply_aborts()
        with nvtx_range("schedule"):
            self.drafter.propose(self.scheduler.running, self.max_model_len)
            out = self.scheduler.schedule()
        if not out.is_empty:
            try:
                self._run_scheduled(out)
            except BaseException:
                # A failed forward or sampling step (an error in a kernel, a lost rank) ends the
                # step's requests with `abort` and returns every page they held before the error
                # goes on up; the rest of the queue is untouched.
                for request_id in {item.seq.request_id for item in out.scheduled}:
                    if self._abort(self._requests[request_id], pages_written=False):
                        self.num_aborted_requests += 1
                raise
        with nvtx_range("detokenize"):
            return self._collect_outputs()

    def _run_scheduled(self, out: SchedulerOutput) -> None:
        """Draft, run the forward, pool the pooled sequences' rows, sample and verify the others'
        (an engine pools every sequence or none)."""
        scheduled = [item.seq for item in out.scheduled]
        with nvtx_range("draft"):
            draft_probs = self.drafter.fill(scheduled, self.scheduler.running)
        batch = [(item.seq, item.num_tokens) for item in out.scheduled]
        with nvtx_range("prepare inputs"):
            inputs = step_inputs(batch, self.adapters.slots_for(scheduled), out.page_copies, self.pooler.wants)
        output = self.runner.execute(inputs)
        assert not isinstance(output, NoOutput)  # rank 0's runner answers
        sampled, logits = self.pooler.pool(batch, output.rows)
        first_rows, row = {}, 0  # each sequence's first row to sample: it has 1 + drafts
        for seq, num_new in sampled:
            count = logit_count(seq, num_new)  # its logits rows
            if seq.wants_prompt_logprobs:
                self._requests[seq.request_id].record_prompt_logprobs(seq, logits[row : row + count])
            first_rows[seq.seq_id] = row + count - 1 - len(seq.draft_token_ids)
            row += count
        due = self.scheduler.advance(out)
        for seq, embedding in self.pooler.results(due):  # its prompt is all in: it is done
            self._requests[seq.request_id].embed(seq, embedding)
            self.scheduler.finish(seq, FinishReason.STOP)
        due = [seq for seq in due if not seq.is_finished]
        if due:
            with nvtx_range("sample"):
                verified = self.verifier.verify(logits, first_rows, due, draft_probs)
            now = time.perf_counter()
            for item in verified:
                seq, proposed = item.seq, len(item.seq.draft_token_ids)
                emitted = self._emit(seq, item.token_ids, item.logprobs, now)
                accepted = min(emitted, len(item.token_ids) - 1)  # of its draft tokens
                self.drafter.record(seq, proposed, accepted)
                if not seq.is_finished:
                    self.scheduler.accept_draft(seq, accepted)

    def _apply_aborts(self) -> None:
        for request_id in self._pending_aborts:
            request = self._requests.get(request_id)
            if request is not None and self._abort(request):  # counted once its pages are back
                self.num_aborted_requests += 1
        self._pending_aborts.clear()

    def _abort(self, request: RequestState, pages_written: bool = True) -> bool:
        """End the request's unfinished sequences with `abort` (see Scheduler.finish for
        `pages_written`); whether it had any."""
        unfinished = [seq for seq in request.seqs if not seq.is_finished]
        for seq in unfinished:
            self.scheduler.finish(seq, FinishReason.ABORT, pages_written=pages_written)
        request.changed = True
        return bool(unfinished)

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None], now: float) -> int:
        """Append `tokens` to `seq` in turn until one ends it; how many were appended."""
        request = self._requests[seq.request_id]
        for count, (token, token_logprobs) in enumerate(zip(tokens, logprobs, strict=True), start=1):
            reason = request.append_token(seq, token, token_logprobs, now, self.grammars)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                return count
        return len(tokens)

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for request_id in [rid for rid, r in self._requests.items() if r.changed]:
            request = self._requests[request_id]
            request.changed = False
            outputs.append(request.output())
            if request.finished:
                del self._requests[request_id]
                self.adapters.release(request.adapter)
        return outputs
