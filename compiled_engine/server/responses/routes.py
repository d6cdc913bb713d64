"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: OpenAI's Responses API over the
same engine requests as chat completions (the same chat template, tool plan and output
constraints), with conversations continued through `previous_response_id` from a bounded store."""

from __future__ import annotations

import functools
import uuid
from typing import Annotated, Any

from litestar import Controller, Request, delete, get, post
from litestar.di import NamedDependency
from litestar.params import Body

from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.server.common.engine_streams import event_stream, final_output, unless_disconnected
from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.common.tools import chat_prompt
from compiled_engine.server.responses.protocol import DeletedResponse, ResponseObject, ResponsesRequest
from compiled_engine.server.responses.replies import ResponseFrame, response_events, response_reply, responses_failure
from compiled_engine.server.responses.turns import input_turns, output_turn, responses_tool_plan, text_format
from compiled_engine.server.serving import Serving


class ResponsesController(Controller):
    @post("/v1/responses", status_code=200)
    async def create(
        self,
        request: Request[Any, Any, Any],
        data: Annotated[ResponsesRequest, Body()],
        serving: NamedDependency[Serving],
    ) -> Any:
        """OpenAI Responses: `input` (and the stored conversation it continues) rendered with the
        model's chat template."""
        salt = serving.check_auth(request)
        lora = serving.check_model(data.model)
        _refuse_unsupported(data)
        plan = responses_tool_plan(data.tools, data.tool_choice, serving.tool_parser, data.parallel_tool_calls)
        history: list[dict[str, Any]] = []
        if data.previous_response_id is not None:
            stored = serving.responses.get(data.previous_response_id, salt)
            if stored is None:
                raise ApiError(
                    404,
                    f"previous_response_id '{data.previous_response_id}' was not found (never stored, deleted, or expired)",
                    "not_found_error",
                    "previous_response_id",
                )
            history = stored.turns
        turns = history + input_turns(data.input)
        system = [{"role": "system", "content": data.instructions}] if data.instructions else []
        prompt = chat_prompt(serving.tokenizer, system + turns, plan)
        constraint = text_format(data.text)
        forced = plan.constraint() if plan is not None else None
        if forced is not None and constraint is not None:
            raise ApiError(400, f"tool_choice {data.tool_choice!r} constrains the output itself: drop text.format")
        constraint = await serving.answer_constraint(forced or constraint)
        temperature = 1.0 if data.temperature is None else data.temperature
        top_p = 1.0 if data.top_p is None else data.top_p
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=serving.default_max_tokens(prompt, data.max_output_tokens),
            structured_outputs=constraint,
        )
        frame = ResponseFrame(
            f"resp_{uuid.uuid4().hex}",
            serving.model_name(data.model),
            {
                "instructions": data.instructions,
                "max_output_tokens": data.max_output_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "tools": data.tools or [],
                "tool_choice": data.tool_choice if data.tool_choice is not None else "auto",
                "parallel_tool_calls": data.parallel_tool_calls,
                "previous_response_id": data.previous_response_id,
                "store": data.store,
                "text": data.text or {"format": {"type": "text"}},
                "metadata": data.metadata or {},
                "user": data.user,
            },
        )

        def keep(response: ResponseObject) -> None:
            if data.store:
                serving.responses.put(response, [*turns, output_turn(response)], salt)

        outputs = serving.generate(prompt, params, frame.id, salt, lora)
        if data.stream:
            return await event_stream(
                outputs,
                lambda steps: response_events(frame, steps, plan, keep, serving.reasoning),
                functools.partial(responses_failure, frame),
            )
        final = await unless_disconnected(request, final_output(outputs))
        response = response_reply(frame, final, plan, serving.reasoning)
        keep(response)
        return response

    @get("/v1/responses/{response_id:str}")
    async def retrieve(
        self, request: Request[Any, Any, Any], response_id: str, serving: NamedDependency[Serving]
    ) -> ResponseObject:
        """A stored response (`store: true`, the default), to the API key that made it."""
        stored = serving.responses.get(response_id, serving.check_auth(request))
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    @delete("/v1/responses/{response_id:str}", status_code=200)
    async def remove(
        self, request: Request[Any, Any, Any], response_id: str, serving: NamedDependency[Serving]
    ) -> DeletedResponse:
        if not serving.responses.delete(response_id, serving.check_auth(request)):
            raise _not_found(response_id)
        return DeletedResponse(response_id)


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response with id '{response_id}'", "not_found_error", code="response_not_found")


def _refuse_unsupported(data: ResponsesRequest) -> None:
    if data.background:
        raise ApiError(400, "background responses are not supported", param="background", code="unsupported_parameter")
    if data.include:
        raise ApiError(400, f"include {data.include} is not supported", param="include", code="unsupported_parameter")
    if data.truncation not in (None, "disabled"):
        raise ApiError(
            400, 'truncation must be "disabled": a conversation that does not fit is refused', param="truncation"
        )
