"""Wire types every API shares: request bodies' base, the deltas' usage, the default error body."""

from __future__ import annotations

import msgspec


class Request(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Base for request bodies: unknown fields are an error, not silently ignored."""


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody
