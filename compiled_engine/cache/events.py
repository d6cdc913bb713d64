"""What the prefix cache reports as it changes, for whoever follows it from outside the engine:
a data-parallel front end routing by prefix, or a cache-aware router reading vLLM's KV events.

A page is reported stored when it is full, its K/V computed and its key registered (the same
chained key `match_prefix` looks up), and removed when it is evicted for reuse. Partly filled
pages kept for copying (`free_keeping_last_page`) are never shared by key, so they are not
reported. Keys are the same in every process (`page_key` hashes only integers), so the keys a
front end computes for a prompt are the ones a replica reports.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

ROOT_KEY = 0  # the parent of a sequence's first page


def page_key(parent_key: int | None, token_ids: Sequence[int], salt: int) -> int:
    """The prefix-cache key of a full page: its parent's key, its tokens and the salt. Built from
    integers only, so it is the same in every process (Python randomizes the hashes of str and
    bytes per process, and hashes None by address before 3.12)."""
    return hash((ROOT_KEY if parent_key is None else parent_key, tuple(token_ids), salt))


def salt_key(*parts: str | None) -> int:
    """An integer salt from text parts (the user's cache salt, the adapter's name and digest): the
    same in every process."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def prompt_page_keys(token_ids: Sequence[int], salt: int, page_size: int) -> list[int]:
    """The keys of a prompt's full pages that the prefix cache could hold (its last token is
    always computed, so a page holding it is never looked up): what `match_prefix` walks."""
    keys: list[int] = []
    parent: int | None = None
    for i in range((len(token_ids) - 1) // page_size):
        parent = page_key(parent, token_ids[i * page_size : (i + 1) * page_size], salt)
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class PageStored:
    """A full page was registered under `key` (its parent `parent_key`, None at the root)."""

    key: int
    parent_key: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class PagesRemoved:
    """These keys' pages were evicted: a lookup no longer finds them."""

    keys: tuple[int, ...]


@dataclass(frozen=True)
class AllPagesCleared:
    """Every cached page was dropped at once."""


CacheEvent = PageStored | PagesRemoved | AllPagesCleared
