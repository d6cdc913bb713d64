"""The scheduler with no model: budgets, decode-first chunked prefill, FCFS, preemption and
resumption, aborts in every state. A fake step stands in for the forward pass."""

from __future__ import annotations

import itertools

import pytest

from compiled_engine.cache.block_manager import BlockManager, PageCopy
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine.scheduler import Scheduler, SchedulerOutput
from compiled_engine.engine.sequence import FinishReason, Sequence, SequenceStatus

_ids = itertools.count()


def make_seq(prompt_len: int, max_tokens: int = 4, first_token: int = 0) -> Sequence:
    prompt = [(first_token + i) % 50 for i in range(prompt_len)]
    return Sequence(next(_ids), prompt, SamplingParams(temperature=0, max_tokens=max_tokens))


def fake_step(scheduler: Scheduler) -> SchedulerOutput:
    """What the engine does around the forward pass: advance, append a token, finish."""
    out = scheduler.schedule()
    for seq in scheduler.advance(out):
        reason = seq.append_token(7)
        if reason is not None:
            scheduler.finish(seq, reason)
    return out


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished:
        outputs.append(fake_step(scheduler))
        assert len(outputs) < max_steps, "the scheduler stopped making progress"
    return outputs


def test_budget_and_max_num_seqs_are_never_exceeded() -> None:
    manager = BlockManager(num_pages=64, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=3, max_num_batched_tokens=10)
    seqs = [make_seq(n, max_tokens=5) for n in (3, 17, 9, 25, 1, 12)]
    for seq in seqs:
        scheduler.add(seq)
    for out in run_to_completion(scheduler):
        assert out.num_tokens <= 10
        assert len(out.scheduled) <= 3
        assert len(scheduler.running) <= 3
    assert all(seq.finish_reason is FinishReason.LENGTH and len(seq.output_token_ids) == 5 for seq in seqs)
    assert manager.num_free_pages == manager.num_pages


def test_decodes_keep_running_while_a_long_prompt_is_chunked() -> None:
    manager = BlockManager(num_pages=64, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=8)
    short = make_seq(3, max_tokens=20)
    scheduler.add(short)
    fake_step(scheduler)  # short is now decoding
    long = make_seq(100, max_tokens=2)
    scheduler.add(long)
    chunks = []
    while long.is_prefilling or long.status is SequenceStatus.WAITING:
        before = len(short.output_token_ids)
        out = fake_step(scheduler)
        assert out.scheduled[0].seq is short and out.scheduled[0].num_tokens == 1  # decode first
        assert len(short.output_token_ids) == before + 1
        chunks.append(next(s.num_tokens for s in out.scheduled if s.seq is long))
    assert chunks[:-1] == [7] * (len(chunks) - 1)  # the budget left after the decode
    assert sum(chunks) == 100


def test_first_come_first_served() -> None:
    manager = BlockManager(num_pages=6, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    big, small = make_seq(20, max_tokens=2, first_token=20), make_seq(2, max_tokens=2)
    hog = make_seq(8, max_tokens=2)
    scheduler.add(hog)
    fake_step(scheduler)
    scheduler.add(big)  # needs 5+ pages; only 3 free
    scheduler.add(small)  # would fit, but must not overtake big
    out = fake_step(scheduler)
    assert [s.seq for s in out.scheduled] == [hog]
    run_to_completion(scheduler)
    assert big.first_scheduled_time is not None and small.first_scheduled_time is not None
    assert big.first_scheduled_time < small.first_scheduled_time


def test_preemption_frees_the_newest_and_everything_completes() -> None:
    manager = BlockManager(num_pages=8, page_size=2)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [make_seq(4, max_tokens=8) for _ in range(3)]  # each ends at 12 tokens = 6 pages
    for seq in seqs:
        scheduler.add(seq)
    outputs = run_to_completion(scheduler)
    preempted = [seq for out in outputs for seq in out.preempted]
    assert preempted, "the pool is too small for all three: someone must be preempted"
    assert seqs[0] not in preempted  # the oldest is never the victim while newer ones run
    assert scheduler.num_preemptions == len(preempted)
    for seq in seqs:
        assert seq.finish_reason is FinishReason.LENGTH and len(seq.output_token_ids) == 8
    assert manager.num_free_pages == manager.num_pages


def test_preempted_sequence_recomputes_prompt_and_output() -> None:
    manager = BlockManager(num_pages=4, page_size=2, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = make_seq(2, max_tokens=6), make_seq(2, max_tokens=6)
    scheduler.add(old)
    scheduler.add(new)
    while not new.num_preemptions:
        fake_step(scheduler)
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    generated = len(new.output_token_ids)
    assert generated > 0
    out = fake_step(scheduler)
    while new not in [s.seq for s in out.scheduled]:
        out = fake_step(scheduler)
    # Back in: all its tokens so far (prompt and output) are computed again in one chunk.
    assert next(s.num_tokens for s in out.scheduled if s.seq is new) == 2 + generated
    assert len(new.output_token_ids) == generated + 1
    run_to_completion(scheduler)
    assert len(new.output_token_ids) == 6


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding"])
def test_abort_in_every_state_returns_every_page(state: str) -> None:
    manager = BlockManager(num_pages=32, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=1, max_num_batched_tokens=5)
    first, second = make_seq(12, max_tokens=50), make_seq(6, max_tokens=50)
    scheduler.add(first)
    scheduler.add(second)
    fake_step(scheduler)
    target = {"waiting": second, "prefilling": first}.get(state)
    if state == "decoding":
        while first.is_prefilling:
            fake_step(scheduler)
        target = first
    assert target is not None
    expected = {
        "waiting": SequenceStatus.WAITING,
        "prefilling": SequenceStatus.RUNNING,
        "decoding": SequenceStatus.RUNNING,
    }
    assert target.status is expected[state]
    assert target.is_prefilling == (state != "decoding")
    scheduler.finish(target, FinishReason.ABORT)
    assert target.finish_reason is FinishReason.ABORT and target.block_table == []
    run_to_completion(scheduler)
    assert manager.num_free_pages == manager.num_pages


def test_prefix_cache_hit_skips_the_cached_tokens() -> None:
    manager = BlockManager(num_pages=32, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    first = make_seq(10, max_tokens=1)
    scheduler.add(first)
    out = scheduler.schedule()
    first_pages = list(first.block_table)
    for seq in scheduler.advance(out):
        scheduler.finish(seq, FinishReason.LENGTH)
    again = make_seq(10, max_tokens=1)
    scheduler.add(again)
    out = scheduler.schedule()
    # Two full pages shared, then the first one of the two tokens the finished sequence left in
    # its last page, copied; the last token is always computed.
    assert again.num_cached_tokens == 9
    assert out.scheduled[0].num_tokens == 1
    assert again.block_table[:2] == first_pages[:2] and again.block_table[2] != first_pages[2]
    assert out.page_copies == [PageCopy(first_pages[2], again.block_table[2], 1)]
    assert manager.stats.hit_tokens == 9 and manager.stats.queried_tokens == 20


def test_without_the_prefix_cache_a_finished_last_page_is_not_kept() -> None:
    manager = BlockManager(num_pages=32, page_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add(make_seq(10, max_tokens=1))
    run_to_completion(scheduler)
    again = make_seq(10, max_tokens=1)
    scheduler.add(again)
    out = fake_step(scheduler)
    assert again.num_cached_tokens == 0 and out.page_copies == [] and manager.num_free_pages == 32


def test_forked_completions_share_the_prompt_pages() -> None:
    manager = BlockManager(num_pages=32, page_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    parent = make_seq(10, max_tokens=3)
    child = Sequence(next(_ids), list(parent.prompt_token_ids), parent.params, fork_of=parent)
    scheduler.add(parent)
    scheduler.add(child)
    out = fake_step(scheduler)
    assert [s.seq for s in out.scheduled] == [parent]  # the child waits for the shared pages
    out = fake_step(scheduler)
    assert child.block_table[:2] == parent.block_table[:2]
    assert manager.refcount(parent.block_table[0]) == 2
    assert next(s.num_tokens for s in out.scheduled if s.seq is child) == 2
    run_to_completion(scheduler)
    assert manager.num_free_pages == manager.num_pages


def test_a_fork_waiting_for_its_parent_does_not_hold_the_queue() -> None:
    manager = BlockManager(num_pages=32, page_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    parent = make_seq(10, max_tokens=3)
    child = Sequence(next(_ids), list(parent.prompt_token_ids), parent.params, fork_of=parent)
    behind = make_seq(5, max_tokens=3, first_token=30)  # another request, queued after the n = 2 one
    for seq in (parent, child, behind):
        scheduler.add(seq)
    out = fake_step(scheduler)
    # The child waits for its parent's prompt pages; the request behind it is not held up.
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(parent, 10), (behind, 5)]
    assert list(scheduler.waiting) == [child]
    out = fake_step(scheduler)
    assert child.block_table[:2] == parent.block_table[:2]  # it still shares the prompt pages
    assert next(s.num_tokens for s in out.scheduled if s.seq is child) == 2
    run_to_completion(scheduler)
    assert all(len(seq.output_token_ids) == 3 for seq in (parent, child, behind))
    assert manager.num_free_pages == manager.num_pages
