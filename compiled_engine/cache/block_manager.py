"""BlockManager: hands out KV pages from a free list and takes them back, with refcounts so that
pages can later be shared between sequences."""

from __future__ import annotations

from collections import Counter, deque

from compiled_engine.errors import OutOfPagesError


class BlockManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._refcount = [0] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_hold(self, block_table: list[int], num_tokens: int) -> bool:
        return self.pages_for_tokens(num_tokens) - len(block_table) <= self.num_free_pages

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append pages to `block_table` until it holds `num_tokens` tokens (all or nothing)."""
        needed = self.pages_for_tokens(num_tokens) - len(block_table)
        if needed > self.num_free_pages:
            raise OutOfPagesError(
                f"{num_tokens} tokens need {needed} more pages of {self.page_size}; "
                f"{self.num_free_pages} of {self.num_pages} are free"
            )
        for _ in range(needed):
            page = self._free.popleft()
            self._refcount[page] = 1
            block_table.append(page)

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to every page in `block_table` and empty it."""
        # Check every page first, so that a bad table changes nothing (and a negative id cannot
        # index the refcounts from the end).
        for page, count in Counter(block_table).items():
            if not 0 <= page < self.num_pages:
                raise RuntimeError(f"page {page} is not in this pool of {self.num_pages} pages")
            if self._refcount[page] < count:
                raise RuntimeError(f"page {page} freed more often than it was allocated")
        for page in block_table:
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free.append(page)
        block_table.clear()
