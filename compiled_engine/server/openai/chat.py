"""`POST /v1/chat/completions`: OpenAI chat completions, with tools."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import Body

from compiled_engine.engine.sampling_params import StructuredOutputs
from compiled_engine.errors import RequestError
from compiled_engine.server.common.engine_streams import event_stream, final_output, unless_disconnected
from compiled_engine.server.common.errors import ApiError, request_error_handler
from compiled_engine.server.common.tools import ToolPlan, chat_prompt, tool_plan
from compiled_engine.server.openai.chat_messages import chat_turns
from compiled_engine.server.openai.chat_replies import chat_events, chat_reply
from compiled_engine.server.openai.frame import ReplyFrame, openai_failure
from compiled_engine.server.openai.protocol import ChatCompletionRequest
from compiled_engine.server.openai.sampling import sampling_params
from compiled_engine.server.serving import Serving

# The engine's names for request fields (RequestError.param) that a chat body calls otherwise.
CHAT_PARAMS = {"prompt": "messages", "logprobs": "top_logprobs"}


class ChatController(Controller):
    @post(
        "/v1/chat/completions",
        status_code=200,
        exception_handlers={RequestError: request_error_handler(CHAT_PARAMS)},
    )
    async def chat_completions(
        self,
        request: Request[Any, Any, Any],
        data: Annotated[ChatCompletionRequest, Body()],
        serving: NamedDependency[Serving],
    ) -> Any:
        """OpenAI chat completions: messages rendered with the model's chat template."""
        salt = serving.check_auth(request)
        lora = serving.check_model(data.model)
        if data.functions is not None:
            raise ApiError(
                400,
                "'functions' is not supported by this server: use tools",
                param="functions",
                code="unsupported_parameter",
            )
        plan = tool_plan(data.tools, data.tool_choice, serving.tool_parser, data.parallel_tool_calls)
        prompt = chat_prompt(serving.tokenizer, chat_turns(data.messages), plan, data.chat_template_kwargs)
        limit = data.max_completion_tokens if data.max_completion_tokens is not None else data.max_tokens
        max_tokens = serving.default_max_tokens(prompt, limit)
        top = data.top_logprobs or 0
        if top and not data.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        structured = await output_constraint(serving, data, plan)
        params = sampling_params(data, max_tokens, top if data.logprobs else None, structured)
        frame = ReplyFrame(f"chatcmpl-{uuid.uuid4().hex}", serving.model_name(data.model), data.stream_options)
        outputs = serving.generate(prompt, params, frame.id, salt, lora)
        if data.stream:
            return await event_stream(
                outputs,
                lambda steps: chat_events(frame, steps, data.n, serving.tokenizer, plan, serving.reasoning),
                openai_failure,
            )
        final = await unless_disconnected(request, final_output(outputs))
        return chat_reply(frame, final, serving.tokenizer, plan, serving.reasoning)


async def output_constraint(
    serving: Serving, data: ChatCompletionRequest, plan: ToolPlan | None
) -> StructuredOutputs | None:
    """The request's own constraint, or the one `tool_choice` puts on the output (never both);
    after the thinking, with a reasoning parser."""
    structured = await serving.structured_outputs(data)
    forced = plan.constraint() if plan is not None else None
    if forced is None:
        return await serving.answer_constraint(structured)
    if structured is not None:
        raise ApiError(
            400,
            f"tool_choice {data.tool_choice!r} constrains the output itself: drop the output constraint",
            param="tool_choice",
        )
    return await serving.answer_constraint(forced)
