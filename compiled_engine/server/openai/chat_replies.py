"""Chat completions' replies from the choice deltas: the SSE chunks of a stream, or one body.
With tools, the choices go through the tool-call mapper (common/tools.ToolCallStream) first."""

from __future__ import annotations

from collections.abc import AsyncIterator

from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.server.common.deltas import ChoiceDelta, StepDeltas, whole_choices
from compiled_engine.server.common.engine_streams import DONE, sse
from compiled_engine.server.common.protocol import Usage
from compiled_engine.server.common.reasoning import ReasoningParser, ReasoningStream, whole_split
from compiled_engine.server.common.tools import ToolCallStream, ToolPlan, ToolStep, tool_finish_reason
from compiled_engine.server.openai.frame import ReplyFrame
from compiled_engine.server.openai.logprobs import chat_logprobs, prompt_logprobs
from compiled_engine.server.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    Delta,
    DeltaToolCall,
    ToolCall,
    ToolCallFunction,
)
from compiled_engine.tokenizer import Tokenizer


async def chat_events(
    frame: ReplyFrame,
    steps: AsyncIterator[StepDeltas],
    n: int,
    tokenizer: Tokenizer,
    plan: ToolPlan | None,
    reasoning: ReasoningParser | None = None,
) -> AsyncIterator[bytes]:
    """Each choice's first chunk names the role; then a chunk per step and choice that adds
    something: its thinking (`reasoning_content`, with a reasoning parser), then its answer."""
    for index in range(n):
        yield _chunk(frame, ChatChunkChoice(index, Delta(role="assistant", content=""), None, None))
    tool_calls = ToolCallStream(plan) if plan is not None else None
    thinking = ReasoningStream(reasoning) if reasoning is not None else None
    last: StepDeltas | None = None
    async for step in steps:
        last = step
        usage = frame.running_usage(step)
        for choice in step.choices:
            if thinking is not None:
                thought, choice = thinking.step(choice)
                if thought:
                    yield _chunk(
                        frame, ChatChunkChoice(choice.index, Delta(reasoning_content=thought), None, None), usage
                    )
            if tool_calls is not None:
                chunk = _tool_chunk_choice(choice.index, tool_calls.step(choice))
            else:
                chunk = _chunk_choice(choice, tokenizer)
            if chunk is not None:
                yield _chunk(frame, chunk, usage)
    if last is not None and frame.usage_at_end:
        yield sse(ChatCompletionChunk(frame.id, frame.created, frame.model, [], last.usage))
    yield sse(DONE)


def _chunk(frame: ReplyFrame, choice: ChatChunkChoice, usage: Usage | None = None) -> bytes:
    return sse(ChatCompletionChunk(frame.id, frame.created, frame.model, [choice], usage))


def _chunk_choice(choice: ChoiceDelta, tokenizer: Tokenizer) -> ChatChunkChoice | None:
    logprobs = chat_logprobs(choice.logprobs, tokenizer)
    if not (choice.text or choice.finish_reason or (logprobs and logprobs.content)):
        return None
    return ChatChunkChoice(choice.index, Delta(content=choice.text), logprobs, choice.finish_reason)


def _tool_chunk_choice(index: int, step: ToolStep | None) -> ChatChunkChoice | None:
    if step is None:
        return None
    if not step.calls:
        return ChatChunkChoice(index, Delta(content=step.text), None, step.finish_reason)
    calls = [
        DeltaToolCall(i, call.id, ToolCallFunction(call.name, call.arguments)) for i, call in enumerate(step.calls)
    ]
    return ChatChunkChoice(index, Delta(tool_calls=calls), None, step.finish_reason)


def chat_reply(
    frame: ReplyFrame,
    final: RequestOutput,
    tokenizer: Tokenizer,
    plan: ToolPlan | None,
    reasoning: ReasoningParser | None = None,
) -> ChatCompletionResponse:
    whole = whole_choices(final)
    choices = [_whole_choice(choice, tokenizer, plan, reasoning) for choice in whole.choices]
    return ChatCompletionResponse(
        frame.id,
        frame.created,
        frame.model,
        choices,
        whole.usage,
        prompt_logprobs=prompt_logprobs(final, tokenizer),
    )


def _whole_choice(
    choice: ChoiceDelta, tokenizer: Tokenizer, plan: ToolPlan | None, reasoning: ReasoningParser | None
) -> ChatChoice:
    thought, choice = whole_split(reasoning, choice)
    content, calls = plan.calls(choice.text) if plan is not None else (choice.text, [])
    message = AssistantMessage(content)
    if reasoning is not None:
        message.reasoning_content = thought or None
        message.content = message.content or None  # a reply that only thought has no answer
    reason = choice.finish_reason
    if calls:
        message.tool_calls = [ToolCall(call.id, ToolCallFunction(call.name, call.arguments)) for call in calls]
        reason = tool_finish_reason(reason)
    return ChatChoice(choice.index, message, chat_logprobs(choice.logprobs, tokenizer), reason)
