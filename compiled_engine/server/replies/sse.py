"""Server-sent events: the framing of every streamed reply."""

from __future__ import annotations

import msgspec

DONE = "[DONE]"  # OpenAI's last event of a stream


def sse(payload: msgspec.Struct | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else msgspec.json.encode(payload)
    return b"data: " + data + b"\n\n"
