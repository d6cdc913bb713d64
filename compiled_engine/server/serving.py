"""`Serving`: what every route shares (the engine, the settings, the tokenizer), the checks every
request passes, and running an engine request observed by the metrics and the request log."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request

from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sampling_params import SamplingParams, StructuredOutputs
from compiled_engine.lora.manager import LoRARequest
from compiled_engine.model.registry import family_of
from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.common.reasoning import ReasoningParser
from compiled_engine.server.common.request_log import RequestLog
from compiled_engine.server.common.tool_parsers import tool_call_parser
from compiled_engine.server.metrics import ServerMetrics
from compiled_engine.server.openai.constraints import structured_outputs_of
from compiled_engine.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from compiled_engine.server.responses.store import ResponseStore
from compiled_engine.server.settings import ServerSettings
from compiled_engine.serving.client import EngineClient
from compiled_engine.tokenizer import Tokenizer


class Serving:
    def __init__(self, engine: EngineClient, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.served = served = engine.served
        tokenizer = served.tokenizer
        if tokenizer is None:
            raise ValueError("the server needs a model with a tokenizer")
        self.tokenizer: Tokenizer = tokenizer
        self.max_model_len = served.max_model_len
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine, settings.served_model_name, len(engine.health()))
        self.request_log = RequestLog(settings.request_log, settings.log_prompts, tokenizer.decode)
        self.responses = ResponseStore(settings.responses_store_size, settings.responses_max_age_s)
        self.reasoning = ReasoningParser(settings.reasoning_parser) if settings.reasoning_parser else None
        self.pooling = served.pooling  # None: a generating server
        family_default = family_of(served.model_config).tool_call_parser
        self.tool_parser = tool_call_parser(settings.tool_call_parser, family_default, tokenizer.template_takes_tools)

    # -- request checks -------------------------------------------------------------------------

    def check_auth(self, request: Request[Any, Any, Any]) -> str | None:
        """The cache salt of the caller: one per API key, so tenants never share cached pages."""
        if not self.settings.api_keys:
            return None
        header = request.headers.get("authorization", "")
        # Anthropic's clients send the key as x-api-key.
        given = (header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")).encode()
        # Compare with every key, each in constant time, so timing tells nothing about which matched.
        matches = [hmac.compare_digest(given, key.encode()) for key in self.settings.api_keys]
        if not any(matches):
            raise ApiError(
                401,
                "missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
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

    def model_name(self, model: str | None) -> str:
        """The name a reply gives its model: the request's, or the served model's."""
        return model or self.settings.served_model_name

    async def structured_outputs(self, body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputs | None:
        """The request's output constraint, its grammar compiled (in a thread pool, cached)
        before the request reaches the engine; a RequestError (a 400) if it is invalid."""
        spec = structured_outputs_of(body)
        if spec is not None:
            await self.compile(spec)
        return spec

    async def compile(self, spec: StructuredOutputs) -> None:
        await self.served.grammars.prepare(spec)

    async def answer_constraint(self, spec: StructuredOutputs | None) -> StructuredOutputs | None:
        """A reply's constraint, compiled: with a reasoning parser it holds after the thinking
        (a `grammar` still covers the whole reply: it must describe the thinking itself)."""
        if spec is None:
            return None
        if self.reasoning is not None and spec.grammar is None:
            spec = dataclasses.replace(spec, thinking=self.reasoning.name)
        await self.compile(spec)
        return spec

    def default_max_tokens(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """`max_tokens` as given, or by default what the context leaves after the prompt. The
        engine checks the prompt and the total (request_validation); at least 1 so that a prompt
        that fills the context is refused as too long, not for its max_tokens."""
        if max_tokens is not None:
            return max_tokens
        return max(self.max_model_len - len(prompt_ids), 1)

    # -- engine requests ------------------------------------------------------------------------

    def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str, salt: str | None, lora: LoRARequest | None
    ) -> AsyncIterator[RequestOutput]:
        if self.pooling is not None:
            raise ApiError(
                400,
                "this server pools (--runner pooling): it serves /v1/embeddings, not text generation",
                code="unsupported_runner",
            )
        stream = self.engine.generate(prompt, params, request_id, salt, lora)
        return self._observed(stream, lora.name if lora else None, params.n)

    async def encode(
        self, prompt: list[int], request_id: str, salt: str | None, lora: LoRARequest | None
    ) -> RequestOutput:
        """A prompt pooled into its embedding, observed like a generation (--runner pooling)."""
        stream = self.engine.generate(prompt, SamplingParams(), request_id, salt, lora, pooling=True)
        final = None
        async for output in self._observed(stream, lora.name if lora else None, 1):
            final = output
        if final is None or final.embedding is None:
            raise ApiError(503, "the request was aborted before its prompt was pooled", "service_unavailable")
        return final

    async def _observed(
        self, stream: AsyncIterator[RequestOutput], adapter: str | None, n: int
    ) -> AsyncIterator[RequestOutput]:
        """Counts and logs each request once it finishes, or once its client has gone away (the
        stream closed at a yield, or cancelled while waiting: counted with finish reason `abort`)."""
        model = adapter or self.settings.served_model_name
        last, logged = None, False
        try:
            async for output in stream:
                last = output
                if output.finished:
                    self.metrics.observe(output, adapter)
                    self.request_log.record(output, model)
                    logged = True
                yield output
        except (GeneratorExit, asyncio.CancelledError):
            if not logged:
                self.metrics.observe_abandoned(last, n)
            raise
        finally:
            if last is not None and not logged:
                self.request_log.record(last, model, aborted=True)
