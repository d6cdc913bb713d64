"""Sequence: one completion's tokens, pages and progress, the unit the scheduler talks about.
A request with n > 1 has n sequences sharing its request id and its prompt."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

from compiled_engine.cache.events import salt_key
from compiled_engine.engine.feature_state import AdapterKey, GrammarState, PoolingState
from compiled_engine.engine.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not holding pages: new, or preempted and waiting to be recomputed
    RUNNING = "running"  # holding pages; prefilling in chunks or decoding
    FINISHED = "finished"


GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30)


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams = GREEDY
    eos_token_ids: frozenset[int] = frozenset()
    request_id: str = ""
    index: int = 0  # which of the request's n completions
    seed: int = 0
    cache_salt: str | None = None
    adapter: AdapterKey | None = None  # the adapter it runs with (engine/adapters.py), None for the base model
    arrival_time: float = 0.0
    fork_of: Sequence | None = None  # n > 1: share this sibling's prompt pages once it has them
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    page_keys: list[int] = field(default_factory=list)  # prefix-cache keys of the full pages
    num_computed_tokens: int = 0  # tokens whose K/V are in the pages
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    num_preemptions: int = 0
    # Speculative decoding (speculative/): this step's draft tokens after the last one, verified
    # in the same forward; how many draft tokens it was offered and accepted so far; and whether
    # it still speculates (it stops when its acceptance stays low).
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    speculating: bool = True
    draft_length: int | None = None  # its next draft's length, at most (None: the config's)
    grammar: GrammarState | None = None  # structured outputs: what it may emit next (engine/grammars.py)
    pooling: PoolingState | None = None  # a pooling request (--runner pooling): its embedding so far
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # Timestamps (time.perf_counter()) for the request metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @functools.cached_property
    def prefix_salt(self) -> int:
        """Its part of the prefix-cache key: pages are shared only under the same user salt and
        the same adapter (the same files). The same in every process (cache/events.py)."""
        return salt_key(self.cache_salt, getattr(self.adapter, "name", None), getattr(self.adapter, "digest", None))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """Still computing the prompt (or, after preemption, prompt and earlier output)."""
        return self.num_uncomputed_tokens > 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are asked for and not all computed yet (its request's first
        completion computes them; forked siblings share its prompt pages)."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and self.num_computed_tokens < len(self.prompt_token_ids)
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def stop_token_ids(self) -> frozenset[int]:
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        return eos | frozenset(self.params.stop_token_ids)

    def banned_token_ids(self, ahead: int = 0) -> list[int]:
        """Tokens that may not be drawn yet: the stop ids until min_tokens is reached (`ahead`:
        for the token that many places past the next, as a draft's verification draws it)."""
        if len(self.output_token_ids) + ahead >= self.params.min_tokens:
            return []
        return sorted(self.stop_token_ids())

    def append_token(self, token_id: int) -> FinishReason | None:
        """Add a generated token; return why the sequence must stop now, if it must."""
        self.output_token_ids.append(token_id)
        # The sampler never draws a stop id before min_tokens (banned_token_ids).
        if token_id in self.stop_token_ids():
            self.stop_reason = token_id if token_id in self.params.stop_token_ids else None
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.params.max_tokens:
            return FinishReason.LENGTH
        return None
