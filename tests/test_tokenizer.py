"""Tokenizer, chat templates and the incremental detokenizer, checked against transformers on the
prepared SmolLM2 directory and against hand-built model directories for every config path."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer

from compiled_engine.errors import TokenizerError
from compiled_engine.tokenizer import IncrementalDetokenizer, Tokenizer, compile_chat_template

BOS_ID, EOS_ID, UNK_ID = 1, 2, 0  # <|im_start|>, <|im_end|>, <|endoftext|> in SmolLM2's vocabulary

HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def hf_tok(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def byte_token_ids(default_model_dir: Path) -> list[int]:
    """The 256 base tokens of the byte-level vocabulary (one byte each), which is where
    incomplete UTF-8 sequences come from."""
    vocab = RawTokenizer.from_file(str(default_model_dir / "tokenizer.json")).get_vocab(with_added_tokens=False)
    ids = sorted(i for token, i in vocab.items() if len(token) == 1)
    # The GGUF-built vocabulary lacks 21 of the 256 (bytes that never occur in UTF-8 text,
    # and a few control characters).
    assert 200 < len(ids) <= 256
    return ids


@pytest.fixture
def make_dir(tmp_path: Path, default_model_dir: Path) -> Callable[..., Path]:
    """A model directory holding the real tokenizer.json plus the given JSON/text files."""
    counter = iter(range(1000))

    def make(tokenizer_json: bool = True, **files: Any) -> Path:
        d = tmp_path / f"model{next(counter)}"
        d.mkdir()
        if tokenizer_json:
            shutil.copy(default_model_dir / "tokenizer.json", d / "tokenizer.json")
        for stem, content in files.items():
            name = "chat_template.jinja" if stem == "chat_template_jinja" else f"{stem}.json"
            if isinstance(content, bytes):
                (d / name).write_bytes(content)
            elif isinstance(content, str):
                (d / name).write_text(content, encoding="utf-8")
            else:
                (d / name).write_text(json.dumps(content), encoding="utf-8")
        return d

    return make


def hf_encode_chat(hf_tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    out = hf_tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    return list(out)


# ---------------------------------------------------------------------------------------------
# encode / decode against transformers

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé Ångström Žluťoučký",
    "日本の首都はどこですか\uff1f",
    "中文测试\uff0c한국어 텍스트",
    "🙂👍🏽 family: 👨‍👩‍👧‍👦 flags 🇫🇷",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\t\tand\nnewlines\n\n\nand  \u3000 ideographic space",
    "\n",
    " ",
    "",
    "def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nhi<|im_end|>",
    "numbers 1234567890 3.14159",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)


@given(text=st.text(max_size=40))
@HYPOTHESIS
def test_encode_matches_transformers_on_random_text(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text)


@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t])
def test_decode_round_trips_and_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf_tok.decode(ids, clean_up_tokenization_spaces=False)


def test_decode_skips_special_tokens_only_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == BOS_ID and EOS_ID in ids
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_default_model_special_tokens(tok: Tokenizer, hf_tok: Any) -> None:
    assert tok.bos_token_id == BOS_ID == hf_tok.bos_token_id
    assert tok.eos_token_ids == frozenset({EOS_ID})
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.special_tokens["unk_token"] == "<|endoftext|>"
    assert tok.vocab_size == len(hf_tok) == 49152
    # SmolLM2's config has no add_bos_token: the post-processor adds nothing.
    assert tok.encode("Hello")[0] != BOS_ID


# ---------------------------------------------------------------------------------------------
# chat templates against transformers

CHATS: dict[str, list[dict[str, str]]] = {
    "single_user": [{"role": "user", "content": "What is the capital of France?"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
    "non_ascii": [{"role": "user", "content": "日本の首都はどこですか\uff1f 🙂 café"}],
    "empty_content": [{"role": "user", "content": ""}],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CHATS))
def test_encode_chat_matches_transformers(tok: Tokenizer, hf_tok: Any, name: str, add_generation_prompt: bool) -> None:
    messages = CHATS[name]
    ours = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_encode_chat(hf_tok, messages, add_generation_prompt)
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def test_encode_chat_generation_prompt_is_the_difference(tok: Tokenizer) -> None:
    messages = CHATS["single_user"]
    with_prompt = tok.encode_chat(messages, add_generation_prompt=True)
    without = tok.encode_chat(messages, add_generation_prompt=False)
    assert with_prompt[: len(without)] == without
    assert tok.decode(with_prompt[len(without) :], skip_special_tokens=False) == "<|im_start|>assistant\n"
    # The default system prompt is injected only when no system message is given.
    assert "SmolLM" in tok.apply_chat_template(messages)
    assert "SmolLM" not in tok.apply_chat_template(CHATS["system_user"])


# A template exercising what transformers' environment provides: trim/lstrip blocks, loop
# controls, its tojson (non-ASCII kept, sort_keys, indent), special token variables, namespace.
FANCY_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'stop' %}{% break %}{% endif %}
    {% if message['role'] == 'skip' %}{% continue %}{% endif %}
[{{ loop.index }}] {{ message['role'] }}: {{ message['content'] | tojson }}
    {{ message | tojson(sort_keys=True) }}
{% endfor %}
{{ {'b': 'é', 'a': [1, 2]} | tojson(indent=2) }}
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}{{ eos_token }}"""


def test_template_environment_matches_transformers(make_dir: Callable[..., Path]) -> None:
    from transformers import AutoTokenizer

    d = make_dir(
        tokenizer_config={
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "chat_template": FANCY_TEMPLATE,
        }
    )
    hf = AutoTokenizer.from_pretrained(d, local_files_only=True)
    ours = Tokenizer(d)
    messages = [
        {"role": "user", "content": 'quote " and ünïcödé 日本'},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "ok"},
        {"role": "stop", "content": "x"},
        {"role": "user", "content": "never shown"},
    ]
    for agp in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=agp)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=agp, tokenize=False)
        assert ours.encode_chat(messages, add_generation_prompt=agp) == hf_encode_chat(hf, messages, agp)
    text = ours.apply_chat_template(messages)
    assert "hidden" not in text and "never shown" not in text
    # tojson keeps non-ASCII as is (ensure_ascii=False) and escapes the quote.
    assert '"quote \\" and ünïcödé 日本"' in text and "\\u00fc" not in text
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n<|im_end|>")


def test_strftime_now_is_available() -> None:
    import datetime

    rendered = compile_chat_template("{{ strftime_now('%Y') }}").render()
    assert rendered in {str(datetime.datetime.now().year), str(datetime.datetime.now().year - 1)}


def test_chat_template_jinja_used_when_config_has_none(make_dir: Callable[..., Path]) -> None:
    d = make_dir(
        tokenizer_config={"eos_token": "<|im_end|>"},
        chat_template_jinja="J:{{ messages[0]['content'] }}",
    )
    t = Tokenizer(d)
    assert t.chat_template_source == "J:{{ messages[0]['content'] }}"
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "J:hi"


def test_config_template_preferred_over_jinja_file(make_dir: Callable[..., Path]) -> None:
    d = make_dir(tokenizer_config={"chat_template": "C:{{ messages|length }}"}, chat_template_jinja="J")
    assert Tokenizer(d).apply_chat_template([{"role": "user", "content": "x"}]) == "C:1"


def test_chat_template_jinja_without_tokenizer_config(make_dir: Callable[..., Path]) -> None:
    d = make_dir(chat_template_jinja="only jinja")
    t = Tokenizer(d)
    assert t.apply_chat_template([]) == "only jinja"
    assert t.special_tokens == {} and t.bos_token_id is None


def test_named_template_list_uses_default(make_dir: Callable[..., Path]) -> None:
    named = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT:{{ messages[0]['content'] }}"},
    ]
    t = Tokenizer(make_dir(tokenizer_config={"chat_template": named}))
    assert t.chat_template_source == "DEFAULT:{{ messages[0]['content'] }}"
    assert t.encode_chat([{"role": "user", "content": "hey"}]) == t.encode("DEFAULT:hey", add_special_tokens=False)


def test_named_template_list_without_default_falls_back_to_jinja(
    make_dir: Callable[..., Path],
) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}]
    assert (
        Tokenizer(make_dir(tokenizer_config={"chat_template": named}, chat_template_jinja="J")).chat_template_source
        == "J"
    )
    t = Tokenizer(make_dir(tokenizer_config={"chat_template": named}))
    assert t.chat_template_source is None
    with pytest.raises(TokenizerError, match="this model has no chat template"):
        t.encode_chat([{"role": "user", "content": "x"}])


def test_chat_template_special_tokens_are_not_re_added(make_dir: Callable[..., Path]) -> None:
    # The rendered text carries its own BOS; encode_chat must not add a second one even when
    # the config asks for BOS on plain encodes.
    d = make_dir(
        tokenizer_config={
            "bos_token": "<|im_start|>",
            "add_bos_token": True,
            "chat_template": "{{ bos_token }}hi",
        }
    )
    t = Tokenizer(d)
    assert t.encode_chat([]) == [BOS_ID, *t.encode("hi", add_special_tokens=False)]
    assert t.encode("hi") == [BOS_ID, *t.encode("hi", add_special_tokens=False)]


# ---------------------------------------------------------------------------------------------
# BOS handling


def _bos_config(add_bos: bool | None, bos: Any = "<|im_start|>") -> dict[str, Any]:
    config: dict[str, Any] = {"bos_token": bos, "eos_token": "<|im_end|>"}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    return config


def test_add_bos_token_true_prepends_bos(make_dir: Callable[..., Path]) -> None:
    t = Tokenizer(make_dir(tokenizer_config=_bos_config(True)))
    plain = t.encode("Hello world", add_special_tokens=False)
    assert BOS_ID not in plain
    assert t.encode("Hello world") == [BOS_ID, *plain]
    assert t.encode("") == [BOS_ID]
    assert t.encode("Hello world", add_special_tokens=False) == plain


def test_add_bos_token_dict_spelling(make_dir: Callable[..., Path]) -> None:
    config = _bos_config(True, bos={"content": "<|im_start|>", "special": True})
    t = Tokenizer(make_dir(tokenizer_config=config))
    assert t.bos_token_id == BOS_ID
    assert t.encode("x")[0] == BOS_ID


@pytest.mark.parametrize("add_bos", [False, None])
def test_no_bos_unless_asked(make_dir: Callable[..., Path], hf_tok: Any, add_bos: bool | None) -> None:
    t = Tokenizer(make_dir(tokenizer_config=_bos_config(add_bos)))
    assert t.encode("Hello world") == t.encode("Hello world", add_special_tokens=False) == hf_tok.encode("Hello world")
    assert t.encode("") == []


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_bos_written_in_the_text_is_kept(make_dir: Callable[..., Path], add_bos: bool | None) -> None:
    t = Tokenizer(make_dir(tokenizer_config=_bos_config(add_bos)))
    body = t.encode("<|im_start|>hi", add_special_tokens=False)
    assert body[0] == BOS_ID
    expected = [BOS_ID, *body] if add_bos else body
    assert t.encode("<|im_start|>hi") == expected


def _with_bos_post_processor(d: Path) -> Path:
    raw = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    raw["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [BOS_ID], "tokens": ["<|im_start|>"]}},
    }
    (d / "tokenizer.json").write_text(json.dumps(raw), encoding="utf-8")
    return d


@pytest.mark.parametrize(("add_bos", "bos_count"), [(False, 0), (None, 1), (True, 1)])
def test_config_overrides_a_post_processor_that_adds_bos(
    make_dir: Callable[..., Path], add_bos: bool | None, bos_count: int
) -> None:
    t = Tokenizer(_with_bos_post_processor(make_dir(tokenizer_config=_bos_config(add_bos))))
    plain = t.encode("Hello", add_special_tokens=False)
    assert BOS_ID not in plain
    assert t.encode("Hello") == [BOS_ID] * bos_count + plain
    # A BOS typed into the text survives; only the post-processor's one is dropped or kept.
    assert t.encode("<|im_start|>Hello") == [BOS_ID] * bos_count + [BOS_ID, *plain]


def test_bos_token_missing_from_vocab_is_ignored(make_dir: Callable[..., Path]) -> None:
    t = Tokenizer(make_dir(tokenizer_config=_bos_config(True, bos="<s-not-in-vocab>")))
    assert t.bos_token_id is None
    assert t.encode("Hello") == t.encode("Hello", add_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# EOS ids


def test_eos_from_generation_config_first(make_dir: Callable[..., Path]) -> None:
    d = make_dir(
        generation_config={"eos_token_id": [2, 0]},
        config={"eos_token_id": 5},
        tokenizer_config={"eos_token": "<|im_start|>"},
    )
    assert Tokenizer(d).eos_token_ids == frozenset({0, 2})


def test_eos_falls_back_to_config_json(make_dir: Callable[..., Path]) -> None:
    d = make_dir(
        generation_config={"bos_token_id": 1},
        config={"eos_token_id": 7},
        tokenizer_config={"eos_token": "<|im_end|>"},
    )
    assert Tokenizer(d).eos_token_ids == frozenset({7})
    d = make_dir(config={"eos_token_id": [7, 8, True, "x"]})  # non-int entries are ignored
    assert Tokenizer(d).eos_token_ids == frozenset({7, 8})


def test_eos_falls_back_to_eos_token(make_dir: Callable[..., Path]) -> None:
    d = make_dir(
        generation_config={"eos_token_id": None},
        config={},
        tokenizer_config={"eos_token": "<|im_end|>"},
    )
    assert Tokenizer(d).eos_token_ids == frozenset({EOS_ID})
    d = make_dir(tokenizer_config={"eos_token": {"content": "<|endoftext|>"}})
    assert Tokenizer(d).eos_token_ids == frozenset({UNK_ID})


def test_no_eos_anywhere_gives_empty_set(make_dir: Callable[..., Path]) -> None:
    assert Tokenizer(make_dir()).eos_token_ids == frozenset()
    assert Tokenizer(make_dir(tokenizer_config={"eos_token": "<not-a-token>"})).eos_token_ids == frozenset()
    assert Tokenizer(make_dir(generation_config={"eos_token_id": True})).eos_token_ids == frozenset()


# ---------------------------------------------------------------------------------------------
# failures


def test_missing_tokenizer_json(make_dir: Callable[..., Path]) -> None:
    d = make_dir(tokenizer_json=False, tokenizer_config={})
    with pytest.raises(
        TokenizerError,
        match=r"tokenizer\.json does not exist \(only fast tokenizers are supported\)",
    ):
        Tokenizer(d)
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer(d / "no-such-dir")


def test_unloadable_tokenizer_json(make_dir: Callable[..., Path]) -> None:
    d = make_dir(tokenizer_json=False)
    (d / "tokenizer.json").write_text('{"not": "a tokenizer"}', encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json cannot be loaded"):
        Tokenizer(d)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"chat_template": "x",', r"tokenizer_config\.json is not valid JSON"),
        (b"\xff\xfe\x00garbage", r"tokenizer_config\.json is not valid JSON"),
        ("[1, 2, 3]", r"tokenizer_config\.json must hold a JSON object"),
    ],
)
def test_corrupt_tokenizer_config(make_dir: Callable[..., Path], content: str | bytes, message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        Tokenizer(make_dir(tokenizer_config=content))


@pytest.mark.parametrize("name", ["generation_config", "config"])
def test_corrupt_eos_sources(make_dir: Callable[..., Path], name: str) -> None:
    with pytest.raises(TokenizerError, match=rf"{name}\.json is not valid JSON"):
        Tokenizer(make_dir(**{name: "{oops"}))


def test_non_utf8_chat_template_jinja(make_dir: Callable[..., Path]) -> None:
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja is not UTF-8 text"):
        Tokenizer(make_dir(chat_template_jinja=b"\xff\xfe{{ x }}"))


def test_template_raise_exception(make_dir: Callable[..., Path]) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation roles must start with user') }}"
        "{% endif %}ok"
    )
    t = Tokenizer(make_dir(tokenizer_config={"chat_template": template}))
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(
        TokenizerError,
        match="chat template failed to render: Conversation roles must start with user",
    ):
        t.encode_chat([{"role": "assistant", "content": "x"}])


def test_template_runtime_error_is_a_tokenizer_error(make_dir: Callable[..., Path]) -> None:
    t = Tokenizer(make_dir(tokenizer_config={"chat_template": "{{ messages[0]['content'] + 1 }}"}))
    with pytest.raises(TokenizerError, match="chat template failed to render"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sandbox_blocks_unsafe_access(make_dir: Callable[..., Path]) -> None:
    t = Tokenizer(make_dir(tokenizer_config={"chat_template": "{{ messages.__class__.__mro__ }}"}))
    with pytest.raises(TokenizerError, match=r"chat template failed to render: .*unsafe"):
        t.apply_chat_template([])
    # Immutable: templates may not mutate the caller's messages.
    t = Tokenizer(make_dir(tokenizer_config={"chat_template": "{{ messages.append(1) }}"}))
    messages: list[dict[str, Any]] = []
    with pytest.raises(TokenizerError, match="chat template failed to render"):
        t.apply_chat_template(messages)
    assert messages == []


def test_template_syntax_error(make_dir: Callable[..., Path]) -> None:
    with pytest.raises(TokenizerError, match=r"chat template does not compile: \S"):
        compile_chat_template("{% for m in messages %}{{ m }")
    t = Tokenizer(make_dir(tokenizer_config={"chat_template": "{% if %}"}))  # compiled lazily
    with pytest.raises(TokenizerError, match="chat template does not compile"):
        t.encode_chat([{"role": "user", "content": "x"}])


def test_model_without_chat_template(make_dir: Callable[..., Path]) -> None:
    for d in (
        make_dir(),
        make_dir(tokenizer_config={"chat_template": ""}),
        make_dir(tokenizer_config={"chat_template": 5}),
    ):
        t = Tokenizer(d)
        assert t.chat_template_source is None
        with pytest.raises(
            TokenizerError,
            match=r"this model has no chat template \(tokenizer_config\.json or chat_template\.jinja\)",
        ):
            t.apply_chat_template([{"role": "user", "content": "x"}])
        # Plain encoding still works without a template.
        assert t.decode(t.encode("x")) == "x"


# ---------------------------------------------------------------------------------------------
# incremental detokenizer


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt or (), skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    return [*deltas, detok.flush()]


@given(data=st.data(), skip=st.booleans())
@HYPOTHESIS
def test_detokenizer_concatenation_equals_decode(
    tok: Tokenizer, byte_token_ids: list[int], data: st.DataObject, skip: bool
) -> None:
    # Mix arbitrary vocabulary ids with raw byte tokens, so that broken UTF-8 sequences and
    # special tokens both appear often.
    token = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(byte_token_ids), st.integers(0, 16))
    ids = data.draw(st.lists(token, max_size=16))
    assert "".join(stream(tok, ids, skip=skip)) == tok.decode(ids, skip_special_tokens=skip)


# Characters the vocabulary encodes losslessly: it lacks the byte tokens of most control
# characters and the UTF-8 lead bytes 0xF1-0xF4 (planes 4 and up), which encode drops.
ENCODABLE = st.one_of(
    st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cc", "Cs"), exclude_characters="<"),
    st.sampled_from("\n\t "),
)


@given(text=st.text(ENCODABLE, max_size=30))
@HYPOTHESIS
def test_detokenizer_never_emits_partial_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    deltas = stream(tok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[-1] == ""  # nothing held back at the end of valid text


@pytest.mark.parametrize(
    "text",
    [
        "日本の首都",
        "🙂👍🏽",
        "a宰b",
        "Ω≈ç√",
        "\U0001d518\U0001d52b\U0001d526",
        "한국어",
        "👨‍👩‍👧‍👦!",
    ],
)
def test_split_characters_are_held_back(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    # The case under test must exist: some prefix of the ids decodes to a broken character.
    broken = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert broken, f"{text!r} has no split character in {ids}"
    deltas = stream(tok, ids)
    for k in broken:
        assert deltas[k - 1] == "" or not deltas[k - 1].endswith("\ufffd")
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    # Every emitted delta is a whole-character prefix of the text, in order.
    pos = 0
    for k, delta in enumerate(deltas[:-1]):
        assert text[pos : pos + len(delta)] == delta
        pos += len(delta)
        assert text[:pos] == tok.decode(ids[: k + 1]).rstrip("\ufffd")


def test_emoji_is_emitted_whole(tok: Tokenizer) -> None:
    ids = tok.encode("🙂")
    assert len(ids) >= 2 and tok.decode(ids[:1]) == "\ufffd"
    deltas = stream(tok, ids)
    assert deltas == [""] * (len(ids) - 1) + ["🙂", ""]


def test_flush_emits_an_incomplete_character(tok: Tokenizer) -> None:
    first = tok.encode("宰")[0]
    assert tok.decode([first]) == "\ufffd"
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("a")[0]) == "a"
    assert detok.add(first) == ""
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""  # nothing twice


def test_special_tokens_in_stream(tok: Tokenizer) -> None:
    ids = tok.encode("hi<|im_end|> there", add_special_tokens=False)
    assert EOS_ID in ids
    assert "".join(stream(tok, ids)) == "hi there"
    assert "".join(stream(tok, ids, skip=False)) == "hi<|im_end|> there"
    # A skipped special token alone emits nothing and loses nothing.
    assert stream(tok, [EOS_ID, EOS_ID]) == ["", "", ""]


@given(prompt=st.text(max_size=30), output=st.text(max_size=30))
@HYPOTHESIS
def test_detokenizer_with_prompt_context(tok: Tokenizer, prompt: str, output: str) -> None:
    prompt_ids = tok.encode_chat([{"role": "user", "content": prompt}]) if len(prompt) % 2 else tok.encode(prompt)
    out_ids = tok.encode(output, add_special_tokens=False)
    deltas = stream(tok, out_ids, prompt=prompt_ids)
    assert "".join(deltas) == tok.decode(out_ids)


@given(data=st.data())
@HYPOTHESIS
def test_detokenizer_with_arbitrary_prompt_ids(tok: Tokenizer, byte_token_ids: list[int], data: st.DataObject) -> None:
    token = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(byte_token_ids))
    prompt_ids = data.draw(st.lists(token, max_size=8))
    out_ids = data.draw(st.lists(token, max_size=10))
    assert "".join(stream(tok, out_ids, prompt=prompt_ids)) == tok.decode(out_ids)


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    # '宰' is two tokens: a prompt holding the first and an output starting with the second
    # must not merge them (the character would vanish from both texts).
    lead, tail = tok.encode("宰")
    out_ids = [tail, *tok.encode(" tri", add_special_tokens=False)]
    assert "".join(stream(tok, out_ids, prompt=[lead])) == tok.decode(out_ids) == "\ufffd tri"


def test_prompt_context_does_not_leak_into_output(tok: Tokenizer) -> None:
    prompt_ids = tok.encode("The capital of France is")
    out_ids = tok.encode(" Paris. 🙂", add_special_tokens=False)
    deltas = stream(tok, out_ids, prompt=prompt_ids)
    assert "".join(deltas) == " Paris. 🙂"
    assert deltas[0] == " Paris"  # the first output token starts with its space
    long_prompt = tok.encode("word " * 50)
    assert "".join(stream(tok, out_ids, prompt=long_prompt)) == " Paris. 🙂"


# Templates in the shape of Gemma's: Gemma 2's refuses a system message, Gemma 3's folds it into
# the first user turn. Rendering the model's own template is what decides, as in transformers.
GEMMA2_STYLE_TEMPLATE = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}
{%- for message in messages -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"""
GEMMA3_STYLE_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set rest = messages[1:] -%}
{%- else -%}{%- set first_user_prefix = '' -%}{%- set rest = messages -%}{%- endif -%}
{%- for message in rest -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"""
WITH_SYSTEM = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "bye"},
]


@pytest.mark.parametrize("template", [GEMMA2_STYLE_TEMPLATE, GEMMA3_STYLE_TEMPLATE])
def test_system_role_is_merged_or_refused_as_the_template_says(make_dir: Callable[..., Path], template: str) -> None:
    from transformers import AutoTokenizer

    d = make_dir(tokenizer_config={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template})
    hf, ours = AutoTokenizer.from_pretrained(d, local_files_only=True), Tokenizer(d)
    without_system = WITH_SYSTEM[1:]
    rendered = hf.apply_chat_template(without_system, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(without_system) == rendered
    if template is GEMMA3_STYLE_TEMPLATE:
        text = ours.apply_chat_template(WITH_SYSTEM)
        assert text == hf.apply_chat_template(WITH_SYSTEM, tokenize=False, add_generation_prompt=True)
        assert "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>" in text
        return
    with pytest.raises(Exception, match="System role not supported"):
        hf.apply_chat_template(WITH_SYSTEM, tokenize=False)
    with pytest.raises(TokenizerError, match="chat template failed to render: System role not supported"):
        ours.apply_chat_template(WITH_SYSTEM)
