"""BlockManager: page accounting of the paged KV cache."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from compiled_engine.cache.block_manager import BlockManager, TailHit
from compiled_engine.cache.events import AllPagesCleared
from compiled_engine.errors import OutOfPagesError


def allocated(tables: list[list[int]]) -> list[int]:
    return [page for table in tables for page in table]


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match=r"need num_pages >= 1 and page_size >= 1, got 0, 16"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match=r"need num_pages >= 1 and page_size >= 1, got 4, 0"):
        BlockManager(4, 0)
    bm = BlockManager(7, 3)
    assert (bm.num_pages, bm.page_size, bm.num_free_pages) == (7, 3, 7)


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("num_tokens", [0, 1, 2, 15, 16, 17, 32, 33, 47])
def test_grow_allocates_ceil_pages(page_size: int, num_tokens: int) -> None:
    bm = BlockManager(64, page_size)
    table: list[int] = []
    bm.grow(table, num_tokens)
    expected = math.ceil(num_tokens / page_size)
    assert bm.pages_for_tokens(num_tokens) == expected
    assert len(table) == expected
    assert len(set(table)) == expected
    assert all(0 <= p < 64 for p in table)
    assert bm.num_free_pages == 64 - expected


def test_grow_is_incremental_and_never_shrinks() -> None:
    bm = BlockManager(10, 4)
    table: list[int] = []
    bm.grow(table, 5)  # 2 pages
    first = list(table)
    assert len(first) == 2
    bm.grow(table, 8)  # still 2 pages
    assert table == first
    bm.grow(table, 9)  # a third page, the first two untouched
    assert table[:2] == first and len(table) == 3
    bm.grow(table, 1)  # fewer tokens than held: nothing changes
    assert len(table) == 3
    assert bm.num_free_pages == 7


def test_can_hold() -> None:
    bm = BlockManager(4, 4)
    table: list[int] = []
    assert bm.can_hold(table, 16)
    assert not bm.can_hold(table, 17)
    bm.grow(table, 8)
    assert bm.can_hold(table, 16)  # two more pages are free
    assert not bm.can_hold(table, 17)
    other: list[int] = []
    assert bm.can_hold(other, 8) and not bm.can_hold(other, 9)


def test_out_of_pages_is_all_or_nothing() -> None:
    bm = BlockManager(5, 4)
    a: list[int] = []
    bm.grow(a, 12)  # 3 pages
    b: list[int] = []
    with pytest.raises(OutOfPagesError, match=r"^13 tokens need 4 more pages of 4; 2 of 5 are free$"):
        bm.grow(b, 13)
    assert b == []
    assert bm.num_free_pages == 2
    # Growing an existing table: counts what is missing beyond the pages it holds.
    with pytest.raises(OutOfPagesError, match=r"^24 tokens need 3 more pages of 4; 2 of 5 are free$"):
        bm.grow(a, 24)
    assert len(a) == 3 and bm.num_free_pages == 2
    # Exactly what is left still fits.
    bm.grow(b, 8)
    assert len(b) == 2 and bm.num_free_pages == 0
    with pytest.raises(OutOfPagesError, match=r"^1 tokens need 1 more pages of 4; 0 of 5 are free$"):
        bm.grow([], 1)
    assert sorted(a + b) == list(range(5))


def test_free_returns_every_page_and_empties_the_table() -> None:
    bm = BlockManager(8, 2)
    a: list[int] = []
    b: list[int] = []
    bm.grow(a, 7)
    bm.grow(b, 4)
    assert bm.num_free_pages == 2
    pages_a = list(a)
    bm.free(a)
    assert a == []
    assert bm.num_free_pages == 6
    # Freed pages are handed out again.
    c: list[int] = []
    bm.grow(c, 12)
    assert sorted(c) == sorted(set(range(8)) - set(b))
    assert set(pages_a) <= set(c)
    bm.free(b)
    bm.free(c)
    assert bm.num_free_pages == 8


def test_double_free_raises_and_changes_nothing() -> None:
    bm = BlockManager(4, 4)
    table: list[int] = []
    bm.grow(table, 8)
    copy = list(table)
    bm.free(table)
    bm.free(table)  # the emptied table holds nothing: a no-op
    assert bm.num_free_pages == 4
    with pytest.raises(RuntimeError, match=rf"^page {copy[0]} freed more often than it was allocated$"):
        bm.free(copy)
    assert len(copy) == 2  # the offending table is left as it was
    assert bm.num_free_pages == 4


def test_partially_stale_free_changes_nothing() -> None:
    bm = BlockManager(4, 1)
    a: list[int] = []
    b: list[int] = []
    bm.grow(a, 2)
    bm.grow(b, 2)
    stale = list(a)
    bm.free(a)
    mixed = [b[0], stale[0]]  # one live page, one already freed
    with pytest.raises(RuntimeError, match=rf"page {stale[0]} freed more often"):
        bm.free(mixed)
    # The live page was not released by the failed call.
    assert bm.num_free_pages == 2
    fresh: list[int] = []
    bm.grow(fresh, 2)
    assert not set(fresh) & set(b)


def test_duplicate_page_in_one_table_raises() -> None:
    bm = BlockManager(4, 1)
    table: list[int] = []
    bm.grow(table, 1)
    with pytest.raises(RuntimeError, match=rf"page {table[0]} freed more often"):
        bm.free([table[0], table[0]])
    assert bm.num_free_pages == 3
    bm.free(table)
    assert bm.num_free_pages == 4


@pytest.mark.parametrize("page", [-1, 4, 100])
def test_free_of_a_foreign_page_raises(page: int) -> None:
    bm = BlockManager(4, 1)
    table: list[int] = []
    bm.grow(table, 4)  # page 3 is allocated: -1 must not reach it from the end
    with pytest.raises(RuntimeError, match=rf"^page {page} is not in this pool of 4 pages$"):
        bm.free([page])
    assert bm.num_free_pages == 0
    bm.free(table)
    assert bm.num_free_pages == 4


def test_pages_unique_across_tables() -> None:
    bm = BlockManager(50, 3)
    rng = random.Random(1)
    tables: list[list[int]] = [[] for _ in range(6)]
    for _ in range(40):
        table = rng.choice(tables)
        tokens = len(table) * 3 + rng.randint(1, 7)
        if bm.can_hold(table, tokens):
            bm.grow(table, tokens)
    pages = allocated(tables)
    assert len(pages) == len(set(pages))
    assert bm.num_free_pages + len(pages) == 50


def test_randomized_grow_free_sequence() -> None:
    rng = random.Random(1234)
    for trial in range(20):
        num_pages, page_size = rng.randint(1, 24), rng.randint(1, 8)
        bm = BlockManager(num_pages, page_size)
        tables: list[list[int]] = [[] for _ in range(rng.randint(1, 5))]
        tokens = [0] * len(tables)
        for _ in range(60):
            i = rng.randrange(len(tables))
            if rng.random() < 0.25:
                bm.free(tables[i])
                tokens[i] = 0
                assert tables[i] == []
            else:
                want = tokens[i] + rng.randint(0, 2 * page_size)
                before = list(tables[i])
                free_before = bm.num_free_pages
                fits = bm.can_hold(tables[i], want)
                try:
                    bm.grow(tables[i], want)
                except OutOfPagesError:
                    assert not fits
                    assert tables[i] == before and bm.num_free_pages == free_before
                else:
                    assert fits
                    tokens[i] = want
                    assert tables[i][: len(before)] == before
                    assert len(tables[i]) == max(len(before), -(-want // page_size))
            pages = allocated(tables)
            assert len(pages) == len(set(pages)), f"trial {trial}: a page is in two tables"
            assert bm.num_free_pages + len(pages) == num_pages
        for table in tables:
            bm.free(table)
        assert bm.num_free_pages == num_pages


class BlockManagerMachine(RuleBasedStateMachine):
    """Random grow/free interleavings keep free + allocated == total, with no page shared."""

    @initialize(num_pages=st.integers(1, 20), page_size=st.integers(1, 6), num_tables=st.integers(1, 4))
    def setup(self, num_pages: int, page_size: int, num_tables: int) -> None:
        self.bm = BlockManager(num_pages, page_size)
        self.tables: list[list[int]] = [[] for _ in range(num_tables)]

    @rule(data=st.data(), extra=st.integers(0, 40))
    def grow(self, data: st.DataObject, extra: int) -> None:
        table = self.tables[data.draw(st.integers(0, len(self.tables) - 1))]
        before, free_before = list(table), self.bm.num_free_pages
        want = len(table) * self.bm.page_size + extra
        needed = -(-want // self.bm.page_size) - len(table)
        if needed > free_before:
            with pytest.raises(OutOfPagesError, match=rf"need {needed} more pages"):
                self.bm.grow(table, want)
            assert table == before and self.bm.num_free_pages == free_before
        else:
            self.bm.grow(table, want)
            assert table[: len(before)] == before
            assert len(table) - len(before) == needed == free_before - self.bm.num_free_pages

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        table = self.tables[data.draw(st.integers(0, len(self.tables) - 1))]
        free_before, held = self.bm.num_free_pages, len(table)
        self.bm.free(table)
        assert table == [] and self.bm.num_free_pages == free_before + held

    @precondition(lambda self: any(self.tables))
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        table = data.draw(st.sampled_from([t for t in self.tables if t]))
        copy = list(table)
        self.bm.free(table)
        free_after = self.bm.num_free_pages
        with pytest.raises(RuntimeError, match="freed more often than it was allocated"):
            self.bm.free(copy)
        assert self.bm.num_free_pages == free_after

    @invariant()
    def conserved(self) -> None:
        pages = allocated(self.tables)
        assert len(pages) == len(set(pages))
        assert all(0 <= p < self.bm.num_pages for p in pages)
        assert self.bm.num_free_pages + len(pages) == self.bm.num_pages


BlockManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_eviction_takes_the_least_recently_released_cached_page() -> None:
    manager = BlockManager(num_pages=3, page_size=2)
    tables: list[list[int]] = []
    keys: list[list[int]] = []
    for tokens in ([1, 2], [3, 4]):
        table: list[int] = []
        manager.grow(table, 2)
        page_keys: list[int] = []
        manager.register_full_pages(table, page_keys, tokens, 2, salt=0)
        tables.append(table)
        keys.append(page_keys)
    first, second = tables[0][0], tables[1][0]
    manager.free(tables[0])  # released first: the first to go
    manager.free(tables[1])
    assert manager.num_cached_pages == 2 and manager.num_free_pages == 3
    grabbed: list[int] = []
    manager.grow(grabbed, 4)  # two pages: the never-cached one, then the oldest cached one
    assert first in grabbed and second not in grabbed
    assert manager.stats.evictions == 1
    assert manager.match_prefix([1, 2, 9], 0) == ([], [])
    assert manager.match_prefix([3, 4, 9], 0) == ([second], keys[1])


def _computed(manager: BlockManager, tokens: list[int], salt: int) -> tuple[list[int], list[int]]:
    """A sequence whose `tokens` are all computed: its block table and full pages' keys."""
    table: list[int] = []
    manager.grow(table, len(tokens))
    keys: list[int] = []
    manager.register_full_pages(table, keys, tokens, len(tokens), salt)
    return table, keys


def test_a_kept_last_page_continues_a_prompt_for_as_long_as_it_agrees() -> None:
    manager = BlockManager(num_pages=8, page_size=4)
    table, keys = _computed(manager, [1, 2, 3, 4, 5, 6, 7], salt=1)  # one full page, three tokens
    first, last = table
    manager.free_keeping_last_page(table, keys, [1, 2, 3, 4, 5, 6, 7, 8], 7, 1)
    assert manager.num_free_pages == 8 and manager.num_cached_pages == 1  # the kept page is evictable
    manager.check_consistency([])
    hits, found = manager.match_prefix([1, 2, 3, 4, 5, 6, 9, 9], 1)
    assert hits == [first] and found == keys
    assert manager.match_tail([1, 2, 3, 4, 5, 6, 9, 9], found, 1) == TailHit(last, 2)
    # never the prompt's last token, even when the page holds it
    assert manager.match_tail([1, 2, 3, 4, 5, 6, 7], found, 1) == TailHit(last, 2)
    assert manager.match_tail([1, 2, 3, 4, 5, 6, 7, 0], found, 1) == TailHit(last, 3)
    assert manager.match_tail([1, 2, 3, 4, 9], found, 1) is None  # no page starts with 9 there
    assert manager.match_tail([1, 2, 3, 4, 5, 6, 7, 0], found, 2) is None  # another tenant's
    assert manager.match_tail([5, 6, 7, 0], [], 1) is None  # another parent (the root)
    # Handed out again, the page is forgotten.
    grabbed: list[int] = []
    manager.grow(grabbed, 32)
    assert manager.match_tail([1, 2, 3, 4, 5, 6, 7, 0], found, 1) is None
    manager.free(grabbed)
    manager.check_consistency([])


def test_the_longest_agreement_wins_among_full_and_kept_pages() -> None:
    manager = BlockManager(num_pages=8, page_size=4)
    full, _ = _computed(manager, [1, 2, 3, 4], salt=0)
    short, _ = _computed(manager, [1, 2], salt=0)
    manager.free_keeping_last_page(short, [], [1, 2], 2, 0)
    assert manager.match_tail([1, 2, 3, 9, 9], [], 0) == TailHit(full[0], 3)
    shorter = manager.match_tail([1, 2, 9], [], 0)
    assert shorter is not None and shorter.num_tokens == 2
    manager.free(full)
    manager.check_consistency([])


def test_no_last_page_is_kept_when_it_is_full_shared_or_the_cache_is_off() -> None:
    off = BlockManager(num_pages=4, page_size=4, enable_prefix_caching=False)
    table, keys = _computed(off, [1, 2, 3], salt=0)
    off.free_keeping_last_page(table, keys, [1, 2, 3], 3, 0)
    assert off.match_tail([1, 2, 3, 4], [], 0) is None and off.num_cached_pages == 0
    manager = BlockManager(num_pages=4, page_size=4)
    table, keys = _computed(manager, [1, 2, 3], salt=0)
    other = manager.share(table)
    manager.free_keeping_last_page(table, keys, [1, 2, 3], 3, 0)  # still referenced elsewhere
    assert manager.match_tail([1, 2, 3, 4], [], 0) is None
    manager.free(other)
    assert manager.num_free_pages == 4
    manager.check_consistency([])


def test_the_same_last_page_twice_is_kept_once() -> None:
    manager = BlockManager(num_pages=2, page_size=4)
    pages = []
    for _ in range(2):  # a repeated prompt's two runs
        table, keys = _computed(manager, [1, 2, 3], salt=0)
        pages.append(table[0])
        manager.free_keeping_last_page(table, keys, [1, 2, 3], 3, 0)
    assert manager.match_tail([1, 2, 3, 4], [], 0) == TailHit(pages[0], 3)
    taken: list[int] = []
    manager.grow(taken, 4)  # the page not kept comes first, with no eviction
    assert taken == [pages[1]] and manager.stats.evictions == 0
    manager.free(taken)
    manager.check_consistency([])


def test_resetting_the_prefix_cache_forgets_every_page_unless_one_is_held() -> None:
    manager = BlockManager(num_pages=4, page_size=2, record_events=True)
    held = _computed(manager, [1, 2, 3, 4], salt=0)[0]  # two full pages, still referenced
    assert manager.reset_prefix_cache() is False  # a sequence holds pages: nothing changes
    assert manager.num_cached_pages == 2
    manager.take_events()
    manager.free(held)
    assert manager.reset_prefix_cache() is True
    assert manager.num_cached_pages == 0 and manager.num_free_pages == 4
    assert manager.match_prefix([1, 2, 3, 4, 5], 0) == ([], [])
    assert manager.match_tail([1, 2, 3], [], 0) is None
    assert manager.take_events() == [AllPagesCleared()]
    manager.check_consistency([])
