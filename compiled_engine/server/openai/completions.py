"""`POST /v1/completions`: OpenAI text completions."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import Body

from compiled_engine.server.common.engine_streams import event_stream, final_outputs, unless_disconnected
from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.openai.completion_replies import completion_events, completion_reply
from compiled_engine.server.openai.frame import ReplyFrame, openai_failure
from compiled_engine.server.openai.protocol import CompletionRequest
from compiled_engine.server.openai.sampling import sampling_params
from compiled_engine.server.serving import Serving
from compiled_engine.tokenizer import Tokenizer


class CompletionsController(Controller):
    @post("/v1/completions", status_code=200)
    async def completions(
        self,
        request: Request[Any, Any, Any],
        data: Annotated[CompletionRequest, Body()],
        serving: NamedDependency[Serving],
    ) -> Any:
        """OpenAI text completions (prompt as text, token ids, or a list of either)."""
        salt = serving.check_auth(request)
        lora = serving.check_model(data.model)
        prompts = completion_prompts(data, serving.tokenizer)
        if data.stream and len(prompts) > 1:
            raise ApiError(400, "streaming supports one prompt per request", param="prompt")
        structured = await serving.structured_outputs(data)
        params = [
            sampling_params(data, serving.default_max_tokens(p, data.max_tokens), data.logprobs, structured)
            for p in prompts
        ]
        frame = ReplyFrame(f"cmpl-{uuid.uuid4().hex}", serving.model_name(data.model), data.stream_options)
        if data.stream:
            return await event_stream(
                serving.generate(prompts[0], params[0], frame.id, salt, lora),
                lambda steps: completion_events(frame, steps, data.echo, serving.tokenizer),
                openai_failure,
            )
        # A batch of prompts runs concurrently, like any other set of requests.
        streams = [
            serving.generate(prompt, p, f"{frame.id}-{i}", salt, lora)
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        ]
        finals = await unless_disconnected(request, final_outputs(streams))
        return completion_reply(frame, prompts, finals, data.n, data.echo, serving.tokenizer)


def completion_prompts(body: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """The request's prompts as token ids: one text, one list of ids, or a batch of either."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if all(isinstance(t, int) for t in prompt):  # one prompt of token ids (or [], refused as empty)
        return [[t for t in prompt if isinstance(t, int)]]
    prompts: list[list[int]] = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(tokenizer.encode(item))
        elif isinstance(item, list):
            prompts.append(list(item))
        else:
            raise ApiError(400, "prompt must be a string, a list of token ids, or a list of either", param="prompt")
    return prompts
