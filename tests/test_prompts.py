"""load_prompts: the prompt files of `verify`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from compiled_engine.errors import RequestError
from compiled_engine.prompts import DEFAULT_PROMPTS, PromptSpec, load_prompts


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def test_json_list_of_objects(tmp_path: Path) -> None:
    items = [
        {"text": "What is 2+2?", "chat": True},
        {"text": "Once upon a time"},
        {"text": "日本語 🙂", "chat": False, "ignored_field": 1},
    ]
    path = write(tmp_path, "p.json", json.dumps(items, ensure_ascii=False))
    assert load_prompts(path) == [
        PromptSpec("What is 2+2?", chat=True),
        PromptSpec("Once upon a time", chat=False),
        PromptSpec("日本語 🙂", chat=False),
    ]
    # Objects carry their own chat flag; the argument does not override it.
    assert [s.chat for s in load_prompts(path, chat=True)] == [True, False, False]


def test_json_list_of_strings(tmp_path: Path) -> None:
    path = write(tmp_path, "p.json", json.dumps(["first", "  second  ", "trois"]))
    assert load_prompts(path) == [
        PromptSpec("first"),
        PromptSpec("  second  "),
        PromptSpec("trois"),
    ]
    assert load_prompts(path, chat=True) == [
        PromptSpec("first", True),
        PromptSpec("  second  ", True),
        PromptSpec("trois", True),
    ]


def test_json_mixed_strings_and_objects(tmp_path: Path) -> None:
    path = write(tmp_path, "p.json", json.dumps(["plain", {"text": "chat", "chat": True}]))
    assert load_prompts(path, chat=True) == [PromptSpec("plain", True), PromptSpec("chat", True)]
    assert load_prompts(path) == [PromptSpec("plain", False), PromptSpec("chat", True)]


@pytest.mark.parametrize("name", ["p.txt", "prompts", "p.md"])
def test_text_file_one_prompt_per_line(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, name, "first line\n\n   \nsecond, with  spaces \r\nÖsterreich 日本\n")
    assert load_prompts(path) == [
        PromptSpec("first line"),
        PromptSpec("second, with  spaces "),
        PromptSpec("Österreich 日本"),
    ]
    assert all(s.chat for s in load_prompts(path, chat=True))


def test_text_file_with_json_looking_lines_is_text(tmp_path: Path) -> None:
    path = write(tmp_path, "p.txt", '["not", "parsed"]\n')
    assert load_prompts(path) == [PromptSpec('["not", "parsed"]')]


def test_default_prompts_are_well_formed() -> None:
    assert len(DEFAULT_PROMPTS) >= 4
    assert any(p.chat for p in DEFAULT_PROMPTS) and any(not p.chat for p in DEFAULT_PROMPTS)
    assert any(not p.text.isascii() for p in DEFAULT_PROMPTS)
    assert all(p.text.strip() for p in DEFAULT_PROMPTS)


def test_prompt_spec_is_frozen() -> None:
    spec = PromptSpec("x")
    with pytest.raises(AttributeError):
        spec.text = "y"  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# errors


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(RequestError, match=rf"^prompts file {re.escape(str(path))} does not exist$"):
        load_prompts(path)
    with pytest.raises(RequestError, match="does not exist"):
        load_prompts(tmp_path)  # a directory is not a prompts file


@pytest.mark.parametrize("content", ["[1, 2", "{'single': 'quotes'}", "", "not json"])
def test_bad_json(tmp_path: Path, content: str) -> None:
    path = write(tmp_path, "p.json", content)
    with pytest.raises(RequestError, match=rf"^{re.escape(str(path))} is not valid JSON: "):
        load_prompts(path)


@pytest.mark.parametrize("content", ['{"text": "x"}', '"just a string"', "42", "null"])
def test_json_not_a_list(tmp_path: Path, content: str) -> None:
    path = write(tmp_path, "p.json", content)
    with pytest.raises(RequestError, match=rf"^{re.escape(str(path))} must hold a JSON list of prompts$"):
        load_prompts(path)


@pytest.mark.parametrize(
    ("items", "index", "detail"),
    [
        ([{"text": "ok"}, {"chat": True}], 1, "Object missing required field `text`"),
        ([42], 0, "Expected `object`, got `int`"),
        (["ok", None], 1, "Expected `object`, got `null`"),
        ([{"text": 5}], 0, r"Expected `str`, got `int` - at `\$.text`"),
        ([{"text": "x", "chat": "yes"}], 0, r"Expected `bool`, got `str` - at `\$.chat`"),
        (["a", "b", ["nested"]], 2, "Expected `object`, got `array`"),
    ],
)
def test_invalid_item(tmp_path: Path, items: list[object], index: int, detail: str) -> None:
    path = write(tmp_path, "p.json", json.dumps(items))
    with pytest.raises(RequestError, match=rf"^{re.escape(str(path))}: prompt {index} is invalid: {detail}"):
        load_prompts(path)


@pytest.mark.parametrize(("name", "content"), [("p.json", "[]"), ("p.txt", ""), ("p.txt", "\n  \n\t\n")])
def test_empty(tmp_path: Path, name: str, content: str) -> None:
    path = write(tmp_path, name, content)
    with pytest.raises(RequestError, match=rf"^{re.escape(str(path))} holds no prompts$"):
        load_prompts(path)


@pytest.mark.parametrize("name", ["p.json", "p.txt"])
def test_not_utf8(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, name, b"\xff\xfe prompt \x80\n")
    with pytest.raises(RequestError, match=rf"^prompts file {re.escape(str(path))} is not UTF-8 text: "):
        load_prompts(path)
