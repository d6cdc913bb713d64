"""`POST /v1/embeddings`: OpenAI embeddings from a pooling server (`serve --runner pooling`)."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import uuid
from typing import Annotated, Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import Body

from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.server.common.engine_streams import unless_disconnected
from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.openai.protocol import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from compiled_engine.server.serving import Serving
from compiled_engine.tokenizer import Tokenizer

MAX_INPUTS = 2048  # OpenAI's limit on a batch


class EmbeddingsController(Controller):
    @post("/v1/embeddings", status_code=200)
    async def embeddings(
        self,
        request: Request[Any, Any, Any],
        data: Annotated[EmbeddingRequest, Body()],
        serving: NamedDependency[Serving],
    ) -> EmbeddingResponse:
        """Each input pooled into one embedding; a batch runs concurrently, like any requests."""
        salt = serving.check_auth(request)
        lora = serving.check_model(data.model)
        if serving.pooling is None:
            raise ApiError(
                400,
                "this server generates text: start it with --runner pooling to serve embeddings",
                code="unsupported_runner",
            )
        if data.encoding_format not in ("float", "base64"):
            raise ApiError(
                400,
                f'encoding_format must be "float" or "base64", got {data.encoding_format!r}',
                param="encoding_format",
            )
        prompts = embedding_prompts(data.input, serving.tokenizer)
        width = serving.served.model_config.hidden_size
        if data.dimensions is not None and not 1 <= data.dimensions <= width:
            raise ApiError(400, f"dimensions must be in [1, {width}], got {data.dimensions}", param="dimensions")
        base = f"embd-{uuid.uuid4().hex}"
        tasks = [asyncio.ensure_future(serving.encode(p, f"{base}-{i}", salt, lora)) for i, p in enumerate(prompts)]
        try:
            finals = await unless_disconnected(request, _all(tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        items = []
        for index, final in enumerate(finals):
            assert final.embedding is not None
            vector = _truncated(final.embedding, data.dimensions, serving.pooling.normalize)
            items.append(Embedding(index, _encoded(vector) if data.encoding_format == "base64" else vector))
        tokens = sum(len(p) for p in prompts)
        return EmbeddingResponse(items, serving.model_name(data.model), EmbeddingUsage(tokens, tokens))


async def _all(tasks: list[asyncio.Task[RequestOutput]]) -> list[RequestOutput]:
    return list(await asyncio.gather(*tasks))


def embedding_prompts(value: str | list[Any], tokenizer: Tokenizer) -> list[list[int]]:
    """The inputs as token ids: a string, token ids, or a list of strings or token-id lists."""
    if isinstance(value, str):
        return [tokenizer.encode(value)]
    if not value:
        raise ApiError(400, "input must not be empty", param="input")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return [list(value)]
    if len(value) > MAX_INPUTS:
        raise ApiError(400, f"input holds {len(value)} items: at most {MAX_INPUTS}", param="input")
    prompts = []
    for item in value:
        if isinstance(item, str):
            prompts.append(tokenizer.encode(item))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            prompts.append(list(item))
        else:
            raise ApiError(
                400, "input must be a string, token ids, or a list of strings or of token-id lists", param="input"
            )
    return prompts


def _truncated(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` values, renormalized when the model's embeddings are normalized."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    kept = vector[:dimensions]
    if not normalize:
        return kept
    norm = math.sqrt(sum(v * v for v in kept)) or 1.0
    return [v / norm for v in kept]


def _encoded(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
