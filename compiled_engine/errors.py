"""Typed errors. Each names the file, field or tensor at fault so the message alone says what to fix."""


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
    """A request is invalid as given (too long for the context, empty prompt, bad token id)."""


class EngineOverloadedError(CompiledEngineError):
    """Too many requests are waiting; the caller should retry later."""


class EngineDeadError(CompiledEngineError):
    """The engine loop stopped; no request can be served."""


class EngineShuttingDownError(CompiledEngineError):
    """The engine no longer admits requests because it is shutting down."""
