"""How the command line configures logging: text lines, or one JSON object a line
(`--log-format json`) for log collectors; a record's `request` field (the request log) becomes
part of its object."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def __init__(self, fields: dict[str, str] | None = None) -> None:
        """`fields`: added to every line (a data-parallel replica's `engine`)."""
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            **self.fields,
            "message": record.getMessage(),
        }
        request = getattr(record, "request", None)
        if isinstance(request, dict):
            entry["request"] = request
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(log_format: str = "text", engine: str | None = None) -> None:
    """`engine`: this process is that data-parallel replica, and every line says so."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter({"engine": engine} if engine is not None else None))
    else:
        tag = f"[engine {engine}] " if engine is not None else ""
        handler.setFormatter(logging.Formatter(f"%(levelname)s {tag}%(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])  # a no-op where logging is set up already
