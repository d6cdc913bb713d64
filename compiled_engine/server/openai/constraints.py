"""The request fields that constrain the output, turned into one StructuredOutputs.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs`
object, and vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
(aliases of the same constraints, never ignored). A request may use one of them; anything else
is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from compiled_engine.engine.sampling_params import StructuredOutputs
from compiled_engine.errors import RequestError
from compiled_engine.server.openai.protocol import ChatCompletionRequest, CompletionRequest

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_of(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputs | None:
    """The request's constraint, or None; a RequestError names a bad or conflicting field."""
    found: list[StructuredOutputs] = []
    names: list[str] = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            found.append(spec)
            names.append("response_format")
    if body.structured_outputs is not None:
        found.append(StructuredOutputs.of(body.structured_outputs))
        names.append("structured_outputs")
    for field, kind in GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            found.append(StructuredOutputs.of({kind: value}, param=field))
            names.append(field)
    if len(found) > 1:
        raise RequestError(f"use one way to constrain the output, not {' and '.join(names)}", param=names[1])
    return found[0] if found else None


def _response_format(value: dict[str, Any]) -> StructuredOutputs | None:
    param = "response_format"
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param=param)
    if kind == "json_schema":
        described = value.get("json_schema")
        if not isinstance(described, dict) or not isinstance(described.get("schema"), dict | bool):
            raise RequestError(
                'response_format type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}', param=param
            )
        return StructuredOutputs.of({"json": described["schema"]}, param=param)
    raise RequestError(
        f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}', param=param
    )
