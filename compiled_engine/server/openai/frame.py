"""What every reply, and every chunk of a streamed one, repeats about its request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from compiled_engine.server.common.deltas import StepDeltas
from compiled_engine.server.common.engine_streams import DONE, sse
from compiled_engine.server.common.errors import ServerError
from compiled_engine.server.common.protocol import ErrorBody, ErrorResponse, Usage
from compiled_engine.server.openai.protocol import StreamOptions


@dataclass(frozen=True)
class ReplyFrame:
    id: str
    model: str
    stream_options: StreamOptions | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def running_usage(self, step: StepDeltas) -> Usage | None:
        """The usage so far, for every chunk of a stream with `continuous_usage_stats` (vLLM's)."""
        options = self.stream_options
        return step.usage if options is not None and options.continuous_usage_stats else None

    @property
    def usage_at_end(self) -> bool:
        """A last chunk carries the usage (`include_usage`)."""
        return self.stream_options is not None and self.stream_options.include_usage


def openai_failure(error: ServerError, sent: int) -> bytes:
    """A stream's last event when it fails after its 200: an `error` object, then `[DONE]` (docs/api.md)."""
    return sse(ErrorResponse(ErrorBody(error.message, error.type, error.param, error.code))) + sse(DONE)
