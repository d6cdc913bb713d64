"""BlockManager: the KV pages' owner. A free list, refcounts, block tables grown all-or-nothing,
and the prefix cache.

Prefix cache: once a page is full and its K/V computed, it is registered under a key that hashes
(the previous page's key, this page's token ids, the cache salt). A later sequence whose prompt
starts with the same pages under the same salt takes references to them instead of recomputing.
A page nobody references stays cached ("evictable") until allocation needs it, least recently
freed first.

Past the last whole page, a prompt may still continue a cached page's first tokens: the last
page of a finished sequence (kept, partly filled, when its pages are freed) or a full page that
agrees with the prompt only for a while. `match_tail` finds the cached page after the matched
ones that agrees longest with the prompt, and the scheduler copies the K/V of those tokens into
the prompt's own next page (`PageCopy`). So a repeated prompt recomputes its last token only.
Partly filled pages are copied from, never shared.

With `record_events` the manager also records what a follower outside the engine needs to mirror
its keyed pages (cache/events.py), until `take_events` hands them over.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from compiled_engine.cache.events import AllPagesCleared, CacheEvent, PagesRemoved, PageStored, page_key
from compiled_engine.errors import OutOfPagesError


@dataclass(frozen=True)
class PageCopy:
    """Copy the K/V of the first `num_tokens` tokens of page `src` into page `dst` (every layer),
    before the step's forward writes anything."""

    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True)
class TailHit:
    """A cached page whose first `num_tokens` tokens continue a prompt's matched pages."""

    page: int
    num_tokens: int


@dataclass(frozen=True)
class _CachedTokens:
    """What a cached page holds: the tokens after the page keyed `parent` under `salt`."""

    parent: int | None
    salt: int
    tokens: tuple[int, ...]

    @property
    def index_key(self) -> tuple[int | None, int, int]:
        return (self.parent, self.salt, self.tokens[0])


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0  # shared whole pages' tokens and copied ones
    copied_tokens: int = 0  # of those, the ones copied from inside a cached page
    evictions: int = 0


class BlockManager:
    def __init__(
        self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, record_events: bool = False
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._free: deque[int] = deque(range(num_pages))  # unreferenced and not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced but cached, LRU first
        self._refcount = [0] * num_pages
        self._key_of_page: list[int | None] = [None] * num_pages  # full pages only
        self._page_of_key: dict[int, int] = {}
        # Every cached page's tokens (full pages and kept last pages), and the cached pages by
        # (parent key, salt, first token): where `match_tail` looks for a continuation.
        self._tokens_of_page: list[_CachedTokens | None] = [None] * num_pages
        self._pages_after: dict[tuple[int | None, int, int], dict[int, None]] = {}
        self._events: list[CacheEvent] | None = [] if record_events else None

    def take_events(self) -> list[CacheEvent]:
        """The cache events recorded since the last call (none unless `record_events`)."""
        events, self._events = self._events, [] if self._events is not None else None
        return events or []

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take now (evicting cached ones if it must)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_of_key)

    def cached_page_keys(self) -> set[int]:
        """The keys a prefix lookup can find now (what the cache events, followed, add up to)."""
        return set(self._page_of_key)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

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
            page = self._take_free_page()
            self._refcount[page] = 1
            block_table.append(page)

    def _take_free_page(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._evictable.popitem(last=False)
        key = self._key_of_page[page]
        if key is not None:
            del self._page_of_key[key]
            self._key_of_page[page] = None
            if self._events is not None:
                self._events.append(PagesRemoved((key,)))
        self._forget_tokens(page)
        self.stats.evictions += 1
        return page

    def _remember_tokens(self, page: int, cached: _CachedTokens) -> None:
        self._tokens_of_page[page] = cached
        self._pages_after.setdefault(cached.index_key, {})[page] = None

    def _forget_tokens(self, page: int) -> None:
        cached = self._tokens_of_page[page]
        assert cached is not None, f"page {page} was evictable without cached tokens"
        self._tokens_of_page[page] = None
        siblings = self._pages_after[cached.index_key]
        del siblings[page]
        if not siblings:
            del self._pages_after[cached.index_key]

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
                if self._tokens_of_page[page] is None:
                    self._free.append(page)
                else:
                    self._evictable[page] = None
        block_table.clear()

    def free_keeping_last_page(
        self,
        block_table: list[int],
        page_keys: Sequence[int],
        token_ids: Sequence[int],
        num_computed: int,
        salt: int,
    ) -> None:
        """`free`, but first keep the sequence's partly filled last page cached (its computed
        tokens after its full pages `page_keys`), for a later prompt to copy from."""
        full = len(page_keys)
        count = num_computed - full * self.page_size
        if (
            self.enable_prefix_caching
            and 0 < count < self.page_size
            and full < len(block_table)
            and self._refcount[block_table[full]] == 1
            and self._tokens_of_page[block_table[full]] is None
        ):
            cached = _CachedTokens(
                page_keys[-1] if full else None, salt, tuple(token_ids[full * self.page_size : num_computed])
            )
            if not self._holds_already(cached):  # the same tokens twice (a repeated prompt) keep one copy
                self._remember_tokens(block_table[full], cached)
        self.free(block_table)

    def _holds_already(self, cached: _CachedTokens) -> bool:
        """Whether a cached page after the same parent starts with all of `cached`'s tokens."""
        count = len(cached.tokens)
        for page in self._pages_after.get(cached.index_key, ()):
            held = self._tokens_of_page[page]
            assert held is not None
            if held.tokens[:count] == cached.tokens:
                return True
        return False

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Drop the pages of `block_table` past the first `num_tokens` tokens (rejected draft
        tokens' pages)."""
        keep = self.pages_for_tokens(num_tokens)
        if len(block_table) > keep:
            tail = block_table[keep:]
            del block_table[keep:]
            self.free(tail)

    def share(self, pages: Sequence[int]) -> list[int]:
        """Take one more reference to each page (prefix-cache hits, forked prompts)."""
        for page in pages:
            if self._refcount[page] == 0:
                del self._evictable[page]
            self._refcount[page] += 1
        return list(pages)

    def num_evictable_among(self, pages: Sequence[int]) -> int:
        """How many of `pages` count as free now (sharing them takes them out of the free count)."""
        return sum(1 for page in pages if self._refcount[page] == 0)

    # -- prefix cache ---------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], salt: int) -> tuple[list[int], list[int]]:
        """The cached pages (and their keys) that hold the leading full pages of `token_ids`.
        The last token is never covered: its logits must be computed."""
        pages: list[int] = []
        keys: list[int] = []
        if not self.enable_prefix_caching:
            return pages, keys
        size = self.page_size
        parent: int | None = None
        for i in range((len(token_ids) - 1) // size):
            key = page_key(parent, token_ids[i * size : (i + 1) * size], salt)
            page = self._page_of_key.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
            parent = key
        return pages, keys

    def match_tail(self, token_ids: Sequence[int], keys: Sequence[int], salt: int) -> TailHit | None:
        """After the full pages `keys` that `match_prefix` found: the cached page whose first
        tokens agree longest with the prompt's next ones (never covering its last token)."""
        if not self.enable_prefix_caching:
            return None
        start = len(keys) * self.page_size
        wanted = token_ids[start : min(len(token_ids) - 1, start + self.page_size)]
        if not wanted:
            return None
        pages = self._pages_after.get((keys[-1] if keys else None, salt, wanted[0]))
        best: TailHit | None = None
        for page in pages or ():
            cached = self._tokens_of_page[page]
            assert cached is not None
            agree = 0
            for mine, theirs in zip(wanted, cached.tokens, strict=False):  # a kept page may be shorter
                if mine != theirs:
                    break
                agree += 1
            if best is None or agree > best.num_tokens:
                best = TailHit(page, agree)
                if agree == len(wanted):
                    break
        return best

    def record_lookup(self, queried_tokens: int, hit_tokens: int, copied_tokens: int = 0) -> None:
        self.stats.queried_tokens += queried_tokens
        self.stats.hit_tokens += hit_tokens
        self.stats.copied_tokens += copied_tokens

    def register_full_pages(
        self,
        block_table: list[int],
        page_keys: list[int],
        token_ids: Sequence[int],
        num_computed: int,
        salt: int,
    ) -> None:
        """Give keys to the pages that became full with computed K/V; extends `page_keys`."""
        if not self.enable_prefix_caching:
            return
        size = self.page_size
        while len(page_keys) < num_computed // size:
            i = len(page_keys)
            key = page_key(page_keys[-1] if page_keys else None, token_ids[i * size : (i + 1) * size], salt)
            page_keys.append(key)
            page = block_table[i]
            # The same content computed twice (two sequences missed together) keeps one copy.
            if key not in self._page_of_key and self._key_of_page[page] is None:
                self._page_of_key[key] = page
                self._key_of_page[page] = key
                parent = page_keys[-2] if i else None
                tokens = tuple(token_ids[i * size : (i + 1) * size])
                self._remember_tokens(page, _CachedTokens(parent, salt, tokens))
                if self._events is not None:
                    self._events.append(PageStored(key, parent, tokens))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page, so that no later prompt hits what came before; False (and
        nothing changes) while a sequence holds pages, whose keys it still extends."""
        if any(self._refcount):
            return False
        for page in self._evictable:
            self._key_of_page[page] = None
            self._tokens_of_page[page] = None
            self._free.append(page)
        self._evictable.clear()
        self._page_of_key.clear()
        self._pages_after.clear()
        if self._events is not None:
            self._events.append(AllPagesCleared())
        return True

    def check_consistency(self, tables: Sequence[Sequence[int]]) -> None:
        """Assert that refcounts equal the references in `tables` (every live block table) and
        that every page is in exactly one of: referenced, free, evictable."""
        counts = Counter(page for table in tables for page in table)
        for page in range(self.num_pages):
            assert self._refcount[page] == counts.get(page, 0), f"page {page} refcount mismatch"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable
        referenced = {p for p in range(self.num_pages) if self._refcount[p] > 0}
        assert not referenced & (free | evictable)
        assert len(referenced) + len(free) + len(evictable) == self.num_pages
        for page in evictable:
            assert self._tokens_of_page[page] is not None
        for key, page in self._page_of_key.items():
            assert self._key_of_page[page] == key
            assert self._tokens_of_page[page] is not None
        indexed = {page for pages in self._pages_after.values() for page in pages}
        assert indexed == {p for p in range(self.num_pages) if self._tokens_of_page[p] is not None}
