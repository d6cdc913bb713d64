"""Typed errors. Each names the file, field or tensor at fault so the message alone says what to fix."""

import enum
from typing import Any


class CompiledEngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelConfigError(CompiledEngineError):
    """config.json describes a model this engine cannot run, or describes it inconsistently."""


class ModelLoadError(CompiledEngineError):
    """The weights on disk do not match the model the config describes."""


class ModelSourceError(CompiledEngineError):
    """A model name could not be turned into a local directory."""


class TokenizerError(CompiledEngineError):
    """The tokenizer files are missing or unusable, or a chat template failed to render."""


class OutOfPagesError(CompiledEngineError):
    """The KV page pool has no free page left for a request."""


class RequestError(CompiledEngineError):
    """A request is invalid as given (too long for the context, empty prompt, bad token id).
    `param`: the request field at fault (`prompt`, `max_tokens`, `temperature`, ...), where one is,
    so that the server can name it without parsing the message."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type["RequestError"], tuple[Any, ...]]:
        # Pickled whole (a data-parallel replica hands it to the front end): the default reduce
        # would rebuild it from the message alone and lose `param`.
        return type(self), (str(self), self.param)


class PromptProblem(enum.StrEnum):
    """What is wrong with a prompt, for callers that answer differently per kind (the server
    gives the context-length ones OpenAI's `context_length_exceeded` code)."""

    NOT_TOKEN_IDS = "not_token_ids"  # neither text nor a list of integers
    NO_TOKENIZER = "no_tokenizer"  # text prompt or stop strings, but the model has no tokenizer
    EMPTY = "empty"
    OUT_OF_VOCABULARY = "out_of_vocabulary"
    TOO_LONG = "too_long"  # the prompt alone fills the context: no room for one token
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt plus max_tokens does not fit

    @property
    def exceeds_context(self) -> bool:
        return self in (PromptProblem.TOO_LONG, PromptProblem.CONTEXT_LENGTH_EXCEEDED)


class PromptError(RequestError):
    """The engine cannot run this prompt (engine/request_validation.py): `problem` says why."""

    def __init__(self, message: str, problem: PromptProblem, param: str | None = "prompt") -> None:
        super().__init__(message, param)
        self.problem = problem

    def __reduce__(self) -> tuple[type["PromptError"], tuple[str, PromptProblem, str | None]]:
        # The default reduce would call PromptError(message) alone and fail on the missing problem.
        return type(self), (str(self), self.problem, self.param)


class EngineOverloadedError(CompiledEngineError):
    """Too many requests are waiting; the caller should retry later."""


class EngineDeadError(CompiledEngineError):
    """The engine loop stopped; no request can be served."""


class EngineShuttingDownError(CompiledEngineError):
    """The engine no longer admits requests because it is shutting down."""


class PrefixCacheBusyError(CompiledEngineError):
    """The prefix cache cannot be reset while requests hold pages."""
