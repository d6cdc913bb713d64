"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the same
engine requests as chat completions (the same chat template, tool plan and output constraint),
with Anthropic's errors."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from litestar import Controller, Request, post
from litestar.di import NamedDependency
from litestar.params import Body
from litestar.types import ExceptionHandler

from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import RequestError
from compiled_engine.server.anthropic.protocol import CountTokensRequest, CountTokensResponse, MessagesRequest
from compiled_engine.server.anthropic.replies import (
    message_events,
    message_reply,
    messages_error_handler,
    messages_failure,
)
from compiled_engine.server.anthropic.turns import message_tool_plan, message_turns
from compiled_engine.server.common.engine_streams import event_stream, final_output, unless_disconnected
from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.common.tools import chat_prompt
from compiled_engine.server.serving import Serving

# RequestError too: the app's own handler for it would otherwise win as the more specific class.
MESSAGES_ERRORS: dict[int | type[Exception], ExceptionHandler] = {
    Exception: messages_error_handler,
    RequestError: messages_error_handler,
}


class MessagesController(Controller):
    @post("/v1/messages", status_code=200, exception_handlers=MESSAGES_ERRORS)
    async def messages(
        self,
        request: Request[Any, Any, Any],
        data: Annotated[MessagesRequest, Body()],
        serving: NamedDependency[Serving],
    ) -> Any:
        """Anthropic Messages: the conversation rendered with the model's chat template."""
        salt = serving.check_auth(request)
        lora = serving.check_model(data.model)
        if data.max_tokens < 1:
            raise ApiError(400, f"max_tokens: must be at least 1, got {data.max_tokens}", param="max_tokens")
        plan = message_tool_plan(data.tools, data.tool_choice, serving.tool_parser)
        prompt = chat_prompt(serving.tokenizer, message_turns(data.system, data.messages), plan)
        constraint = await serving.answer_constraint(plan.constraint() if plan is not None else None)
        stop_sequences = data.stop_sequences or []
        params = SamplingParams(
            temperature=data.temperature,
            top_p=data.top_p if data.top_p is not None else 1.0,
            top_k=data.top_k if data.top_k is not None else 0,
            max_tokens=data.max_tokens,
            stop=tuple(stop_sequences),
            structured_outputs=constraint,
        )
        message_id = f"msg_{uuid.uuid4().hex}"
        model = serving.model_name(data.model)
        outputs = serving.generate(prompt, params, message_id, salt, lora)
        if data.stream:
            return await event_stream(
                outputs,
                lambda steps: message_events(message_id, model, steps, plan, stop_sequences, serving.reasoning),
                messages_failure,
            )
        final = await unless_disconnected(request, final_output(outputs))
        return message_reply(message_id, model, final, plan, stop_sequences, serving.reasoning)

    @post("/v1/messages/count_tokens", status_code=200, exception_handlers=MESSAGES_ERRORS)
    async def count_tokens(
        self,
        request: Request[Any, Any, Any],
        data: Annotated[CountTokensRequest, Body()],
        serving: NamedDependency[Serving],
    ) -> CountTokensResponse:
        """The prompt's tokens, as /v1/messages would render it (system, tools and messages)."""
        serving.check_auth(request)
        serving.check_model(data.model)
        plan = message_tool_plan(data.tools, data.tool_choice, serving.tool_parser)
        return CountTokensResponse(len(chat_prompt(serving.tokenizer, message_turns(data.system, data.messages), plan)))
