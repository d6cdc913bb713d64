"""Sequence: one request's tokens, pages and progress, the unit the engine talks about."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if token_id in self.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif len(self.output_token_ids) >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
