"""SamplingParams: how one request chooses its tokens and when it stops; StructuredOutputs: the
constraint it may put on its output, as vLLM's `structured_outputs`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from compiled_engine.errors import RequestError

GREEDY_BELOW = 1e-5
PARAM = "structured_outputs"


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of a JSON schema, a regex, a choice of strings, a grammar (Lark, or GBNF/EBNF as
    llama.cpp writes it) or "any JSON object". Plain, hashable data: the grammar cache is keyed by it."""

    json: str | None = None  # a JSON schema as JSON text (`of` turns a dict into that)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    # JSON without any whitespace at all; otherwise the separators are ", " and ": ", and no other
    # whitespace is allowed either (small models loop on free whitespace until max_tokens).
    disable_any_whitespace: bool = False
    # With a reasoning parser (server/reasoning.py): its name; the reply may think freely until
    # `</think>` and the constraint holds for the answer after it (a `grammar` covers it all).
    thinking: str | None = None
    param: str = PARAM  # the request field it came from, for error messages

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(given) != 1:
            found = ", ".join(given) or "none"
            raise RequestError(
                f"{self.param} needs exactly one of json, regex, choice, grammar, json_object (got {found})",
                param=self.param,
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise RequestError(f"{self.param}.choice must be a list of non-empty strings", param=self.param)

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @classmethod
    def of(cls, value: dict[str, Any], param: str = PARAM) -> StructuredOutputs:
        """From a request's JSON object; a RequestError names what is wrong."""
        if not isinstance(value, dict):
            raise RequestError(f"{param} must be a JSON object", param=param)
        known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise RequestError(f"{param} has unsupported fields: {', '.join(unknown)}", param=param)
        schema = value.get("json")
        if schema is not None and not isinstance(schema, str | dict | bool):
            raise RequestError(f"{param}.json must be a JSON schema (an object)", param=param)
        if isinstance(schema, dict | bool):
            schema = json.dumps(schema, sort_keys=True)
        choice = value.get("choice")
        if choice is not None and not isinstance(choice, list):
            raise RequestError(f"{param}.choice must be a list of strings", param=param)
        for name in ("regex", "grammar"):
            if value.get(name) is not None and not isinstance(value[name], str):
                raise RequestError(f"{param}.{name} must be a string", param=param)
        return cls(
            json=schema,
            regex=value.get("regex"),
            choice=None if choice is None else tuple(choice),
            grammar=value.get("grammar"),
            json_object=bool(value.get("json_object", False)),
            disable_any_whitespace=bool(value.get("disable_any_whitespace", False)),
            param=param,
        )


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
