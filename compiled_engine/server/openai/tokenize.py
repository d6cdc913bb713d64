"""vLLM's `POST /tokenize` and `POST /detokenize`."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import Body

from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.common.tools import render_turns
from compiled_engine.server.openai.chat_messages import chat_turns
from compiled_engine.server.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from compiled_engine.server.serving import Serving

# Two controllers so that the schema lists /tokenize first (a controller orders its routes by name).


class TokenizeController(Controller):
    @post("/tokenize", status_code=200)
    async def tokenize(
        self,
        request: Request[Any, Any, Any],
        data: Annotated[TokenizeRequest, Body()],
        serving: NamedDependency[Serving],
    ) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt's token ids, or chat messages' through the chat template."""
        serving.check_auth(request)
        serving.check_model(data.model)
        if (data.prompt is None) == (data.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        tokenizer = serving.tokenizer
        if data.prompt is not None:
            tokens = tokenizer.encode(data.prompt, add_special_tokens=data.add_special_tokens)
        else:
            turns = render_turns(chat_turns(data.messages or []), None, tokenizer.template_takes_tools)
            tokens = tokenizer.encode_chat(turns, data.add_generation_prompt)
        return TokenizeResponse(len(tokens), serving.max_model_len, list(tokens))


class DetokenizeController(Controller):
    @post("/detokenize", status_code=200)
    async def detokenize(
        self,
        request: Request[Any, Any, Any],
        data: Annotated[DetokenizeRequest, Body()],
        serving: NamedDependency[Serving],
    ) -> DetokenizeResponse:
        """vLLM's /detokenize: token ids back to text (special tokens kept)."""
        serving.check_auth(request)
        serving.check_model(data.model)
        vocab = serving.served.model_config.vocab_size
        bad = [token for token in data.tokens if not 0 <= token < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return DetokenizeResponse(serving.tokenizer.decode(data.tokens, skip_special_tokens=False))
