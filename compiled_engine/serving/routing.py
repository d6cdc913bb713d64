"""Which replica takes a request: the one whose prefix cache holds most of its prompt, unless that
one is overloaded; else the least loaded.

The front end mirrors each replica's cache from the events the replica reports
(cache/events.py): the set of page keys it holds now. The caller computes a prompt's page keys
the way the prefix cache does (`prompt_page_keys`, under the request's salt), so a replica's
match is exactly the pages `match_prefix` would find there, as of its last report.

Load is the front end's own count of a replica's requests in flight (running and waiting), exact
at the moment of the choice. A replica whose load exceeds the least loaded one's by more than
`balance_slack` is overloaded: its cache hit is not worth the queue, so the request goes to the
best cache among the others, or, with no hit there, to the least loaded. Ties in load go round
robin, so that requests one at a time still spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from compiled_engine.cache.events import AllPagesCleared, CacheEvent, PagesRemoved, PageStored

DEFAULT_BALANCE_SLACK = 4


@dataclass
class ReplicaLoad:
    alive: bool = True
    in_flight: int = 0
    cached_keys: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Route:
    replica: int
    cached_pages: int  # of the prompt's pages, how many the chosen replica holds
    by_prefix: bool  # chosen for its cache (False: for its load)


class PrefixRouter:
    def __init__(self, num_replicas: int, page_size: int, balance_slack: int = DEFAULT_BALANCE_SLACK) -> None:
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, got {num_replicas}")
        self.page_size = page_size
        self.balance_slack = balance_slack
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self._turn = 0

    def apply(self, replica: int, events: Sequence[CacheEvent]) -> None:
        """Follow one replica's cache through its events, in order."""
        keys = self.replicas[replica].cached_keys
        for event in events:
            if isinstance(event, PageStored):
                keys.add(event.key)
            elif isinstance(event, PagesRemoved):
                keys.difference_update(event.keys)
            elif isinstance(event, AllPagesCleared):
                keys.clear()

    def mark_dead(self, replica: int) -> None:
        self.replicas[replica].alive = False
        self.replicas[replica].cached_keys.clear()

    def cached_pages(self, replica: int, keys: Sequence[int]) -> int:
        held = self.replicas[replica].cached_keys
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def choose(self, keys: Sequence[int]) -> Route:
        """The replica for a prompt, given its page keys (`prompt_page_keys`; none: by load
        alone): of the replicas not overloaded, the one that caches most of them; with no cache
        hit, the least loaded. Raises LookupError when no replica is alive."""
        alive = [i for i, replica in enumerate(self.replicas) if replica.alive]
        if not alive:
            raise LookupError("no replica is alive")
        least = min(self.replicas[i].in_flight for i in alive)
        best, best_pages = None, 0
        for i in alive:
            if self.replicas[i].in_flight - least > self.balance_slack:
                continue  # overloaded: its cache hit is not worth its queue
            pages = self.cached_pages(i, keys)
            if pages > best_pages or (pages == best_pages > 0 and best is not None and self._lighter(i, best)):
                best, best_pages = i, pages
        if best is not None:
            return Route(best, best_pages, True)
        idle = [i for i in alive if self.replicas[i].in_flight == least]
        chosen = idle[self._turn % len(idle)]
        self._turn += 1
        return Route(chosen, self.cached_pages(chosen, keys), False)

    def _lighter(self, a: int, b: int) -> bool:
        return self.replicas[a].in_flight < self.replicas[b].in_flight
