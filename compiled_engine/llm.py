"""LLM: the offline API. Give it prompts, get completions back in input order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import RequestError
from compiled_engine.lora.manager import LoRARequest, per_prompt
from compiled_engine.tokenizer import Message

Prompt = str | list[int]


class LLM:
    """`LLM(model=None, **engine_options)`; None is the embedded default model. The options are
    the fields of EngineConfig (device, dtype, max_num_seqs, max_num_batched_tokens, ...)."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        """`speculative_config` may be a dict, as in vLLM."""
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the adapter every prompt runs with, or one per prompt (None: the base
        model); the engine needs enable_lora."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        loras = per_prompt(lora_request, len(batch))
        request_ids = []
        try:
            for prompt, p, lora in zip(batch, params, loras, strict=True):
                request_ids.append(self.engine.add_request(prompt, p, cache_salt=cache_salt, lora_request=lora))
        except Exception:
            for request_id in request_ids:  # nothing half-submitted stays in the engine
                self.engine.abort_request(request_id)
            self._drain(set(request_ids), use_tqdm=False)
            raise
        return self._drain(set(request_ids), use_tqdm and len(batch) > 1, request_ids)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        if self.engine.tokenizer is None:
            raise RequestError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            self.engine.tokenizer.encode_chat(conversation, add_generation_prompt)  # type: ignore[arg-type]
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _drain(self, pending: set[str], use_tqdm: bool, order: list[str] | None = None) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(pending), desc="requests", unit="req", disable=not use_tqdm)
        try:
            while len(finished) < len(pending):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine lost requests without finishing them")
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in pending - finished.keys():
                self.engine.abort_request(request_id)
            self.engine.step()  # returns the aborted requests' pages
            raise
        finally:
            bar.close()
        return [finished[request_id] for request_id in order or []]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt of token ids
    return items  # the engine refuses an item that is no prompt (request_validation)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params_list = list(params)
    if len(params_list) != count:
        raise RequestError(f"{len(params_list)} sampling params given for {count} prompts")
    return params_list
