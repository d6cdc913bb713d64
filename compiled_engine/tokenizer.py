"""Tokenizer: the `tokenizers` library for text <-> ids, jinja2 for chat templates rendered the way
transformers renders them, and an incremental detokenizer for streaming."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from compiled_engine.errors import TokenizerError

Message = dict[str, Any]
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as strings or as {"content": ...} objects.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template with the environment transformers uses (sandboxed, trim_blocks,
    lstrip_blocks, loop controls, its tojson, raise_exception and strftime_now)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{tokenizer_file} does not exist (only fast tokenizers are supported)")
        try:
            self._tok = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust library raises plain Exception
            raise TokenizerError(f"{tokenizer_file} cannot be loaded: {exc}") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            text = _token_text(config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = self._tok.token_to_id(bos) if bos else None
        add_bos = config.get("add_bos_token")
        self._add_bos: bool | None = add_bos if isinstance(add_bos, bool) else None
        self.chat_template_source = self._chat_template_source(model_dir, config)
        self._chat_template: jinja2.Template | None = None
        self.eos_token_ids = self._eos_token_ids(model_dir)

    @staticmethod
    def _chat_template_source(model_dir: Path, config: dict[str, Any]) -> str | None:
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return template
        jinja_file = model_dir / "chat_template.jinja"
        if not jinja_file.is_file():
            return None
        try:
            return jinja_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise TokenizerError(f"{jinja_file} is not UTF-8 text: {exc}") from exc

    def _eos_token_ids(self, model_dir: Path) -> frozenset[int]:
        # generation_config.json says when generation stops; config.json is the fallback.
        for name in ("generation_config.json", "config.json"):
            ids = _ids(_read_json(model_dir / name).get("eos_token_id"))
            if ids:
                return frozenset(ids)
        eos = self.special_tokens.get("eos_token")
        eos_id = self._tok.token_to_id(eos) if eos else None
        return frozenset() if eos_id is None else frozenset([eos_id])

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def vocab(self) -> dict[str, int]:
        """Every token's text and id, added tokens included."""
        return dict(self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encoding = self._tok.encode(text, add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        if not add_special_tokens or self._add_bos is None or self.bos_token_id is None:
            return ids  # the tokenizer.json post-processor decides
        # Only a BOS the post-processor added counts: one spelled out in `text` is kept as is.
        has_bos = bool(ids) and ids[0] == self.bos_token_id and encoding.special_tokens_mask[0] == 1
        if self._add_bos and not has_bos:
            return [self.bos_token_id, *ids]
        if not self._add_bos and has_bos:
            return ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders tool definitions (`tools`) itself."""
        return self.chat_template_source is not None and "tools" in self.chat_template_source

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """`template_kwargs`: extra variables of the template (such as `enable_thinking`); they
        cannot replace the messages, the tools or the special tokens."""
        extra = dict(template_kwargs or {})
        taken = set(extra) & {"messages", "add_generation_prompt", "tools", "documents", *self.special_tokens}
        if taken:
            raise TokenizerError(f"chat_template_kwargs cannot set {', '.join(sorted(taken))}")
        if self.chat_template_source is None:
            raise TokenizerError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")
        if self._chat_template is None:
            self._chat_template = compile_chat_template(self.chat_template_source)
        try:
            return self._chat_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self.special_tokens,
                **extra,
            )
        except Exception as exc:  # the template's own code can raise anything (TypeError, ...)
            raise TokenizerError(f"chat template failed to render: {exc}") from exc

    def encode_prompt(self, text: str, chat: bool) -> list[int]:
        """`text` as a plain prompt, or as one user message wrapped in the chat template."""
        return self.encode_chat([{"role": "user", "content": text}]) if chat else self.encode(text)

    def encode_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        # The rendered template already holds every special token it wants.
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without ever emitting part of a UTF-8
    character: text that still ends in U+FFFD (an incomplete byte sequence) is held back until
    the next token completes it, or until `flush()` at the end."""

    # Prompt tokens decoded as left context, so that tokenizers whose pieces depend on what
    # precedes them (leading-space handling) start the output correctly.
    CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-self.CONTEXT_TOKENS :]) if prompt_token_ids else []
        if context and tokenizer.decode(context, skip_special_tokens).endswith("\ufffd"):
            # The prompt ends inside a character: its bytes would merge with the output's and
            # the merged character would be lost, so the output is decoded on its own.
            context = []
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """What is still held back (an incomplete character decodes to U+FFFD here)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full_text = decode(self._ids[self._prefix_offset :], self._skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]
