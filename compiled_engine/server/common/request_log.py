"""One log line per finished request: its id, the model or adapter, token counts, latencies and
finish reason (on by default, `serve --disable-log-requests` turns it off). Prompts are logged
only with `--log-prompts`. With `--log-format json` each line is a JSON object whose `request`
field holds these values (compiled_engine/logs.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from compiled_engine.engine.outputs import RequestOutput

logger = logging.getLogger("compiled_engine.requests")


class RequestLog:
    def __init__(
        self, enabled: bool = True, log_prompts: bool = False, decode: Callable[[list[int]], str] | None = None
    ) -> None:
        """`decode`: token ids to text, for prompts given as ids (the server always gives ids)."""
        self.enabled = enabled
        self.log_prompts = log_prompts
        self.decode = decode

    def record(self, output: RequestOutput, model: str, aborted: bool = False) -> None:
        """Log `output` (the request's last output) as finished; `aborted`: its client went away
        before it finished."""
        if not self.enabled:
            return
        metrics = output.metrics
        reasons = sorted({c.finish_reason for c in output.outputs if c.finish_reason is not None})
        fields: dict[str, Any] = {
            "request_id": output.request_id,
            "model": model,
            "prompt_tokens": len(output.prompt_token_ids),
            "cached_tokens": output.num_cached_tokens,
            "completion_tokens": sum(len(c.token_ids) for c in output.outputs),
            "ttft_s": None if metrics is None or metrics.ttft is None else round(metrics.ttft, 4),
            "e2e_s": None if metrics is None or metrics.e2e is None else round(metrics.e2e, 4),
            "finish_reason": "abort" if aborted else ",".join(reasons) or None,
        }
        if self.log_prompts:
            prompt = output.prompt
            if prompt is None and self.decode is not None:
                prompt = self.decode(output.prompt_token_ids)
            fields["prompt"] = prompt
            fields["prompt_token_ids"] = output.prompt_token_ids
        text = " ".join(f"{key}={value}" for key, value in fields.items() if key != "prompt_token_ids")
        logger.info("request %s", text, extra={"request": fields})
