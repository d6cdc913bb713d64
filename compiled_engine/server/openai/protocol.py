"""OpenAI wire types as msgspec Structs: what the server accepts and what it answers."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from compiled_engine.server.common.protocol import Request, Usage


class StreamOptions(Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far in every chunk


class SamplingRequest(Request, kw_only=True):
    """The sampling fields both generation routes share."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension
    min_p: float = 0.0  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension
    min_tokens: int = 0  # extension
    ignore_eos: bool = False  # extension
    user: str | None = None
    # Structured outputs (structured/): OpenAI's response_format, vLLM's structured_outputs, and
    # vLLM's older guided_* fields (aliases); at most one of them in a request.
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    prompt_logprobs: int | None = None  # vLLM: top-N logprobs of each prompt token (not streamed)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # The routers put in front of vLLM-compatible servers (vllm-router, sglang-router) add these
    # to every body they forward, at these values: what this server does. Any other value is
    # refused as unsupported (sampling.py, ROUTER_FIELDS).
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    return_hidden_states: bool = False


class CompletionRequest(SamplingRequest, kw_only=True):
    # One prompt (text or token ids) or a batch of them; msgspec allows one list type per union.
    prompt: str | list[int | str | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ContentPart(Request):
    type: str
    text: str | UnsetType = UNSET


class ChatMessage(Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, sent back
    tool_call_id: str | None = None  # a tool turn: the call it answers


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Added by the routers too (above); the reasoning split is `serve --reasoning-parser`'s.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    continue_final_message: bool = False
    # Accepted so that the error can name them; any value is refused as unsupported.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # False: at most one call is returned
    functions: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template


# -- responses ---------------------------------------------------------------------------------


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # vLLM's: per prompt token, by token id


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ToolCallFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct):
    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET
    reasoning_content: str | UnsetType | None = UNSET  # with `serve --reasoning-parser`: the thinking


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class DeltaToolCall(msgspec.Struct):
    index: int
    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class TokenizeRequest(Request, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Request, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "compiled_engine"
    max_model_len: int | None = None
    root: str | None = None  # an adapter's directory; the base model's name for the base model
    parent: str | None = None  # an adapter's base model
    object: Literal["model"] = "model"


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class EmbeddingRequest(Request, kw_only=True):
    model: str | None = None
    input: str | list[Any]  # a string, token ids, or a list of strings or of token-id lists
    encoding_format: str = "float"  # "float" or "base64" (little-endian float32)
    dimensions: int | None = None  # keep the first N values (Matryoshka), renormalized
    user: str | None = None


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"
