"""Thinking split from the answer (`serve --reasoning-parser`): the parsers on whole texts and on
streams cut at every point (tags split across tokens included), and a real server answering
through chat completions, Messages and Responses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from compiled_engine.server.common.deltas import ChoiceDelta
from compiled_engine.server.common.reasoning import ReasoningParser, ReasoningStream, Split
from compiled_engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.server_process import ServerProcess, running_server

QWEN3, R1 = ReasoningParser("qwen3"), ReasoningParser("deepseek_r1")


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        (QWEN3, "<think>sum it</think>It is 4.", "sum it", "It is 4."),
        (QWEN3, "It is 4.", "", "It is 4."),  # no thinking
        (QWEN3, "<think>still thinking", "still thinking", ""),  # cut by max_tokens
        (QWEN3, "<think></think>\n\nIt is 4.", "", "\n\nIt is 4."),
        (R1, "sum it</think>It is 4.", "sum it", "It is 4."),  # the template opened the thinking
        (R1, "<think>sum it</think>It is 4.", "sum it", "It is 4."),
        (R1, "still thinking", "still thinking", ""),
        (R1, "a</think>b</think>c", "a", "b</think>c"),  # only the first end tag ends it
    ],
)
def test_a_finished_reply_splits_at_the_first_end_tag(
    parser: ReasoningParser, text: str, reasoning: str, content: str
) -> None:
    assert parser.split(text, finished=True) == Split(reasoning, content)


def _choice(text: str, finished: bool) -> ChoiceDelta:
    return ChoiceDelta(0, "", 0, text, [], None, "stop" if finished else None, None)


def _streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[list[str], list[str]]:
    """The thinking and answer deltas of a choice whose text arrives in `pieces`."""
    stream, thoughts, answers, text = ReasoningStream(parser), [], [], ""
    for i, piece in enumerate(pieces):
        text += piece
        thought, answer = stream.step(_choice(text, i == len(pieces) - 1))
        thoughts.append(thought)
        answers.append(answer.text)
        assert answer.text_so_far == "".join(answers) and answer.text_offset == len("".join(answers[:-1]))
    return thoughts, answers


TEXTS = ["<think>two and two</think>It is 4.", "plain answer", "<think>unfinished", "x</think>y", "<thin", "</thin"]


@pytest.mark.parametrize("parser", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_cut_anywhere_adds_up_to_the_whole_split_and_never_shows_part_of_a_tag(
    parser: ReasoningParser, text: str
) -> None:
    whole = parser.split(text, finished=True)
    for cut in range(1, len(text)):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            thoughts, answers = _streamed(parser, pieces)
            assert "".join(thoughts) == whole.reasoning and "".join(answers) == whole.content
            for shown in thoughts[:-1]:  # while it runs, the thinking never shows a piece of a tag
                assert "<" not in shown


def test_a_tag_the_tokenizer_cuts_in_pieces_is_split_exactly(default_model_dir: Path) -> None:
    tokenizer = Tokenizer(default_model_dir)
    text = "<think>Two plus two is four.</think>The answer is 4."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1  # the tag arrives in pieces
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(token) for token in ids] + [detokenizer.flush()]
    assert "".join(pieces) == text
    for parser, reasoning, content in (
        (QWEN3, "Two plus two is four.", "The answer is 4."),
        (R1, "Two plus two is four.", "The answer is 4."),
    ):
        thoughts, answers = _streamed(parser, pieces)
        assert "".join(thoughts) == reasoning and "".join(answers) == content
        assert all("<" not in piece and ">" not in piece for piece in thoughts + answers)


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        ReasoningParser("o1")


# -- a server with deepseek_r1 -------------------------------------------------------------------

KEY = "reasoning-key"
QUESTION = [{"role": "user", "content": "What is two plus two?"}]
# The model never writes </think> by itself: a grammar (which, unlike the other constraints,
# covers the whole reply) makes this reply think, then answer.
FORCED = r'start: /[a-z]+( [a-z]+){2,5}\./ "</think>The answer is " /[0-9]/ "."'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("reasoning"),
        "--api-key",
        KEY,
        "--reasoning-parser",
        "deepseek_r1",
        "--kv-cache-memory-gib",
        "0.05",
    ) as process:
        yield process


def _raw_text(server: ServerProcess, messages: list[dict[str, Any]], extra: dict[str, Any]) -> str:
    """The reply as /v1/completions gives it for the same prompt: no parser there."""
    headers = {"x-api-key": KEY}
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, headers=headers).json()["tokens"]
    body = {"prompt": ids, "max_tokens": 24, "temperature": 0, **extra}
    text: str = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60).json()["choices"][0][
        "text"
    ]
    return text


def test_chat_gives_reasoning_content_whole_and_streamed(server: ServerProcess) -> None:
    raw = _raw_text(server, QUESTION, {"structured_outputs": {"grammar": FORCED}})
    reasoning, content = raw.split("</think>", 1)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    common: Any = {"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    forced = {"structured_outputs": {"grammar": FORCED}}
    whole = client.chat.completions.create(**common, extra_body=forced)
    message = whole.choices[0].message
    assert message.reasoning_content == reasoning and message.content == content  # type: ignore[attr-defined]
    chunks = list(client.chat.completions.create(**common, stream=True, extra_body=forced))
    thoughts = [getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices]
    answers = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(thoughts) == reasoning and "".join(answers) == content
    last_thought = max(i for i, t in enumerate(thoughts) if t)
    assert all(not a for a in answers[:last_thought])  # the answer starts after the thinking
    # Unconstrained, the model never closes the thinking: all of it is reasoning.
    plain = client.chat.completions.create(**common)
    assert plain.choices[0].message.reasoning_content == _raw_text(server, QUESTION, {})  # type: ignore[attr-defined]
    assert plain.choices[0].message.content is None


def test_messages_give_a_thinking_block_and_responses_a_reasoning_item(server: ServerProcess) -> None:
    raw = _raw_text(server, QUESTION, {})
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    whole = client.messages.create(
        model="SmolLM2-135M-Instruct", max_tokens=24, messages=QUESTION, extra_body={"temperature": 0}
    )  # type: ignore[arg-type]
    assert [block.type for block in whole.content] == ["thinking"]
    assert whole.content[0].thinking == raw  # type: ignore[union-attr]
    with client.messages.stream(
        model="SmolLM2-135M-Instruct",
        max_tokens=24,
        messages=QUESTION,
        extra_body={"temperature": 0},  # type: ignore[arg-type]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "thinking" in kinds and final.content[0].thinking == raw  # type: ignore[union-attr]
    responses = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).responses
    reply = responses.create(model="SmolLM2-135M-Instruct", input=QUESTION, temperature=0, max_output_tokens=24)  # type: ignore[arg-type]
    assert [item.type for item in reply.output] == ["reasoning"]
    assert reply.output[0].content[0].text == raw  # type: ignore[union-attr]
    body = {"input": QUESTION, "temperature": 0, "max_output_tokens": 24, "stream": True}
    events = httpx.post(f"{server.url}/v1/responses", json=body, headers={"x-api-key": KEY}, timeout=60).text
    kinds = [json.loads(line[6:])["type"] for line in events.splitlines() if line.startswith("data: ")]
    assert kinds[2] == "response.output_item.added" and "response.reasoning_text.delta" in kinds
    data = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: ")]
    done = [event for event in data if event["type"] == "response.reasoning_text.done"]
    assert done and done[0]["text"] == raw


def test_chat_template_kwargs_reach_the_template(server: ServerProcess) -> None:
    headers = {"x-api-key": KEY}
    body = {"messages": QUESTION, "max_tokens": 1, "chat_template_kwargs": {"add_generation_prompt": False}}
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers)
    assert refused.status_code == 400 and "cannot set add_generation_prompt" in refused.json()["error"]["message"]
    accepted = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={**body, "chat_template_kwargs": {"enable_thinking": False}},
        headers=headers,
    )
    assert accepted.status_code == 200


# -- output constraints hold after the thinking -------------------------------------------------

PERSON = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(default_model_dir: Path) -> Any:
    from compiled_engine.structured.grammar import GrammarCompiler

    tokenizer = Tokenizer(default_model_dir)
    return GrammarCompiler(default_model_dir / "tokenizer.json", 49152, tokenizer.eos_token_ids), tokenizer


def _takes(compiler: Any, spec: Any, text: str) -> tuple[bool, Any]:
    grammars, tokenizer = compiler
    matcher = grammars.matcher(spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.advance(token) for token in ids), matcher


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_constraint_leaves_the_thinking_free_and_holds_for_the_answer(compiler: Any, parser: str) -> None:
    from compiled_engine.engine.sampling_params import StructuredOutputs

    spec = StructuredOutputs.of({"json": PERSON}, param="response_format")
    thinking = StructuredOutputs(json=spec.json, thinking=parser)
    opened = "<think>" if parser == "qwen3" else ""
    ok, matcher = _takes(compiler, thinking, opened + 'Any words at all, even { or "a".</think>{"a": 12}')
    assert ok and matcher.finished
    assert not _takes(compiler, thinking, opened + "fine.</think>Hello")[0]  # the answer is JSON
    assert not _takes(compiler, spec, "Any words")[0]  # without the parser, all of it is
    ok, matcher = _takes(compiler, thinking, opened + "So")
    assert int(matcher.allowed().sum()) > 40_000  # while it thinks, nearly any token
    if parser == "qwen3":  # a reply that does not think is all answer
        ok, matcher = _takes(compiler, thinking, '{"a": 3}')
        assert ok and matcher.finished
    for other, text in (
        (StructuredOutputs(regex=r"a/b\/c", thinking=parser), "a/b/c"),
        (StructuredOutputs(choice=("yes", "no"), thinking=parser), "no"),
    ):
        ok, matcher = _takes(compiler, other, opened + "hmm</think>" + text)
        assert ok and matcher.finished


def test_the_server_constrains_the_answer_not_the_thinking(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": PERSON}},
    )
    # The model never closes its thinking by itself: all of it is free text, not forced JSON.
    thought = reply.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    assert thought == _raw_text(server, QUESTION, {})[: len(thought)] and not thought.startswith("{")
