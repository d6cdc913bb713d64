"""Logprobs in the wire shapes: completions' (tokens, offsets, top-N by text), chat's (per token,
with bytes), and vLLM's prompt_logprobs (per prompt token, by token id)."""

from __future__ import annotations

from msgspec import UNSET, UnsetType

from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sampler import TokenLogprobs
from compiled_engine.server.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from compiled_engine.tokenizer import Tokenizer


def completion_logprobs(
    entries: list[TokenLogprobs] | None, offset: int, tokenizer: Tokenizer
) -> CompletionLogprobs | None:
    """`offset`: where the first token's text starts in the reply's text."""
    if entries is None:
        return None
    tokens: list[str] = []
    offsets: list[int] = []
    top: list[dict[str, float] | None] = []
    for entry in entries:
        text = tokenizer.decode([entry.token_id], False)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top.append(
            {tokenizer.decode([t], False): v for t, v in zip(entry.top_token_ids, entry.top_logprobs, strict=True)}
        )
    return CompletionLogprobs(tokens, [e.logprob for e in entries], top, offsets)


def chat_logprobs(entries: list[TokenLogprobs] | None, tokenizer: Tokenizer) -> ChatLogprobs | None:
    if entries is None:
        return None
    content = []
    for entry in entries:
        text = tokenizer.decode([entry.token_id], False)
        top = [
            TopLogprob(t_text, v, list(t_text.encode()))
            for t, v in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
            for t_text in [tokenizer.decode([t], False)]
        ]
        content.append(ChatTokenLogprob(text, entry.logprob, list(text.encode()), top))
    return ChatLogprobs(content)


def prompt_logprobs(output: RequestOutput, tokenizer: Tokenizer) -> PromptLogprobs | UnsetType:
    """vLLM's prompt_logprobs: for each prompt token (None for the first), the token's own and
    the top-N, by token id."""
    if output.prompt_logprobs is None:
        return UNSET
    entries: PromptLogprobs = []
    for entry in output.prompt_logprobs:
        if entry is None:
            entries.append(None)
            continue
        found = {str(entry.token_id): PromptLogprob(entry.logprob, entry.rank, tokenizer.decode([entry.token_id]))}
        for rank, (token, value) in enumerate(zip(entry.top_token_ids, entry.top_logprobs, strict=True), 1):
            found.setdefault(str(token), PromptLogprob(value, rank, tokenizer.decode([token])))
        entries.append(found)
    return entries
