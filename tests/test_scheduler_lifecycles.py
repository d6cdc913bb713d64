"""Scheduler + BlockManager driven through random request lifecycles, with no model.

A harness plays the engine's part (`LLMEngine.step`): aborts between steps, then `schedule()`,
a stand-in for the forward pass, `advance(out)`, and one random token appended to each sequence
due one, finishing it when `append_token` says so. The forward pass is replaced by a shadow KV
cache: every computed token id is written into the slot of the page that the block table names,
and each page remembers the salt of the sequence that wrote it. Every computed position of every
running sequence must then read back its own token under its own salt, which catches a
prefix-cache hit, a forked prompt or an evicted and reused page that hands a sequence somebody
else's K/V; and K/V may only be written into a page its writer alone holds.

After every operation: `check_consistency` over the running block tables, waiting sequences hold
no pages, the queues hold exactly the unfinished sequences, computed <= tokens, block tables hold
at least ceil(computed / page_size) pages (and no more than the tokens need), hits <= queried.
Every step: the token budget and `max_num_seqs` hold, something is scheduled whenever
anything is unfinished, and the queue is first come, first served except that an n > 1 sibling
waiting for its fork parent's prompt is passed over (it never holds up the queue behind it). Each example ends by stepping until everything finishes (a step cap
catches a livelock) and checks that every page is free with refcount zero.

Pools are small (8..40 pages of 1..8 tokens, 1..64 tokens a step, 1..8 sequences) and prompts come
from a vocabulary of 8 ids with shared prefixes, so preemption, prefix-cache hits and evictions
happen all the time. At least 10,200 request lifecycles in all (600 examples of 17..30 requests)
in the full tier (`make test-full`), 2,040 (120 examples) in the quick one.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_engine.cache.block_manager import BlockManager
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine.scheduler import Scheduler, SchedulerOutput
from compiled_engine.engine.sequence import FinishReason, Sequence, SequenceStatus

VOCAB = 8  # prompt and output ids are 0..7
STOP = VOCAB  # the stop (eos) id: never in a prompt, drawn now and then as an output
STOP_CHANCE = 0.05
SALTS: tuple[str | None, ...] = (None, "a", "b")
MAX_PROMPT = 80
# Prompts start with a prefix of one of these, so that prefix-cache hits are common.
_BASE_RNG = random.Random(20240601)
BASE_PROMPTS = [[_BASE_RNG.randrange(VOCAB) for _ in range(MAX_PROMPT)] for _ in range(3)]

REQUESTS_PER_EXAMPLE = (17, 30)  # min, max requests in one example
# The full tier runs at least 17 * 600 = 10,200 request lifecycles; the quick one (`make test`)
# the same property over at least 17 * 120 = 2,040.
FULL_EXAMPLES, FULL_LIFECYCLES = 600, 10_000
QUICK_EXAMPLES, QUICK_LIFECYCLES = 120, 2_000

# Filled while the property runs; checked by `test_random_lifecycles` afterwards.
COUNTERS: Counter[str] = Counter()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Request:
    base: int  # which BASE_PROMPTS entry the prompt starts with
    shared: int  # how many of its tokens
    length: int  # prompt length before clamping to the pool
    tail_seed: int  # the rest of the prompt
    salt: str | None
    max_tokens: int
    n: int


@dataclass(frozen=True)
class Action:
    abort: bool  # abort a random unfinished sequence, else step
    steps: int  # how many steps, when stepping
    pick: int  # which unfinished sequence, when aborting
    seed: int  # the tokens sampled, when stepping


@dataclass(frozen=True)
class Config:
    num_pages: int
    page_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    prefix_caching: bool


class Harness:
    """The engine's loop around a Scheduler and its BlockManager, checked after every operation."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.bm = BlockManager(config.num_pages, config.page_size, config.prefix_caching)
        self.sched = Scheduler(self.bm, config.max_num_seqs, config.max_num_batched_tokens)
        self.seqs: list[Sequence] = []  # indexed by seq_id
        self.live: set[int] = set()  # ids of the unfinished ones, as of the last `check`
        self.aborted: set[int] = set()
        # Shadow KV cache: the token id computed into each slot of each page, and the salt of the
        # one sequence that wrote the page.
        self.shadow: dict[int, list[int | None]] = {}
        self.shadow_salt: dict[int, str | None] = {}
        self.steps = 0

    # -- operations -----------------------------------------------------------------------------

    def add(self, request: Request) -> list[Sequence]:
        capacity = self.config.num_pages * self.config.page_size
        # The engine rejects a request whose prompt + max_tokens cannot fit the whole pool; clamp
        # it to the largest that does instead, so that every example runs all its lifecycles.
        max_tokens = min(request.max_tokens, capacity - 1)
        length = max(1, min(request.length, capacity - max_tokens))
        shared = min(request.shared, length)
        tail = random.Random(request.tail_seed)
        prompt = BASE_PROMPTS[request.base][:shared] + [tail.randrange(VOCAB) for _ in range(length - shared)]
        assert self.bm.pages_for_tokens(len(prompt) + max_tokens) <= self.config.num_pages
        params = SamplingParams(n=request.n, temperature=0.0, max_tokens=max_tokens)
        seqs: list[Sequence] = []
        for index in range(request.n):  # as LLMEngine.add_request builds them
            seqs.append(
                Sequence(
                    len(self.seqs) + index,
                    list(prompt),
                    params,
                    frozenset({STOP}),
                    request_id=f"r{len(self.seqs)}",
                    index=index,
                    cache_salt=request.salt,
                    fork_of=seqs[0] if index else None,
                )
            )
        for seq in seqs:
            self.sched.add(seq)
        self.seqs.extend(seqs)
        self.live.update(seq.seq_id for seq in seqs)
        COUNTERS["requests"] += 1
        COUNTERS["sequences"] += len(seqs)
        self.check()
        return seqs

    def abort(self, pick: int) -> None:
        """Abort a waiting, prefilling or decoding sequence (`pick` % 3 says which, if any)."""
        buckets: dict[str, list[Sequence]] = {"waiting": list(self.sched.waiting)}
        buckets["prefilling"] = [s for s in self.sched.running if s.is_prefilling]
        buckets["decoding"] = [s for s in self.sched.running if not s.is_prefilling]
        states = list(buckets)
        for state in states[pick % 3 :] + states[: pick % 3]:
            if buckets[state]:
                seq = buckets[state][(pick // 3) % len(buckets[state])]
                break
        else:
            return
        COUNTERS[f"aborts_{state}"] += 1
        self.sched.finish(seq, FinishReason.ABORT)
        self.aborted.add(seq.seq_id)
        assert seq.is_finished and seq.block_table == []
        self.check()

    def step(self, rng: random.Random) -> None:
        page_size = self.bm.page_size
        had_work = self.sched.has_unfinished
        queue_before = list(self.sched.waiting)
        waiting_before = {s.seq_id for s in queue_before}
        queried_before = self.bm.stats.queried_tokens
        hits_before = self.bm.stats.hit_tokens
        out = self.sched.schedule()
        self.steps += 1
        self.check_schedule(out, had_work)
        COUNTERS["preemptions"] += len(out.preempted)
        # Admissions: hits cover whole pages and then, through one page copy, part of the next;
        # never the last token.
        admitted = [item.seq for item in out.scheduled if item.seq.seq_id in waiting_before]
        self.check_queue_order(queue_before, admitted)
        copies = {copy.dst: copy for copy in out.page_copies}
        assert len(copies) == len(out.page_copies)
        for seq in admitted:
            partial = seq.num_computed_tokens % page_size
            if partial:
                copy = copies.pop(seq.block_table[seq.num_computed_tokens // page_size])
                assert copy.num_tokens == partial
                COUNTERS["page_copies"] += 1
            assert 0 <= seq.num_computed_tokens < seq.num_tokens
            if seq.num_computed_tokens:
                forked = seq.fork_of is not None and seq.fork_of.status is SequenceStatus.RUNNING
                assert forked or self.config.prefix_caching
                COUNTERS["fork_shares" if forked else "prefix_hits"] += 1
        assert self.bm.stats.queried_tokens - queried_before == sum(s.num_tokens for s in admitted)
        assert self.bm.stats.hit_tokens - hits_before == sum(s.num_computed_tokens for s in admitted)
        self.bm.check_consistency([s.block_table for s in self.sched.running])
        assert not copies, "a page copy for no admitted sequence"
        # The forward pass: first the page copies, in order (what the source holds now, under
        # its writer's salt; the rest of the page is garbage); then each scheduled token into
        # its slot. Pages past the computed ones were just handed out (fresh or evicted):
        # whatever they held before is gone.
        for copy in out.page_copies:
            held = self.shadow[copy.src][: copy.num_tokens]
            self.shadow[copy.dst] = held + [None] * (page_size - copy.num_tokens)
            self.shadow_salt[copy.dst] = self.shadow_salt[copy.src]
        for item in out.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            for index in range(ceil_div(start, page_size), len(seq.block_table)):
                self.shadow[seq.block_table[index]] = [None] * page_size
                self.shadow_salt[seq.block_table[index]] = seq.cache_salt
            tokens = seq.token_ids
            for pos in range(start, start + item.num_tokens):
                page = seq.block_table[pos // page_size]
                # K/V is only ever written into a page this sequence alone holds.
                assert self.bm.refcount(page) == 1, f"seq {seq.seq_id} writes shared page {page}"
                assert self.shadow_salt[page] == seq.cache_salt
                self.shadow[page][pos % page_size] = tokens[pos]
        due = self.sched.advance(out)
        assert due == [item.seq for item in out.scheduled if item.seq.num_computed_tokens == item.seq.num_tokens]
        for seq in due:
            token = STOP if rng.random() < STOP_CHANCE else rng.randrange(VOCAB)
            reason = seq.append_token(token)
            if reason is not None:
                self.sched.finish(seq, reason)
        self.check()

    def drain(self, rng: random.Random) -> None:
        # Every step computes at least one token (checked in `check_schedule`); a preempted
        # sequence recomputes what it had, hence the generous factor. Far beyond it is a livelock.
        work = sum(s.num_tokens + s.params.max_tokens for s in self.seqs if not s.is_finished)
        cap = 50 * work + 100
        start = self.steps
        while self.sched.has_unfinished:
            assert self.steps - start < cap, f"no end after {cap} steps: livelock"
            self.step(rng)
        COUNTERS["max_drain_steps"] = max(COUNTERS["max_drain_steps"], self.steps - start)

    # -- checks ---------------------------------------------------------------------------------

    def check_schedule(self, out: SchedulerOutput, had_work: bool) -> None:
        config, bm = self.config, self.bm
        assert out.num_tokens <= config.max_num_batched_tokens
        assert len(out.scheduled) <= config.max_num_seqs
        assert len(self.sched.running) <= config.max_num_seqs
        if had_work:  # something always runs: an idle step with work queued would spin forever
            assert out.scheduled, "nothing scheduled while sequences are unfinished"
        ids = [item.seq.seq_id for item in out.scheduled]
        assert len(ids) == len(set(ids))
        for item in out.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING and seq in self.sched.running
            assert 1 <= item.num_tokens <= seq.num_uncomputed_tokens
            assert len(seq.block_table) >= bm.pages_for_tokens(seq.num_computed_tokens + item.num_tokens)
        for seq in out.preempted:
            assert seq.seq_id not in ids
            assert seq.status is SequenceStatus.WAITING and seq in self.sched.waiting
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            assert seq.num_preemptions >= 1

    def check_queue_order(self, queue: list[Sequence], admitted: list[Sequence]) -> None:
        """First come, first served: a waiting sequence is passed over only while it is an n > 1
        sibling waiting for its fork parent's prompt, and it never holds up the queue behind it."""
        admitted_ids = {s.seq_id for s in admitted}
        last = max((i for i, s in enumerate(queue) if s.seq_id in admitted_ids), default=0)
        for seq in queue[:last]:
            if seq.seq_id not in admitted_ids:
                parent = seq.fork_of
                assert parent is not None and parent.status is SequenceStatus.RUNNING
                assert parent.is_prefilling, f"seq {seq.seq_id} was overtaken"
                COUNTERS["forks_overtaken"] += 1

    def check(self) -> None:
        bm, sched, page_size = self.bm, self.sched, self.bm.page_size
        running, waiting = sched.running, list(sched.waiting)
        bm.check_consistency([s.block_table for s in running])
        assert 0 <= bm.stats.hit_tokens <= bm.stats.queried_tokens
        if not self.config.prefix_caching:  # only forked prompts share pages
            assert bm.num_cached_pages == 0 and bm.stats.evictions == 0
        assert len(running) <= self.config.max_num_seqs
        running_ids = {s.seq_id for s in running}
        waiting_ids = {s.seq_id for s in waiting}
        assert len(running_ids) == len(running) and len(waiting_ids) == len(waiting)
        assert not running_ids & waiting_ids
        # Sequences leave the queues only by finishing, and only known ones are in them.
        live = running_ids | waiting_ids
        assert live <= self.live
        for seq_id in self.live - live:
            seq = self.seqs[seq_id]
            assert seq.is_finished and seq.block_table == [] and seq.finish_reason is not None
        self.live = live
        for seq in waiting:
            assert seq.status is SequenceStatus.WAITING
            assert not seq.block_table and not seq.page_keys and seq.num_computed_tokens == 0
        for seq in running:
            assert seq.status is SequenceStatus.RUNNING
            computed = seq.num_computed_tokens
            assert 0 <= computed <= seq.num_tokens
            assert len(seq.output_token_ids) <= seq.params.max_tokens
            table = seq.block_table
            assert bm.pages_for_tokens(computed) <= len(table) <= bm.pages_for_tokens(seq.num_tokens)
            # Every computed position reads back its own token, written under its own salt.
            tokens = seq.token_ids
            for index in range(ceil_div(computed, page_size)):
                page = table[index]
                start, end = index * page_size, min(computed, (index + 1) * page_size)
                held = self.shadow[page][: end - start]
                assert held == tokens[start:end] and self.shadow_salt[page] == seq.cache_salt, (
                    f"seq {seq.seq_id} (salt {seq.cache_salt!r}) page {index} = {page} holds "
                    f"{held} (salt {self.shadow_salt[page]!r}), expected {tokens[start:end]}"
                )

    def check_end(self) -> None:
        assert not self.sched.has_unfinished
        self.bm.check_consistency([])
        assert self.bm.num_free_pages == self.bm.num_pages, "pages leaked"
        assert all(self.bm.refcount(page) == 0 for page in range(self.bm.num_pages))
        assert not self.live
        for seq in self.seqs:
            assert seq.is_finished and seq.block_table == []
            assert len(seq.output_token_ids) <= seq.params.max_tokens
            outputs = seq.output_token_ids
            if seq.seq_id in self.aborted:
                assert seq.finish_reason is FinishReason.ABORT
            elif seq.finish_reason is FinishReason.STOP:
                assert outputs[-1] == STOP and STOP not in outputs[:-1]
            else:
                assert seq.finish_reason is FinishReason.LENGTH
                assert len(outputs) == seq.params.max_tokens and STOP not in outputs
        COUNTERS["examples"] += 1
        COUNTERS["examples_with_hits"] += self.bm.stats.hit_tokens > 0
        COUNTERS["examples_with_evictions"] += self.bm.stats.evictions > 0
        COUNTERS["hit_tokens"] += self.bm.stats.hit_tokens
        COUNTERS["evictions"] += self.bm.stats.evictions
        COUNTERS["steps"] += self.steps


# -- strategies ---------------------------------------------------------------------------------

configs = st.builds(
    Config,
    num_pages=st.integers(8, 40),
    page_size=st.integers(1, 8),
    max_num_batched_tokens=st.integers(1, 64),
    max_num_seqs=st.integers(1, 8),
    prefix_caching=st.integers(0, 4).map(lambda roll: roll != 4),  # off in one example in five
)
requests = st.builds(
    Request,
    base=st.integers(0, len(BASE_PROMPTS) - 1),
    shared=st.integers(0, MAX_PROMPT),
    length=st.integers(1, MAX_PROMPT),
    tail_seed=st.integers(0, 2**32 - 1),
    salt=st.sampled_from(SALTS),
    max_tokens=st.integers(1, 20),
    n=st.integers(1, 3),
)
actions = st.builds(
    Action,
    abort=st.integers(0, 5).map(lambda roll: roll == 5),  # one action in six aborts
    steps=st.integers(1, 8),
    pick=st.integers(0, 1000),
    seed=st.integers(0, 2**32 - 1),
)
rounds = st.lists(
    st.tuples(requests, st.lists(actions, max_size=3)),
    min_size=REQUESTS_PER_EXAMPLE[0],
    max_size=REQUESTS_PER_EXAMPLE[1],
)


@given(config=configs, rounds=rounds, drain_seed=st.integers(0, 2**32 - 1))
def run_lifecycles(config: Config, rounds: list[tuple[Request, list[Action]]], drain_seed: int) -> None:
    harness = Harness(config)
    for request, round_actions in rounds:
        harness.add(request)
        for action in round_actions:
            if action.abort:
                harness.abort(action.pick)
            else:
                rng = random.Random(action.seed)
                for _ in range(action.steps):
                    harness.step(rng)
    harness.drain(random.Random(drain_seed))
    harness.check_end()


def _random_lifecycles(examples: int, lifecycles: int) -> None:
    COUNTERS.clear()
    settings(
        max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
    )(run_lifecycles)()
    print(dict(COUNTERS))
    assert COUNTERS["examples"] >= examples
    assert COUNTERS["requests"] >= lifecycles
    # The interesting paths were taken, not just the easy ones.
    assert COUNTERS["preemptions"] > 0
    assert COUNTERS["examples_with_hits"] > 0 and COUNTERS["prefix_hits"] > 0 and COUNTERS["page_copies"] > 0
    assert COUNTERS["examples_with_evictions"] > 0
    assert COUNTERS["fork_shares"] > 0 and COUNTERS["forks_overtaken"] > 0
    for state in ("waiting", "prefilling", "decoding"):
        assert COUNTERS[f"aborts_{state}"] > 0, f"no sequence was aborted while {state}"


def test_random_lifecycles() -> None:
    _random_lifecycles(QUICK_EXAMPLES, QUICK_LIFECYCLES)


@pytest.mark.full
def test_random_lifecycles_at_scale() -> None:
    _random_lifecycles(FULL_EXAMPLES, FULL_LIFECYCLES)


# -- deterministic cases ------------------------------------------------------------------------


def new_seq(seq_id: int, prompt: list[int], salt: str | None, max_tokens: int = 8) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Sequence(seq_id, list(prompt), params, frozenset({STOP}), cache_salt=salt)


def step_once(sched: Scheduler) -> None:
    """One engine step; every due sequence gets token 0."""
    for seq in sched.advance(sched.schedule()):
        reason = seq.append_token(0)
        if reason is not None:
            sched.finish(seq, reason)


def admit(sched: Scheduler, seq: Sequence) -> None:
    """Add `seq` and step until its prompt is computed (the pool and budget are ample)."""
    sched.add(seq)
    step_once(sched)
    assert seq.status is SequenceStatus.RUNNING and not seq.is_prefilling


def test_different_salts_never_share_pages() -> None:
    bm = BlockManager(num_pages=64, page_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    prompt = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5]  # three full pages and one token
    a = new_seq(0, prompt, "a")
    admit(sched, a)
    assert a.num_cached_tokens == 0 and bm.num_cached_pages == 3

    others = []
    for seq_id, salt in enumerate(["b", None], start=1):
        other = new_seq(seq_id, prompt, salt)
        hits_before = bm.stats.hit_tokens
        admit(sched, other)
        assert other.num_cached_tokens == 0 and bm.stats.hit_tokens == hits_before
        assert not set(other.block_table) & set(a.block_table)
        others.append(other)
    assert not set(others[0].block_table) & set(others[1].block_table)

    again = new_seq(3, prompt, "a")
    admit(sched, again)
    assert again.num_cached_tokens == 12  # the three full pages
    assert again.block_table[:3] == a.block_table[:3]
    assert not set(again.block_table[3:]) & set(a.block_table)
    assert not set(again.block_table) & set(others[0].block_table + others[1].block_table)

    # Once everybody is gone the cached pages stay keyed by salt: "b" finds only b's pages.
    b_pages = others[0].block_table[:3]
    for seq in list(sched.running):
        sched.finish(seq, FinishReason.ABORT)
    b_again = new_seq(4, prompt, "b")
    admit(sched, b_again)
    assert b_again.num_cached_tokens == 12 and b_again.block_table[:3] == b_pages
    sched.finish(b_again, FinishReason.ABORT)
    bm.check_consistency([])
    assert bm.num_free_pages == bm.num_pages


def test_partial_page_is_never_shared() -> None:
    bm = BlockManager(num_pages=16, page_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    prompt = [1, 2, 3, 4, 5, 6]  # one full page and half a page
    first = new_seq(0, prompt, None)
    admit(sched, first)
    assert len(first.block_table) == 2 and bm.num_cached_pages == 1

    second = new_seq(1, prompt, None)
    admit(sched, second)
    assert second.num_cached_tokens == 4  # the full page only
    assert second.block_table[0] == first.block_table[0]
    assert second.block_table[1] != first.block_table[1]
    assert bm.refcount(first.block_table[0]) == 2
    assert bm.refcount(first.block_table[1]) == 1 and bm.refcount(second.block_table[1]) == 1

    # A longer prompt through the same six tokens still reuses only the full page.
    third = new_seq(2, [*prompt, 7, 7, 7], None)
    admit(sched, third)
    assert third.num_cached_tokens == 4
    assert third.block_table[0] == first.block_table[0]
    assert not set(third.block_table[1:]) & set(first.block_table + second.block_table)

    # By now `first` has decoded two tokens (0, 0) into its second page, which became full and so
    # shareable: a prompt that runs through those eight tokens reuses both pages.
    assert first.token_ids[:8] == [*prompt, 0, 0] and first.num_computed_tokens == 8
    fourth = new_seq(3, [*prompt, 0, 0, 7], None)
    admit(sched, fourth)
    assert fourth.num_cached_tokens == 8
    assert fourth.block_table[:2] == first.block_table[:2]

    bm.check_consistency([s.block_table for s in sched.running])
    for seq in list(sched.running):
        sched.finish(seq, FinishReason.ABORT)
    assert bm.num_free_pages == bm.num_pages
