"""How a server is set up (`serve`'s options that reach the app)."""

from __future__ import annotations

from dataclasses import dataclass, field

from compiled_engine.server.responses.store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_RESPONSES

DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Adapters a request may name as its `model` (name -> directory), loaded into the engine at
    # start (`serve --lora-modules`); with `runtime_lora_updates`, /v1/load_lora_adapter and
    # /v1/unload_lora_adapter change the set while serving.
    lora_modules: dict[str, str] = field(default_factory=dict)
    runtime_lora_updates: bool = False
    chat_page: bool = True  # serve the chat page at / (`serve --no-chat-page` turns it off)
    request_log: bool = True  # a log line per finished request (`--disable-log-requests`)
    log_prompts: bool = False  # the request log includes prompts (`--log-prompts`)
    # Stored responses (/v1/responses with store: true) kept for previous_response_id and GET.
    responses_store_size: int = DEFAULT_MAX_RESPONSES
    responses_max_age_s: float = DEFAULT_MAX_AGE_S
    tool_call_parser: str | None = None  # `serve --tool-call-parser` (server/common/tool_parsers.py); None: by family
    reasoning_parser: str | None = None  # `serve --reasoning-parser`: qwen3 or deepseek_r1 (server/common/reasoning.py)
