"""A generation request's sampling fields, checked, as the engine's SamplingParams."""

from __future__ import annotations

from compiled_engine.engine.sampling_params import SamplingParams, StructuredOutputs
from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.openai.protocol import ChatCompletionRequest, CompletionRequest

MAX_N = 16  # completions per request

# The fields routers add to what they forward (protocol.py), each with the one value served.
ROUTER_FIELDS = {
    "skip_special_tokens": True,
    "no_stop_trim": False,
    "return_hidden_states": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "include_reasoning": True,
    "continue_final_message": False,
}


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    structured: StructuredOutputs | None = None,
) -> SamplingParams:
    """The checks here are the server's own (the wire's names and limits); SamplingParams checks
    the values themselves."""
    if body.n > MAX_N:
        raise ApiError(400, f"n must be at most {MAX_N}, got {body.n}", param="n")
    for name, served in ROUTER_FIELDS.items():
        if getattr(body, name, served) != served:
            raise ApiError(400, f"{name}: only {str(served).lower()} is supported", param=name)
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
