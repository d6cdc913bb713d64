"""SpeculativeConfig: how the engine proposes tokens to verify, in vLLM's shape.

`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}'` or `'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}'`
on the command line, `LLM(speculative_config={...})` offline. The engine keeps it as that JSON
text (EngineConfig.speculative_config) and reads it once, here.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

METHODS = ("ngram", "draft_model")


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    method: str
    num_speculative_tokens: int = 4  # draft tokens verified per sequence and step, at most
    # ngram: the longest suffix of the sequence, of prompt_lookup_max tokens down to
    # prompt_lookup_min, that occurred before proposes the tokens that followed it.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # draft_model: the draft's directory, GGUF file or Hub id; a smaller model with the target's
    # vocabulary (speculative/draft_model.py).
    model: str | None = None
    # No drafts in a step with more running sequences than this (None: no limit): a big batch
    # already fills the products, and verifying k tokens a sequence then costs k times as much
    # (16 repetitive requests at once ran at 0.72x with drafts on the CPU, docs/benchmarks.md).
    disable_by_batch_size: int | None = 8
    # A sequence whose drafts are accepted less often than this, once it has been offered
    # `acceptance_probe` draft tokens, stops speculating (its drafts cost more than they bring).
    min_acceptance_rate: float = 0.1
    acceptance_probe: int = 32
    # Each sequence's draft length follows its acceptance, as transformers' assisted generation
    # does: two more after a draft accepted whole, one less after a rejection, between 1 and
    # num_speculative_tokens. A verify row is not free (on the CPU each costs about a quarter of
    # a one-token step), so rows that would mostly be rejected are not drafted. False: always
    # num_speculative_tokens.
    adaptive_draft_length: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported (yet); the methods are {', '.join(METHODS)}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('the draft_model method needs "model": the draft model\'s directory or GGUF file')
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f'"model" is for the draft_model method, not {self.method!r}')
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                f"and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")
        if not 0 <= self.min_acceptance_rate <= 1:
            raise ValueError(f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}")

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From the JSON text of `--speculative-config` or a dict; a ValueError names what is wrong."""
        try:
            data = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative_config is not JSON: {error}") from None
        if not isinstance(data, dict):
            raise ValueError("speculative_config must be a JSON object")
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as error:
            raise ValueError(f"speculative_config: {error}") from None
