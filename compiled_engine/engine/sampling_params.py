"""SamplingParams: how one request chooses its tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

from compiled_engine.engine.structured_outputs import StructuredOutputs
from compiled_engine.errors import RequestError

GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no limit
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the chosen token's)
    # top-N logprobs per prompt token (plus the token's own; the first has none); such a request
    # computes its whole prompt, with no prefix-cache hits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # The output follows this JSON schema, regex, choice or grammar (structured/).
    structured_outputs: StructuredOutputs | None = None
    # (token id, bias) pairs added to the logits before choice, OpenAI's logit_bias (-100..100).
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        # (the field, whether it is valid, why not): the field is the `param` the server reports.
        checks: list[tuple[str, bool, str]] = [
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}"),
            (
                "temperature",
                0 <= self.temperature < math.inf,
                f"temperature must be finite and >= 0, got {self.temperature}",
            ),
            ("top_p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= 0, f"top_k must be -1, 0 (no limit) or positive, got {self.top_k}"),
            ("min_p", 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                "presence_penalty",
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                "frequency_penalty",
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                "repetition_penalty",
                0 < self.repetition_penalty < math.inf,
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}",
            ),
            (
                "stop_token_ids",
                all(t >= 0 for t in self.stop_token_ids),
                f"stop_token_ids must be non-negative, got {self.stop_token_ids}",
            ),
            ("max_tokens", self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (
                "min_tokens",
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            ),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"logprobs must be in [0, 20], got {self.logprobs}",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
            ),
            ("stop", all(s for s in self.stop), "stop strings must not be empty"),
            (
                "logit_bias",
                all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
                "logit_bias maps token ids (>= 0) to biases in [-100, 100]",
            ),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, f"seed must be in [0, 2**63), got {self.seed}"),
        ]
        for field_name, ok, message in checks:
            if not ok:
                raise RequestError(message, param=field_name)

    @property
    def greedy(self) -> bool:
        # Below this, dividing by the temperature overflows logits to ties at +-inf.
        return self.temperature < GREEDY_BELOW
