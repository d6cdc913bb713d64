"""Scheduler: decides, each step, which sequences run and how many tokens each computes.

One step: running decodes first (one token each), then running sequences still prefilling
(chunks), then waiting sequences in arrival order, until the token budget
(`max_num_batched_tokens`) or `max_num_seqs` runs out. A waiting sequence short of pages stops
admission (nobody overtakes it); an n > 1 sibling waiting for its fork parent to finish computing
their shared prompt is passed over instead, so it never holds up the requests behind it.

When a running sequence needs a page and none is free, the newest running sequence not yet
scheduled this step is preempted: its pages go back to the pool and it waits, first in line, to be
recomputed. The output is plain data; the scheduler never touches a tensor, so it is tested with no
model at all.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from compiled_engine.cache.block_manager import BlockManager, PageCopy
from compiled_engine.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # new tokens computed for it this step


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # K/V to copy before the forward: admitted prompts continuing a cached page's first tokens
    page_copies: list[PageCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        must_wait: Callable[[Sequence, list[Sequence]], bool] = lambda seq, running: False,
        reads_whole_prompt: Callable[[Sequence], bool] = lambda seq: False,
    ) -> None:
        """`must_wait(seq, running)`: whether a waiting sequence cannot join the running ones yet
        for a reason of its own, such as an adapter that would need a device slot while every
        slot is taken (engine/adapters.py); it keeps its place, and the queue behind it goes on.
        `reads_whole_prompt(seq)`: whether its pooling needs every prompt token's hidden state
        (engine/pooler.py), so that its prompt takes no prefix-cache hits."""
        self.block_manager = block_manager
        self.must_wait = must_wait
        self.reads_whole_prompt = reads_whole_prompt
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: newest last
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        chosen: set[int] = set()
        decodes = [s for s in self.running if not s.is_prefilling]
        prefills = [s for s in self.running if s.is_prefilling]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_uncomputed_tokens + len(seq.draft_token_ids), budget)
            del seq.draft_token_ids[max(num_new - seq.num_uncomputed_tokens, 0) :]  # the drafts that fit
            if not self._make_room(seq, num_new, chosen, out):
                continue
            self.block_manager.grow(seq.block_table, seq.num_computed_tokens + num_new)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            chosen.add(seq.seq_id)
            budget -= num_new
        # Admitting while preempting would only evict again: wait for pages to come back.
        position = 0  # the first waiting sequence not passed over this step
        while (
            position < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted
        ):
            seq = self.waiting[position]
            if self._waits_for_fork_parent(seq) or self.must_wait(seq, self.running):
                # It waits for pages that are on their way, or for a running adapter to finish,
                # not for free pages: the queue behind it goes on, and it keeps its place.
                position += 1
                continue
            num_new = self._admit(seq, budget, out)
            if num_new == 0:
                break  # first come, first served: nobody overtakes a sequence short of pages
            del self.waiting[position]
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            chosen.add(seq.seq_id)
            budget -= num_new
        return out

    def _make_room(self, seq: Sequence, num_new: int, chosen: set[int], out: SchedulerOutput) -> bool:
        """Preempt newest-first until `seq` can grow by `num_new` tokens; False if `seq` itself
        had to go."""
        while not self.block_manager.can_hold(seq.block_table, seq.num_computed_tokens + num_new):
            victims = [s for s in self.running if s.seq_id not in chosen]
            victim = victims[-1]  # `seq` is among them, so never empty
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    @staticmethod
    def _waits_for_fork_parent(seq: Sequence) -> bool:
        """An n > 1 sibling whose fork parent is still computing the shared prompt: admitted now,
        it would compute the prompt a second time instead of sharing the parent's pages."""
        parent = seq.fork_of
        return parent is not None and parent.status is SequenceStatus.RUNNING and parent.is_prefilling

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Give a waiting sequence its pages (prefix-cache hits first, then the K/V of a cached
        page that continues them, copied); the tokens it computes this step, or 0 when it
        cannot start now."""
        manager = self.block_manager
        parent = seq.fork_of
        tail = None
        full_prompt_pages = (len(seq.prompt_token_ids) - 1) // self.block_manager.page_size
        if parent is not None and parent.status is SequenceStatus.RUNNING and seq.num_computed_tokens == 0:
            hits = parent.block_table[:full_prompt_pages]
            keys = parent.page_keys[: len(hits)]
        elif seq.wants_prompt_logprobs or self.reads_whole_prompt(seq):
            # every prompt token's logits (or hidden state, to pool) are needed: nothing cached
            hits, keys = [], []
        else:
            hits, keys = manager.match_prefix(seq.token_ids, seq.prefix_salt)
            tail = manager.match_tail(seq.token_ids, keys, seq.prefix_salt)
        cached = len(hits) * manager.page_size + (tail.num_tokens if tail is not None else 0)
        num_new = min(seq.num_tokens - cached, budget)
        needed = manager.pages_for_tokens(cached + num_new) - len(hits)
        available = manager.num_free_pages - manager.num_evictable_among(hits)
        if needed > available:
            return 0
        manager.record_lookup(seq.num_tokens, cached, tail.num_tokens if tail is not None else 0)
        seq.block_table = manager.share(hits)
        seq.page_keys = list(keys)
        seq.num_computed_tokens = cached
        if seq.first_scheduled_time is None:
            seq.num_cached_tokens = cached
            seq.first_scheduled_time = time.perf_counter()
        # The copy's source may be taken by this very growth (it is evictable): the copies run
        # before the forward writes any page, in the order they were made, so it is read first.
        manager.grow(seq.block_table, cached + num_new)
        if tail is not None:
            out.page_copies.append(PageCopy(tail.page, seq.block_table[len(hits)], tail.num_tokens))
        seq.status = SequenceStatus.RUNNING
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_pages(seq)
        seq.page_keys = []
        seq.draft_token_ids = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _free_pages(self, seq: Sequence) -> None:
        """Return a sequence's pages, its partly filled last page kept cached for a later prompt."""
        self.block_manager.free_keeping_last_page(
            seq.block_table, seq.page_keys, seq.token_ids, seq.num_computed_tokens, seq.prefix_salt
        )

    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """Record that the scheduled tokens were computed; the sequences now due a new token.
        A sequence's draft tokens are not counted until `accept_draft` says how many stand."""
        due = []
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens - len(seq.draft_token_ids)
            self.block_manager.register_full_pages(
                seq.block_table, seq.page_keys, seq.token_ids, seq.num_computed_tokens, seq.prefix_salt
            )
            if seq.num_computed_tokens == seq.num_tokens:
                due.append(seq)
        return due

    def accept_draft(self, seq: Sequence, accepted: int) -> None:
        """After verification: the first `accepted` draft tokens are now the sequence's own (its
        output holds them), so their K/V stands; the rest is rolled back. Pages past what the
        sequence now holds go back to the pool, and only full pages of its own tokens enter the
        prefix cache."""
        seq.num_computed_tokens += accepted
        seq.draft_token_ids = []
        self.block_manager.register_full_pages(
            seq.block_table, seq.page_keys, seq.token_ids, seq.num_computed_tokens, seq.prefix_salt
        )
        self.block_manager.truncate(seq.block_table, seq.num_tokens)

    def finish(self, seq: Sequence, reason: FinishReason, pages_written: bool = True) -> None:
        """End a sequence in any state and return its pages. `pages_written=False`: its step
        failed, so its last page may lack K/V it counts as computed, and is not kept."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if pages_written:
            self._free_pages(seq)
        else:
            self.block_manager.free(seq.block_table)
        seq.draft_token_ids = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.perf_counter()
