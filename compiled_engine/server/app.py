"""The Litestar app: OpenAI-compatible routes over an AsyncEngine."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import SerializationException
from litestar.logging.config import LoggingConfig
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.params import Body
from litestar.response import Stream
from msgspec import UNSET, UnsetType

from compiled_engine.engine.async_engine import AsyncEngine
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.outputs import CompletionOutput, RequestOutput
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine.structured_outputs import StructuredOutputs
from compiled_engine.errors import PromptError, RequestError
from compiled_engine.lora.adapter import LoRAError
from compiled_engine.lora.manager import LoRAManager, LoRARequest
from compiled_engine.server.docs_page import PlainDocsRenderPlugin
from compiled_engine.server.errors import ApiError, error_response, handle_exception
from compiled_engine.server.metrics import ServerMetrics
from compiled_engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    ToolCall,
    ToolCallFunction,
    TopLogprob,
    UnloadLoRAAdapterRequest,
    Usage,
)
from compiled_engine.server.request_log import RequestLog
from compiled_engine.server.structured import structured_outputs_of
from compiled_engine.server.tools import ToolPlan, checked_tool_calls, held_back, render_turns, tool_plan
from compiled_engine.tokenizer import Tokenizer


def _lora_manager(engine: LLMEngine) -> LoRAManager:
    if not isinstance(engine.adapters, LoRAManager):
        raise LoRAError("this server serves no LoRA adapters: start it with --enable-lora")
    return engine.adapters


T = TypeVar("T")
DEFAULT_MAX_BODY_BYTES = 1 << 20
CHAT_PAGE_DIR = Path(__file__).parent / "chat_page"
# The chat page's files (read once: they ship with the package), with their media types.
CHAT_PAGE_FILES = {
    name: ((CHAT_PAGE_DIR / name).read_bytes(), media_type)
    for name, media_type in (
        ("index.html", "text/html; charset=utf-8"),
        ("chat.js", "text/javascript; charset=utf-8"),
        ("chat.css", "text/css; charset=utf-8"),
    )
}
CHAT_ROLES = ("system", "user", "assistant", "tool")
CHAT_PATH = "/v1/chat/completions"
# The engine's names for request fields (RequestError.param) that a chat body calls otherwise.
CHAT_PARAMS = {"prompt": "messages", "logprobs": "top_logprobs"}


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


class OpenAIServer:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        tokenizer = engine.engine.tokenizer
        if tokenizer is None:
            raise ValueError("the server needs a model with a tokenizer")
        self.tokenizer: Tokenizer = tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.created = int(time.time())

    # -- request checks -------------------------------------------------------------------------

    def check_auth(self, request: Request[Any, Any, Any]) -> str | None:
        """The cache salt of the caller: one per API key, so tenants never share cached pages."""
        if not self.settings.api_keys:
            return None
        header = request.headers.get("authorization", "")
        given = (header[7:] if header.lower().startswith("bearer ") else "").encode()
        # Compare with every key, each in constant time, so timing tells nothing about which matched.
        matches = [hmac.compare_digest(given, key.encode()) for key in self.settings.api_keys]
        if not any(matches):
            raise ApiError(
                401,
                "missing or invalid API key (send 'Authorization: Bearer <key>')",
                "authentication_error",
                code="invalid_api_key",
            )
        return hashlib.sha256(given).hexdigest()

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, None for the base model; 404 for anything else."""
        if model is None or model == self.settings.served_model_name:
            return None
        path = self.settings.lora_modules.get(model)
        if path is not None:
            return LoRARequest(model, path)
        adapters = "".join(f", '{name}'" for name in self.settings.lora_modules)
        raise ApiError(
            404,
            f"the model '{model}' does not exist; this server serves '{self.settings.served_model_name}'{adapters}",
            "not_found_error",
            "model",
            "model_not_found",
        )

    async def structured_outputs(self, body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputs | None:
        """The request's output constraint, its grammar compiled (in a thread pool, cached)
        before the request reaches the engine; a RequestError (a 400) if it is invalid."""
        spec = structured_outputs_of(body)
        if spec is not None:
            await self.engine.engine.grammars.prepare(spec)
        return spec

    def default_max_tokens(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """`max_tokens` as given, or by default what the context leaves after the prompt. The
        engine checks the prompt and the total (request_validation); at least 1 so that a prompt
        that fills the context is refused as too long, not for its max_tokens."""
        if max_tokens is not None:
            return max_tokens
        return max(self.max_model_len - len(prompt_ids), 1)

    def prompt_logprobs(self, output: RequestOutput) -> PromptLogprobs | UnsetType:
        """vLLM's prompt_logprobs: for each prompt token (None for the first), the token's own and
        the top-N, by token id."""
        if output.prompt_logprobs is None:
            return UNSET
        entries: PromptLogprobs = []
        for entry in output.prompt_logprobs:
            if entry is None:
                entries.append(None)
                continue
            found = {
                str(entry.token_id): PromptLogprob(entry.logprob, entry.rank, self.tokenizer.decode([entry.token_id]))
            }
            for rank, (token, value) in enumerate(zip(entry.top_token_ids, entry.top_logprobs, strict=True), 1):
                found.setdefault(str(token), PromptLogprob(value, rank, self.tokenizer.decode([token])))
            entries.append(found)
        return entries

    def usage(self, output: RequestOutput) -> Usage:
        completion = sum(len(c.token_ids) for c in output.outputs)
        prompt = len(output.prompt_token_ids)
        return Usage(prompt, completion, prompt + completion, PromptTokensDetails(output.num_cached_tokens))

    # -- completions ----------------------------------------------------------------------------

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if all(isinstance(t, int) for t in prompt):  # one prompt of token ids (or [], refused as empty)
            return [[t for t in prompt if isinstance(t, int)]]
        prompts: list[list[int]] = []
        for item in prompt:
            if isinstance(item, str):
                prompts.append(self.tokenizer.encode(item))
            elif isinstance(item, list):
                prompts.append(list(item))
            else:
                raise ApiError(400, "prompt must be a string, a list of token ids, or a list of either", param="prompt")
        return prompts

    def completion_logprobs(self, completion: CompletionOutput, offset: int) -> CompletionLogprobs | None:
        if completion.logprobs is None:
            return None
        tokens: list[str] = []
        offsets: list[int] = []
        top: list[dict[str, float] | None] = []
        for entry in completion.logprobs:
            text = self.tokenizer.decode([entry.token_id], False)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            top.append(
                {
                    self.tokenizer.decode([t], False): v
                    for t, v in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
                }
            )
        return CompletionLogprobs(tokens, [e.logprob for e in completion.logprobs], top, offsets)

    def chat_logprobs(self, completion: CompletionOutput, start: int = 0) -> ChatLogprobs | None:
        if completion.logprobs is None:
            return None
        content = []
        for entry in completion.logprobs[start:]:
            text = self.tokenizer.decode([entry.token_id], False)
            top = [
                TopLogprob(t_text, v, list(t_text.encode()))
                for t, v in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
                for t_text in [self.tokenizer.decode([t], False)]
            ]
            content.append(ChatTokenLogprob(text, entry.logprob, list(text.encode()), top))
        return ChatLogprobs(content)


MAX_N = 16  # completions per request


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    structured: StructuredOutputs | None = None,
) -> SamplingParams:
    if body.n > MAX_N:
        raise ApiError(400, f"n must be at most {MAX_N}, got {body.n}", param="n")
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(400, "prompt_logprobs needs stream: false", param="prompt_logprobs")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    bias: list[tuple[int, float]] = []
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit():
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        bias.append((int(key), value))
    return SamplingParams(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=tuple(stop),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        structured_outputs=structured,
        logit_bias=tuple(bias),
        prompt_logprobs=body.prompt_logprobs,
    )


class BodyRequest(Request[Any, Any, Any]):
    """Litestar's request, but a JSON body nested too deeply for the decoder (it recurses once
    per level) is refused like any other undecodable body: a 400, not a RecursionError and a 500."""

    async def json(self) -> Any:
        try:
            return await super().json()
        except RecursionError as exc:
            # Litestar answers a SerializationException from the body decoder with a 400.
            raise SerializationException("the JSON body is nested too deeply to decode") from exc


def handle_request_error(request: Request[Any, Any, Any], exc: Exception) -> Response[ErrorResponse]:
    """The engine's refusal of a request (engine/request_validation.py, SamplingParams) as
    OpenAI's 400, naming the field at fault as the route's body calls it."""
    if not isinstance(exc, RequestError):
        return handle_exception(request, exc)
    param = exc.param
    if param is not None and request.url.path == CHAT_PATH:
        param = CHAT_PARAMS.get(param, param)
    code = "context_length_exceeded" if isinstance(exc, PromptError) and exc.problem.exceeds_context else None
    return error_response(400, str(exc), "invalid_request_error", param, code)


def sse(payload: msgspec.Struct | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else msgspec.json.encode(payload)
    return b"data: " + data + b"\n\n"


def create_app(engine: AsyncEngine, settings: ServerSettings) -> Litestar:
    server = OpenAIServer(engine, settings)
    metrics = ServerMetrics(engine, settings.served_model_name)

    request_log = RequestLog(settings.request_log, settings.log_prompts, server.tokenizer.decode)

    async def observed(
        stream: AsyncIterator[RequestOutput], adapter: str | None, n: int
    ) -> AsyncIterator[RequestOutput]:
        """Counts and logs each request once it finishes, or once its client has gone away (the
        stream closed at a yield, or cancelled while waiting: counted with finish reason `abort`)."""
        last, logged = None, False
        try:
            async for output in stream:
                last = output
                if output.finished:
                    metrics.observe(output, adapter)
                    request_log.record(output, adapter or settings.served_model_name)
                    logged = True
                yield output
        except (GeneratorExit, asyncio.CancelledError):
            if not logged:
                metrics.observe_abandoned(last, n)
            raise
        finally:
            if last is not None and not logged:
                request_log.record(last, adapter or settings.served_model_name, aborted=True)

    def generate(
        prompt: list[int], params: SamplingParams, request_id: str, salt: str | None, lora: LoRARequest | None
    ) -> AsyncIterator[RequestOutput]:
        stream = engine.generate(prompt, params, request_id, salt, lora)
        return observed(stream, lora.name if lora else None, params.n)

    @get("/metrics", sync_to_thread=False, media_type="text/plain; version=0.0.4")
    def prometheus() -> bytes:
        """Prometheus metrics: requests, tokens, latencies, queue, KV pages, prefix cache."""
        return metrics.render()

    @get("/health", sync_to_thread=False)
    def health() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @get("/ready", sync_to_thread=False)
    def ready() -> Response[Any]:
        """Readiness: the model is loaded and the engine loop is alive and admitting."""
        if not engine.is_alive:
            return error_response(503, "the engine loop is not running", "service_unavailable")
        if not engine.accepting:
            return error_response(503, "the server is shutting down", "service_unavailable")
        return Response({"status": "ready"})

    @get("/v1/models", sync_to_thread=False)
    def models(request: Request[Any, Any, Any]) -> ModelList:
        """The model this server serves, and each LoRA adapter on it (with its `parent`)."""
        server.check_auth(request)
        base = settings.served_model_name
        cards = [ModelCard(base, server.created, max_model_len=server.max_model_len, root=base)]
        for name, path in settings.lora_modules.items():
            cards.append(ModelCard(name, server.created, max_model_len=server.max_model_len, root=path, parent=base))
        return ModelList(cards)

    @post("/v1/load_lora_adapter", status_code=200)
    async def load_lora_adapter(
        request: Request[Any, Any, Any], data: Annotated[LoadLoRAAdapterRequest, Body()]
    ) -> Response[str]:
        """Load a LoRA adapter while serving (`serve --enable-runtime-lora-updates`)."""
        server.check_auth(request)
        name = data.lora_name
        if name == settings.served_model_name:
            raise ApiError(400, f"'{name}' is the base model's name", param="lora_name")
        if name in settings.lora_modules:
            raise ApiError(400, f"the LoRA adapter '{name}' is already loaded", param="lora_name")
        lora = LoRARequest(name, data.lora_path)
        await engine.call(lambda e: _lora_manager(e).add(lora))
        settings.lora_modules[name] = data.lora_path
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @post("/v1/unload_lora_adapter", status_code=200)
    async def unload_lora_adapter(
        request: Request[Any, Any, Any], data: Annotated[UnloadLoRAAdapterRequest, Body()]
    ) -> Response[str]:
        """Unload a LoRA adapter; refused with 409 while requests use it."""
        server.check_auth(request)
        name = data.lora_name
        if name not in settings.lora_modules:
            raise ApiError(404, f"the LoRA adapter '{name}' is not loaded", "not_found_error", "lora_name")
        try:
            await engine.call(lambda e: _lora_manager(e).remove(name))
        except LoRAError as exc:
            raise ApiError(409, str(exc), "conflict_error", "lora_name", "adapter_in_use") from exc
        del settings.lora_modules[name]
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    @post("/v1/completions", status_code=200)
    async def completions(request: Request[Any, Any, Any], data: Annotated[CompletionRequest, Body()]) -> Any:
        """OpenAI text completions (prompt as text, token ids, or a list of either)."""
        salt = server.check_auth(request)
        lora = server.check_model(data.model)
        prompts = server.completion_prompts(data)
        if data.stream and len(prompts) > 1:
            raise ApiError(400, "streaming supports one prompt per request", param="prompt")
        structured = await server.structured_outputs(data)
        params = [
            sampling_params(data, server.default_max_tokens(p, data.max_tokens), data.logprobs, structured)
            for p in prompts
        ]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = data.model or settings.served_model_name
        if data.stream:
            stream = generate(prompts[0], params[0], request_id, salt, lora)
            first = await _first_output(stream)
            return Stream(
                _completion_events(server, data, request_id, created, first, stream), media_type="text/event-stream"
            )
        # A batch of prompts runs concurrently, like any other set of requests.
        finals = await _unless_disconnected(
            request,
            _final_outputs(
                [
                    generate(prompt, p, f"{request_id}-{i}", salt, lora)
                    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
                ]
            ),
        )
        choices: list[CompletionChoice] = []
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            prefix = server.tokenizer.decode(prompt) if data.echo else ""
            for completion in final.outputs:
                choices.append(
                    CompletionChoice(
                        i * data.n + completion.index,
                        prefix + completion.text,
                        server.completion_logprobs(completion, len(prefix)),
                        completion.finish_reason,
                        server.prompt_logprobs(final),
                    )
                )
        usages = [server.usage(final) for final in finals]
        usage = Usage(
            sum(u.prompt_tokens for u in usages),
            sum(u.completion_tokens for u in usages),
            sum(u.total_tokens for u in usages),
            PromptTokensDetails(sum(u.prompt_tokens_details.cached_tokens for u in usages)),
        )
        return CompletionResponse(request_id, created, model, choices, usage)

    @post("/tokenize", status_code=200)
    async def tokenize(request: Request[Any, Any, Any], data: Annotated[TokenizeRequest, Body()]) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt's token ids, or chat messages' through the chat template."""
        server.check_auth(request)
        server.check_model(data.model)
        if (data.prompt is None) == (data.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        if data.prompt is not None:
            tokens = server.tokenizer.encode(data.prompt, add_special_tokens=data.add_special_tokens)
        else:
            messages = _chat_messages(ChatCompletionRequest(messages=data.messages or []))
            turns = render_turns(messages, None, server.tokenizer.template_takes_tools)
            tokens = server.tokenizer.encode_chat(turns, data.add_generation_prompt)
        return TokenizeResponse(len(tokens), server.engine.engine.max_model_len, list(tokens))

    @post("/detokenize", status_code=200)
    async def detokenize(
        request: Request[Any, Any, Any], data: Annotated[DetokenizeRequest, Body()]
    ) -> DetokenizeResponse:
        """vLLM's /detokenize: token ids back to text (special tokens kept)."""
        server.check_auth(request)
        server.check_model(data.model)
        vocab = server.engine.engine.runner.model_config.vocab_size
        bad = [token for token in data.tokens if not 0 <= token < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return DetokenizeResponse(server.tokenizer.decode(data.tokens, skip_special_tokens=False))

    @post(CHAT_PATH, status_code=200)
    async def chat_completions(request: Request[Any, Any, Any], data: Annotated[ChatCompletionRequest, Body()]) -> Any:
        """OpenAI chat completions: messages rendered with the model's chat template."""
        salt = server.check_auth(request)
        lora = server.check_model(data.model)
        if data.functions is not None:
            raise ApiError(
                400,
                "'functions' is not supported by this server: use tools",
                param="functions",
                code="unsupported_parameter",
            )
        plan = tool_plan(data.tools, data.tool_choice)
        takes_tools = server.tokenizer.template_takes_tools
        turns = render_turns(_chat_messages(data), plan, takes_tools)
        template_tools = [{"type": "function", "function": t} for t in plan.tools] if plan and takes_tools else None
        prompt = server.tokenizer.encode_chat(turns, tools=template_tools)
        limit = data.max_completion_tokens if data.max_completion_tokens is not None else data.max_tokens
        max_tokens = server.default_max_tokens(prompt, limit)
        top = data.top_logprobs or 0
        if top and not data.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        structured = await server.structured_outputs(data)
        forced = plan.constraint() if plan is not None else None
        if forced is not None:
            if structured is not None:
                raise ApiError(
                    400,
                    f"tool_choice {data.tool_choice!r} constrains the output itself: drop the output constraint",
                    param="tool_choice",
                )
            await server.engine.engine.grammars.prepare(forced)
            structured = forced
        params = sampling_params(data, max_tokens, top if data.logprobs else None, structured)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if data.stream:
            stream = generate(prompt, params, request_id, salt, lora)
            first = await _first_output(stream)
            return Stream(
                _chat_events(server, data, request_id, created, first, stream, plan), media_type="text/event-stream"
            )
        final = await _unless_disconnected(request, _final_output(generate(prompt, params, request_id, salt, lora)))
        choices = []
        for c in final.outputs:
            content, calls = plan.calls(c.text) if plan is not None else (c.text, [])
            message = AssistantMessage(content)
            reason = c.finish_reason
            if calls:
                message.tool_calls = [ToolCall(call.id, ToolCallFunction(call.name, call.arguments)) for call in calls]
                reason = "tool_calls" if reason == "stop" else reason
            choices.append(ChatChoice(c.index, message, server.chat_logprobs(c), reason))
        return ChatCompletionResponse(
            request_id,
            created,
            data.model or settings.served_model_name,
            choices,
            server.usage(final),
            prompt_logprobs=server.prompt_logprobs(final),
        )

    @get("/", sync_to_thread=False, media_type="text/html; charset=utf-8", include_in_schema=False)
    def chat_page() -> bytes:
        """The chat page (not behind the API key; every call it makes carries the key)."""
        return CHAT_PAGE_FILES["index.html"][0]

    @get("/chat/{name:str}", sync_to_thread=False, include_in_schema=False)
    def chat_page_file(name: str) -> Response[bytes]:
        if name not in CHAT_PAGE_FILES or name == "index.html":
            raise ApiError(404, f"no such file: {name}", "not_found_error")
        content, media_type = CHAT_PAGE_FILES[name]
        return Response(content, media_type=media_type)

    return Litestar(
        route_handlers=[health, ready, prometheus, models, completions, chat_completions, tokenize, detokenize]
        + ([load_lora_adapter, unload_lora_adapter] if settings.runtime_lora_updates else [])
        + ([chat_page, chat_page_file] if settings.chat_page else []),
        middleware=[metrics.middleware],
        exception_handlers={Exception: handle_exception, RequestError: handle_request_error},
        request_class=BodyRequest,
        request_max_body_size=settings.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="compiled_engine",
            version="0.1.0",
            path="/docs",
            render_plugins=[PlainDocsRenderPlugin(), JsonRenderPlugin()],
        ),
        # Litestar would otherwise reconfigure the root logger of whatever process embeds the app.
        logging_config=LoggingConfig(configure_root_logger=False),
    )


def _chat_messages(data: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not data.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    messages = []
    for i, message in enumerate(data.messages):
        if message.role not in CHAT_ROLES:
            raise ApiError(
                400,
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got '{message.role}'",
                param="messages",
            )
        content = message.content
        if isinstance(content, list):
            kinds = {part.type for part in content}
            if kinds - {"text"}:
                raise ApiError(
                    400,
                    f"messages[{i}] has content parts of type {sorted(kinds - {'text'})}: only text is supported (no images or audio)",
                    param="messages",
                    code="unsupported_parameter",
                )
            content = "".join(part.text for part in content if isinstance(part.text, str))
        turn: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.tool_calls is not None:
            if message.role != "assistant":
                raise ApiError(400, f"messages[{i}]: only assistant turns carry tool_calls", param="messages")
            turn["tool_calls"] = checked_tool_calls(message.tool_calls, f"messages[{i}]")
        if message.role == "tool":
            turn["tool_call_id"] = message.tool_call_id or ""
        messages.append(turn)
    return messages


async def _first_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """Wait for the first output so that a refused request fails with its status code before
    the event stream (and its 200) starts."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _unless_disconnected(request: Request[Any, Any, Any], work: Coroutine[Any, Any, T]) -> T:
    """Run `work` (a non-streamed reply) while watching the connection: a client that goes away
    first cancels it, which aborts its requests and returns their pages at the next step."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ApiError(
                499, "the client closed the connection; its request was aborted", code="client_closed_request"
            )
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    """Returns when the client disconnects (the body has been read, so nothing else arrives)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _final_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    assert final is not None
    return final


async def _final_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run the streams together. The first to fail (a refused prompt of a batch) cancels the
    others, which aborts their requests and returns their pages, and its error is raised."""
    tasks = [asyncio.ensure_future(_final_output(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        # Wait until the cancelled ones have aborted, and collect every error so that none is
        # logged as never retrieved.
        await asyncio.gather(*tasks, return_exceptions=True)


async def _chain(first: RequestOutput | None, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first
    async for output in rest:
        yield output


async def _completion_events(
    server: OpenAIServer,
    data: CompletionRequest,
    request_id: str,
    created: int,
    first: RequestOutput | None,
    stream: AsyncIterator[RequestOutput],
) -> AsyncIterator[bytes]:
    model = data.model or server.settings.served_model_name
    shown = [0] * data.n
    shown_logprobs = [0] * data.n
    last: RequestOutput | None = None
    echoed = not data.echo
    async for output in _chain(first, stream):
        last = output
        for c in output.outputs:
            delta = c.text[shown[c.index] :]
            if not echoed:
                delta = server.tokenizer.decode(output.prompt_token_ids) + delta
            logprobs = None
            if c.logprobs is not None:
                fresh = CompletionOutput(c.index, "", [], logprobs=c.logprobs[shown_logprobs[c.index] :])
                logprobs = server.completion_logprobs(fresh, shown[c.index])
                shown_logprobs[c.index] = len(c.logprobs)
            if delta or c.finish_reason or logprobs:
                yield sse(
                    CompletionResponse(
                        request_id,
                        created,
                        model,
                        [CompletionChoice(c.index, delta, logprobs, c.finish_reason)],
                        _running_usage(server, data, output),
                    )
                )
            shown[c.index] = len(c.text)
        echoed = True
    if last is not None and data.stream_options is not None and data.stream_options.include_usage:
        yield sse(CompletionResponse(request_id, created, model, [], server.usage(last)))
    yield sse("[DONE]")


async def _chat_events(
    server: OpenAIServer,
    data: ChatCompletionRequest,
    request_id: str,
    created: int,
    first: RequestOutput | None,
    stream: AsyncIterator[RequestOutput],
    plan: ToolPlan | None = None,
) -> AsyncIterator[bytes]:
    """With tools (`plan`), a reply's text streams only up to where a call could begin (none of it
    for `required` or a named function); the calls come in one chunk when the reply ends."""
    model = data.model or server.settings.served_model_name
    for index in range(data.n):
        yield sse(
            ChatCompletionChunk(
                request_id, created, model, [ChatChunkChoice(index, Delta(role="assistant", content=""), None, None)]
            )
        )
    shown = [0] * data.n
    shown_logprobs = [0] * data.n
    last: RequestOutput | None = None
    async for output in _chain(first, stream):
        last = output
        for c in output.outputs:
            usage = _running_usage(server, data, output)
            if plan is not None:
                for chunk in _tool_deltas(plan, c, shown):
                    yield sse(ChatCompletionChunk(request_id, created, model, [chunk], usage))
                continue
            delta = c.text[shown[c.index] :]
            logprobs = server.chat_logprobs(c, shown_logprobs[c.index])
            if c.logprobs is not None:
                shown_logprobs[c.index] = len(c.logprobs)
            if delta or c.finish_reason or (logprobs and logprobs.content):
                yield sse(
                    ChatCompletionChunk(
                        request_id,
                        created,
                        model,
                        [ChatChunkChoice(c.index, Delta(content=delta), logprobs, c.finish_reason)],
                        usage,
                    )
                )
            shown[c.index] = len(c.text)
    if last is not None and data.stream_options is not None and data.stream_options.include_usage:
        yield sse(ChatCompletionChunk(request_id, created, model, [], server.usage(last)))
    yield sse("[DONE]")


def _tool_deltas(plan: ToolPlan, c: CompletionOutput, shown: list[int]) -> list[ChatChunkChoice]:
    """One choice's chunks of a step under tools: the text that can no longer be a call, and at
    the end the calls (or, when there are none, the rest of the text)."""
    chunks = []
    if c.finish_reason is None:
        end = held_back(c.text) if plan.choice == "auto" else 0
        if end > shown[c.index]:
            chunks.append(ChatChunkChoice(c.index, Delta(content=c.text[shown[c.index] : end]), None, None))
            shown[c.index] = end
        return chunks
    _, calls = plan.calls(c.text)
    if not calls:
        rest = c.text[shown[c.index] :]
        chunks.append(ChatChunkChoice(c.index, Delta(content=rest), None, c.finish_reason))
    else:
        deltas = [
            DeltaToolCall(i, call.id, ToolCallFunction(call.name, call.arguments)) for i, call in enumerate(calls)
        ]
        reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        chunks.append(ChatChunkChoice(c.index, Delta(tool_calls=deltas), None, reason))
    shown[c.index] = len(c.text)
    return chunks


def _running_usage(
    server: OpenAIServer, data: CompletionRequest | ChatCompletionRequest, output: RequestOutput
) -> Usage | None:
    """The usage so far, for every chunk of a stream with `continuous_usage_stats` (vLLM's)."""
    options = data.stream_options
    return server.usage(output) if options is not None and options.continuous_usage_stats else None
