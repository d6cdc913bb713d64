"""Request validation: every check on a prompt that needs the model (its tokenizer, its
vocabulary, its context length), in one place. Each failure is a PromptError naming the problem
and the request field at fault, so every front end (LLM, the engine client, the HTTP server) reports
the same thing in the same words. SamplingParams checks its own fields when it is built: those
need no model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import PromptError, PromptProblem, RequestError

if TYPE_CHECKING:
    from compiled_engine.tokenizer import Tokenizer


def prompt_token_ids(prompt: object, tokenizer: Tokenizer | None, model: str) -> list[int]:
    """The prompt as token ids: text through the tokenizer, a list of integers as given (copied)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise PromptError(f"{model} has no tokenizer: pass token ids", PromptProblem.NO_TOKENIZER)
        return tokenizer.encode(prompt)
    if not isinstance(prompt, list | tuple):
        raise PromptError(
            f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}",
            PromptProblem.NOT_TOKEN_IDS,
        )
    for position, token in enumerate(prompt):
        # bool is an int subclass, but True is no token id: it is a caller's mistake.
        if not isinstance(token, int) or isinstance(token, bool):
            raise PromptError(
                f"a token-id prompt must be a list of integers; item {position} is {type(token).__name__} {token!r}",
                PromptProblem.NOT_TOKEN_IDS,
            )
    return list(prompt)


def check_prompt(prompt_ids: list[int], max_tokens: int, vocab_size: int, max_model_len: int) -> None:
    """A PromptError unless the prompt is non-empty, inside the vocabulary, and fits the context
    together with `max_tokens` (at least 1: SamplingParams refuses less).

    max_model_len never exceeds what the KV cache holds (Runner), so a request that passes
    always fits alone and preemption can always make progress."""
    if not prompt_ids:
        raise PromptError("the prompt is empty", PromptProblem.EMPTY)
    bad = next((i for i, token in enumerate(prompt_ids) if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise PromptError(
            f"token id {prompt_ids[bad]} is outside the vocabulary (0..{vocab_size - 1}) at prompt position {bad}",
            PromptProblem.OUT_OF_VOCABULARY,
        )
    length = len(prompt_ids)
    if length >= max_model_len:
        # Lowering max_tokens cannot help here, so the message is about the prompt alone.
        raise PromptError(
            f"the prompt has {length} tokens; this model's context length is {max_model_len} tokens",
            PromptProblem.TOO_LONG,
        )
    if length + max_tokens > max_model_len:
        raise PromptError(
            f"the prompt has {length} tokens and max_tokens is {max_tokens}: "
            f"{length + max_tokens} exceeds the context length {max_model_len}",
            PromptProblem.CONTEXT_LENGTH_EXCEEDED,
            param="max_tokens",
        )


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    has_tokenizer: bool,
) -> None:
    """check_prompt, and the sampling parameters that need a tokenizer."""
    check_prompt(prompt_ids, params.max_tokens, vocab_size, max_model_len)
    outside = [token for token, _ in params.logit_bias if token >= vocab_size]
    if outside:
        raise RequestError(
            f"logit_bias token id {outside[0]} is outside the vocabulary (0..{vocab_size - 1})", param="logit_bias"
        )
    if params.stop and not has_tokenizer:
        raise PromptError(
            "stop strings need a tokenizer; this model has none",
            PromptProblem.NO_TOKENIZER,
            param="stop",
        )
