"""The one view of an engine request that every reply is built from: what each step added to
each choice (`ChoiceDelta`), with the request's usage so far (`StepDeltas`).

A streamed reply maps every step's deltas to its chunks; a whole reply maps the deltas of the final
output against nothing shown (`whole_choices`), so both read the same fields."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from compiled_engine.engine.outputs import CompletionOutput, RequestOutput
from compiled_engine.engine.sampler import TokenLogprobs
from compiled_engine.server.common.protocol import PromptTokensDetails, Usage


@dataclass(frozen=True)
class ChoiceDelta:
    """What one step added to one choice (for a whole reply: the whole choice)."""

    index: int
    text: str  # the text added
    text_offset: int  # where `text` starts in the choice's text
    text_so_far: str  # the choice's text up to and including `text`
    token_ids: list[int]  # the tokens added
    logprobs: list[TokenLogprobs] | None  # the added tokens' logprobs; None when none were asked for
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass(frozen=True)
class StepDeltas:
    """One engine output: a delta for every choice it carries, and the request's usage so far."""

    choices: list[ChoiceDelta]
    usage: Usage
    prompt_token_ids: list[int]
    finished: bool


def usage_of(output: RequestOutput) -> Usage:
    completion = sum(len(c.token_ids) for c in output.outputs)
    prompt = len(output.prompt_token_ids)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(output.num_cached_tokens))


@dataclass
class _Shown:
    """How much of one choice earlier deltas carried."""

    text: int = 0
    tokens: int = 0
    logprobs: int = 0


@dataclass
class _Progress:
    choices: dict[int, _Shown] = field(default_factory=dict)

    def delta(self, choice: CompletionOutput) -> ChoiceDelta:
        shown = self.choices.setdefault(choice.index, _Shown())
        logprobs = None if choice.logprobs is None else choice.logprobs[shown.logprobs :]
        delta = ChoiceDelta(
            index=choice.index,
            text=choice.text[shown.text :],
            text_offset=shown.text,
            text_so_far=choice.text,
            token_ids=choice.token_ids[shown.tokens :],
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )
        shown.text, shown.tokens = len(choice.text), len(choice.token_ids)
        shown.logprobs = len(choice.logprobs) if choice.logprobs is not None else shown.logprobs
        return delta

    def step(self, output: RequestOutput) -> StepDeltas:
        choices = [self.delta(choice) for choice in output.outputs]
        return StepDeltas(choices, usage_of(output), output.prompt_token_ids, output.finished)


async def choice_deltas(first: RequestOutput | None, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[StepDeltas]:
    """The request's outputs as they come (`first`, awaited before the reply began, then `rest`),
    each as what it added to every choice."""
    progress = _Progress()
    if first is not None:
        yield progress.step(first)
    async for output in rest:
        yield progress.step(output)


def whole_choices(output: RequestOutput) -> StepDeltas:
    """A finished request's choices whole: its final output against nothing shown."""
    return _Progress().step(output)
