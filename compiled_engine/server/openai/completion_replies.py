"""Text completions' replies from the choice deltas: the SSE chunks of a stream, or one body."""

from __future__ import annotations

from collections.abc import AsyncIterator

from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.server.common.deltas import ChoiceDelta, StepDeltas, whole_choices
from compiled_engine.server.common.engine_streams import DONE, sse
from compiled_engine.server.common.protocol import PromptTokensDetails, Usage
from compiled_engine.server.openai.frame import ReplyFrame
from compiled_engine.server.openai.logprobs import completion_logprobs, prompt_logprobs
from compiled_engine.server.openai.protocol import CompletionChoice, CompletionResponse
from compiled_engine.tokenizer import Tokenizer


async def completion_events(
    frame: ReplyFrame, steps: AsyncIterator[StepDeltas], echo: bool, tokenizer: Tokenizer
) -> AsyncIterator[bytes]:
    """A chunk per step and choice that adds something; with `echo`, the first step's chunks
    start with the prompt's text."""
    last: StepDeltas | None = None
    async for step in steps:
        prefix = tokenizer.decode(step.prompt_token_ids) if echo and last is None else ""
        last = step
        for choice in step.choices:
            chunk = _chunk_choice(choice, prefix, tokenizer)
            if chunk is not None:
                yield sse(CompletionResponse(frame.id, frame.created, frame.model, [chunk], frame.running_usage(step)))
    if last is not None and frame.usage_at_end:
        yield sse(CompletionResponse(frame.id, frame.created, frame.model, [], last.usage))
    yield sse(DONE)


def _chunk_choice(choice: ChoiceDelta, prefix: str, tokenizer: Tokenizer) -> CompletionChoice | None:
    # The offsets count from the generated text, not the echoed prompt.
    logprobs = completion_logprobs(choice.logprobs, choice.text_offset, tokenizer)
    text = prefix + choice.text
    # With logprobs asked for, every step sends a chunk, even one that added nothing.
    if not (text or choice.finish_reason or logprobs is not None):
        return None
    return CompletionChoice(choice.index, text, logprobs, choice.finish_reason)


def completion_reply(
    frame: ReplyFrame, prompts: list[list[int]], finals: list[RequestOutput], n: int, echo: bool, tokenizer: Tokenizer
) -> CompletionResponse:
    """The whole reply to a batch of prompts (`finals`: each one's last output): prompt i's
    choices are numbered from i * n, and the usage is the batch's."""
    choices: list[CompletionChoice] = []
    usages: list[Usage] = []
    for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
        prefix = tokenizer.decode(prompt) if echo else ""
        whole = whole_choices(final)
        usages.append(whole.usage)
        for choice in whole.choices:
            choices.append(
                CompletionChoice(
                    i * n + choice.index,
                    prefix + choice.text,
                    completion_logprobs(choice.logprobs, len(prefix), tokenizer),
                    choice.finish_reason,
                    prompt_logprobs(final, tokenizer),
                )
            )
    usage = Usage(
        sum(u.prompt_tokens for u in usages),
        sum(u.completion_tokens for u in usages),
        sum(u.total_tokens for u in usages),
        PromptTokensDetails(sum(u.prompt_tokens_details.cached_tokens for u in usages)),
    )
    return CompletionResponse(frame.id, frame.created, frame.model, choices, usage)
