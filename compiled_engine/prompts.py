"""Fixed prompts for `verify` and the oracle tests: chat and plain, ASCII and not."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from compiled_engine.errors import RequestError


class PromptSpec(msgspec.Struct, frozen=True):
    text: str
    chat: bool = False


DEFAULT_PROMPTS: tuple[PromptSpec, ...] = (
    PromptSpec("What is the capital of France?", chat=True),
    PromptSpec("Write a short poem about the sea.", chat=True),
    PromptSpec("Explique en deux phrases pourquoi le ciel est bleu.", chat=True),
    PromptSpec("日本の首都はどこですか？", chat=True),  # noqa: RUF001 (real Japanese punctuation)
    PromptSpec("Once upon a time, in a small village by the mountains,"),
    PromptSpec("def fibonacci(n):"),
    PromptSpec("Die wichtigsten Städte Österreichs sind"),
    PromptSpec("The three primary colors are"),
)


def load_prompts(path: Path, chat: bool = False) -> list[PromptSpec]:
    """A .json file holding [{"text": ..., "chat": ...}, ...] or a list of strings, or a text
    file with one prompt per line (blank lines skipped; all chat when `chat`)."""
    if not path.is_file():
        raise RequestError(f"prompts file {path} does not exist")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"prompts file {path} is not UTF-8 text: {exc}") from exc
    if path.suffix == ".json":
        try:
            items = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RequestError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(items, list):
            raise RequestError(f"{path} must hold a JSON list of prompts")
        specs = []
        for i, item in enumerate(items):
            try:
                spec = PromptSpec(item, chat) if isinstance(item, str) else msgspec.convert(item, PromptSpec)
            except msgspec.ValidationError as exc:
                raise RequestError(f"{path}: prompt {i} is invalid: {exc}") from exc
            specs.append(spec)
    else:
        specs = [PromptSpec(line, chat) for line in raw.splitlines() if line.strip()]
    if not specs:
        raise RequestError(f"{path} holds no prompts")
    return specs
