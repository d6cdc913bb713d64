"""Grammars for llguidance from StructuredOutputs, checked against the tokenizer and cached.

`GrammarCompiler.compile` turns a constraint into llguidance's grammar text and validates it
(an invalid schema, regex or grammar raises a RequestError naming it); results are cached by the
constraint, so a repeated schema costs a dictionary lookup. The server compiles in a thread pool
(`compile_async`) before a request reaches the engine, so a slow grammar makes that request wait,
not the batch. `matcher` gives each sequence its own matcher: the state that masks tokens and
advances on each token the sequence emits.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from compiled_engine.engine.sampling_params import StructuredOutputs
from compiled_engine.errors import RequestError

CACHE_SIZE = 512
SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


# After a reasoning parser's thinking: `deepseek_r1` replies start inside it (a leading <think>
# is allowed), `qwen3` replies think only when they start with <think>.
THINKING_STARTS = {
    "deepseek_r1": 'start: "<think>"? thinking answer',
    "qwen3": 'start: "<think>" thinking answer | answer',
}
THINKING = "thinking[lazy]: /(?s:.*)<\\/think>/"


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for `spec` (not yet validated)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    options: Any = COMPACT if spec.disable_any_whitespace else SPACED
    if spec.thinking is not None and spec.grammar is None:
        return str(LLMatcher.grammar_from_lark(after_thinking(spec, options)))
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else '{"type": "object"}'
        try:
            return str(LLMatcher.grammar_from_json_schema(schema, overrides=options))
        except ValueError as error:
            raise RequestError(f"{spec.param}: invalid JSON schema: {error}", param=spec.param) from None
    if spec.regex is not None:
        return str(LLMatcher.grammar_from_regex(spec.regex))
    if spec.choice is not None:
        return str(LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice)))
    assert spec.grammar is not None
    try:
        lark = any_to_lark(spec.grammar)  # GBNF/EBNF to Lark; Lark passes through
    except Exception as error:  # the converter raises plain exceptions on bad input
        raise RequestError(f"{spec.param}: invalid grammar: {error}", param=spec.param) from None
    return str(LLMatcher.grammar_from_lark(lark))


def after_thinking(spec: StructuredOutputs, options: dict[str, Any]) -> str:
    """A Lark grammar: free thinking up to `</think>`, then `spec`'s constraint on the answer."""
    assert spec.thinking is not None
    if spec.json is not None or spec.json_object:
        schema = json.loads(spec.json) if spec.json is not None else {"type": "object"}
        if isinstance(schema, bool):  # JSON schema's `true` (anything) and `false` (nothing)
            schema = {} if schema else {"not": {}}
        answer = "%json " + json.dumps({**schema, "x-guidance": options})
    elif spec.regex is not None:
        answer = "/" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", spec.regex) + "/"
    else:
        assert spec.choice is not None
        answer = " | ".join(json.dumps(c) for c in spec.choice)
    return f"{THINKING_STARTS[spec.thinking]}\n{THINKING}\nanswer: {answer}\n"


class GrammarCompiler:
    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: Iterable[int], workers: int = 2) -> None:
        """`vocab_size`: the width of the model's logits (masks cover exactly that many ids)."""
        from llguidance import LLTokenizer

        eos = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self.tokenizer = LLTokenizer(tokenizer_file.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=eos)
        self._cache: OrderedDict[StructuredOutputs, str | RequestError] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")

    def compile(self, spec: StructuredOutputs) -> str:
        """The validated grammar of `spec` (cached, errors too); a RequestError if it is invalid."""
        with self._lock:
            found = self._cache.get(spec)
            if found is not None:
                self._cache.move_to_end(spec)
        if found is None:
            found = self._build(spec)
            with self._lock:
                self._cache[spec] = found
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(found, RequestError):
            raise found
        return found

    def _build(self, spec: StructuredOutputs) -> str | RequestError:
        from llguidance import LLMatcher

        try:
            grammar = grammar_text(spec)
        except RequestError as error:
            return error
        problem = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem and not problem.startswith("WARNING"):
            what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice"}
            label = what.get(spec.kind, "grammar")
            return RequestError(f"{spec.param}: invalid {label}: {problem.strip()}", param=spec.param)
        return grammar

    async def compile_async(self, spec: StructuredOutputs) -> None:
        """`compile` in the thread pool: the caller waits, the event loop does not."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self.compile, spec)

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, self.compile(spec), log_level=0)
        if matcher.is_error():
            raise RequestError(f"{spec.param}: {matcher.get_error()}", param=spec.param)
        return GrammarMatcher(matcher, self.vocab_size)


class GrammarMatcher:
    """One sequence's position in its grammar: the mask of the tokens allowed next, and the
    advance on each emitted token."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: the tokens that keep the output inside the grammar (the stop tokens
        only where the grammar may end)."""
        bits = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.uint8)
        shifts = torch.arange(8, dtype=torch.uint8)
        return ((bits[:, None] >> shifts) & 1).flatten()[: self.vocab_size].bool()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the start, the grammar would take now (a draft's part)."""
        return int(self._matcher.validate_tokens(tokens)) if tokens else 0

    def try_advance(self, token: int) -> bool:
        """Consume `token` if the grammar takes it; False (and no change) if not."""
        return self.valid_prefix([token]) == 1 and self.advance(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"the grammar could not roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def masks_along(self, draft: list[int]) -> list[torch.Tensor | None]:
        """The allowed tokens at each of a draft's 1 + k verify rows: now, and after each draft
        token in turn (the matcher is rolled back afterwards). Rows after a draft token the
        grammar refuses get None: verification stops at that token, so they are never emitted."""
        masks: list[torch.Tensor | None] = [self.allowed()]
        consumed = 0
        for token in draft:
            if not self.try_advance(token):
                break
            consumed += 1
            masks.append(self.allowed())
        self.rollback(consumed)
        return masks + [None] * (len(draft) + 1 - len(masks))

    def advance(self, token: int) -> bool:
        """Consume an emitted token; False if the grammar refuses it (the mask allowed it not)."""
        return bool(self._matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but the end."""
        return bool(self._matcher.is_stopped())
