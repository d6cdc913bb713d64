"""Thinking split from the answer (`serve --reasoning-parser`, vLLM's names):

- `qwen3`: a reply that starts with `<think>` thinks until `</think>`; any other reply is all answer;
- `deepseek_r1`: the chat template opens the thinking itself, so every reply thinks until
  `</think>` (a leading `<think>` is dropped); a reply that never closes it is all thinking.

`split` divides a choice's text so far. While the choice runs, a tail that could still become
a tag (`</thi`) is held back, so that no delta ever shows part of a tag, however the tokenizer
cuts it. `ReasoningStream` turns each step's choice delta into its thinking delta and its answer
delta; the answer is what tool parsing and the replies' `content` then see.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from compiled_engine.server.common.tool_parsers import shown_before

if TYPE_CHECKING:  # the command line imports this module for its names, before torch
    from compiled_engine.server.common.deltas import ChoiceDelta

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class Split:
    reasoning: str  # the thinking shown so far (without its tags)
    content: str  # the answer shown so far


@dataclass(frozen=True)
class ReasoningParser:
    name: str

    def __post_init__(self) -> None:
        if self.name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.name!r}: choose one of {', '.join(REASONING_PARSERS)}")

    def split(self, text: str, finished: bool) -> Split:
        """What of `text` (a choice's text so far) can be shown as thinking and as answer."""
        if text.startswith(START):
            text, thinking = text[len(START) :], True
        elif not finished and text and START.startswith(text):
            return Split("", "")  # the start tag may still be arriving
        else:
            thinking = self.name == "deepseek_r1"
        if not thinking:
            return Split("", text)
        if END in text:
            end = text.index(END)
            return Split(text[:end], text[end + len(END) :])
        return Split(text if finished else text[: shown_before(text, END)], "")


@dataclass
class ReasoningStream:
    """Each step's choice delta as (the thinking it adds, the choice delta of its answer)."""

    parser: ReasoningParser
    shown: dict[int, Split] = field(default_factory=dict)  # by choice

    def step(self, choice: ChoiceDelta) -> tuple[str, ChoiceDelta]:
        before = self.shown.get(choice.index, Split("", ""))
        now = self.parser.split(choice.text_so_far, choice.finish_reason is not None)
        self.shown[choice.index] = now
        answer = replace(
            choice, text=now.content[len(before.content) :], text_offset=len(before.content), text_so_far=now.content
        )
        return now.reasoning[len(before.reasoning) :], answer


def whole_split(parser: ReasoningParser | None, choice: ChoiceDelta) -> tuple[str | None, ChoiceDelta]:
    """A finished choice's thinking (None without a parser) and the choice of its answer."""
    if parser is None:
        return None, choice
    reasoning, answer = ReasoningStream(parser).step(choice)
    return reasoning, answer
