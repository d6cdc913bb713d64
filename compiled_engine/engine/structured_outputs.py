"""StructuredOutputs: the constraint a request puts on its output, as vLLM's `structured_outputs`.

Exactly one of a JSON schema, a regex, a choice of strings, a grammar (Lark, or GBNF/EBNF as
llama.cpp writes it) or "any JSON object". Plain, hashable data: the grammar cache is keyed by it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from compiled_engine.errors import RequestError

PARAM = "structured_outputs"


@dataclass(frozen=True)
class StructuredOutputs:
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
