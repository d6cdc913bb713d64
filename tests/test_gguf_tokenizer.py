"""The tokenizer built from a GGUF's own metadata (weights/gguf_tokenizer.py), read back through the
files prepare writes and the engine's Tokenizer, against transformers' tokenizer for the same
file: ids with and without special tokens, and the text decoded with and without them, on a few
hundred strings each. The files: the default model's GGUF (byte-level, pre-tokenizer "smollm")
and the fixtures in tests/fixtures/gguf_tokenizer (Qwen2- and Llama-3-like byte-level,
Llama-2- and Gemma-like SentencePiece). Then prepare on a GGUF alone, and each way a vocabulary
is refused."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import pre_tokenizers

from compiled_engine.errors import ModelSourceError
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.weights import gguf_dir
from compiled_engine.weights.default_model import GGUF_NAME, default_model_dir
from compiled_engine.weights.gguf import GGUFHeader, read_gguf_header
from compiled_engine.weights.gguf_dir import prepare_gguf_dir
from compiled_engine.weights.gguf_tokenizer import BYTE, CONTROL, NORMAL, build_gguf_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "gguf_tokenizer"
DEFAULT_GGUF = default_model_dir() / GGUF_NAME

BASE = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "tokenization and quantization",
    "hello",
    "a",
    "",
    " ",
    "   ",
    "\n",
    "\t",
    "Café, naïve résumé — über façade, São Paulo, jalapeño",
    "日本語のテキストと中文字符",
    "한국어 텍스트",
    "emoji 🙂👍🏽 and 🇫🇷 flags",
    "Ελληνικά και русский текст",
    "x  1",
    "a 12 b",
    "12345 678 9",
    "3.14159 and 1,000,000 and 2024-05-12",
    "version v2.0.1",
    "def encode(self, text: str) -> list[int]:\n    return [self.vocab[p] for p in text]\n",
    "for (int i = 0; i < n; i++) {\n\ttotal += x[i];\n}",
    "if x == 0 and y != 1: print('hello, world!')  # comment",
    "<html><body><p>Hello there!</p></body></html>",
    "a\n\nb\n\n\nc",
    "line one\r\nline two",
    "  two leading spaces",
    "trailing spaces   ",
    "many     spaces   between    words",
    "tabs\tbetween\t\twords",
    "don't you'll I'm they've she'd WE'RE",
    "ALL CAPS WORDS AND MixedCase",
    "Questions? Answers! Quotes: \"double\" and 'single'; (round) [square] {curly}",
    "$100.00 + 15% = ???",
    "email@example.com https://example.com/path?q=1&r=2",
    "<notatoken> </s >  < s>",
    "\u2581already metaspace\u2581",
    "zero\u200bwidth and non\u00a0breaking",
    "a\u0301 combining accent",
    "\ufffd replacement and \x00 nul",
]


def texts(specials: tuple[str, ...]) -> list[str]:
    out = list(BASE)
    for text in BASE:
        out += [" " + text, text + " ", "  " + text + "\n", text.replace(" ", "  "), text + "\n\n" + text]
    for token in specials:
        out += [token, token + "hello", "hello" + token, token + " hello", "a " + token + " b"]
        out += [token + token, token + "\n" + token + "x", "\t" + token + "  x "]
    return list(dict.fromkeys(out))


CASES: dict[str, tuple[Path, tuple[str, ...]]] = {
    "smollm2": (DEFAULT_GGUF, ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>")),
    "qwen2": (FIXTURES / "bpe-qwen2.gguf", ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>")),
    "llama3": (FIXTURES / "bpe-llama3.gguf", ("<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>")),
    "llama2": (FIXTURES / "spm-llama.gguf", ("<s>", "</s>", "<unk>", "<tool>")),
    "gemma": (FIXTURES / "spm-gemma.gguf", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>", "<mask>")),
}
MESSAGES = [
    {"role": "user", "content": "Hello, who are you? 🙂"},
    {"role": "assistant", "content": " I am  a model.\n\nAsk away."},
    {"role": "user", "content": "What is 12 + 30?"},
]


def alone(path: Path, folder: Path) -> Path:
    """A link to `path` in a folder of its own, so that nothing beside it is read."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / path.name
    link.symlink_to(path.resolve())
    return link


def transformers_tokenizer(path: Path, folder: Path) -> Any:
    from transformers import AutoTokenizer

    link = alone(path, folder)
    return AutoTokenizer.from_pretrained(str(link.parent), gguf_file=link.name)


def starcoder_split(reference: Any) -> Any:
    """transformers' tokenizer with the split llama.cpp gives "smollm" (every digit cut off, then
    GPT-2's regex, as SmolLM2's own tokenizer.json has it); transformers does not know the name
    and splits as GPT-2 alone (`test_smollm_cuts_every_digit_off`)."""
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return reference


@dataclasses.dataclass
class Pair:
    name: str
    ours: Tokenizer
    raw: RawTokenizer  # tokenizer.json alone, as other readers of the directory see it
    reference: Any
    texts: list[str]
    vocab_size: int


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    name = request.param
    path, specials = CASES[name]
    if not path.is_file():
        pytest.skip(f"{path} is not prepared")
    folder = tmp_path_factory.mktemp(name)
    # What prepare writes for a GGUF with no tokenizer.json beside it (prepare itself refuses the
    # gemma3 and qwen2 architectures, whose models the engine does not run).
    built = folder / "model"
    built.mkdir()
    header = read_gguf_header(path)
    gguf_dir._write_tokenizer(header, alone(path, folder / "alone"), built)
    reference = transformers_tokenizer(path, folder / "reference")
    if name == "smollm2":
        reference = starcoder_split(reference)
    raw = RawTokenizer.from_file(str(built / "tokenizer.json"))
    size = len(header.metadata["tokenizer.ggml.tokens"])
    return Pair(name, Tokenizer(built), raw, reference, texts(specials), size)


def mismatches(ours: Tokenizer, reference: Any, strings: list[str]) -> list[str]:
    found = []
    for text in strings:
        for special in (True, False):
            got, want = (
                ours.encode(text, add_special_tokens=special),
                reference.encode(text, add_special_tokens=special),
            )
            if got != want:
                found.append(f"encode({text!r}, add_special_tokens={special}): {got} != {want}")
        ids = reference.encode(text)
        for skip in (True, False):
            got_text, want_text = (
                ours.decode(ids, skip_special_tokens=skip),
                reference.decode(ids, skip_special_tokens=skip),
            )
            if got_text != want_text:
                found.append(f"decode({ids}, skip_special_tokens={skip}): {got_text!r} != {want_text!r}")
    return found


def test_encode_and_decode_match_transformers(pair: Pair) -> None:
    assert len(pair.texts) >= 250
    found = mismatches(pair.ours, pair.reference, pair.texts)
    assert not found, f"{len(found)} mismatches, the first:\n" + "\n".join(found[:15])
    # tokenizer.json alone adds BOS (and EOS) as the file says, without tokenizer_config.json.
    assert [pair.raw.encode(t).ids for t in pair.texts] == [pair.reference.encode(t) for t in pair.texts]
    # The file's vocabulary exactly (transformers adds a GPT-2 default <|endoftext|> to a byte-level
    # vocabulary that has no unknown token, one past the model's embedding).
    assert pair.ours.vocab_size == pair.vocab_size


def test_chat_prompts_match_transformers(pair: Pair) -> None:
    if pair.ours.chat_template_source is None:
        pytest.skip("no chat template in this file")
    want = pair.reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert pair.ours.encode_chat(MESSAGES) == list(want)


def test_special_token_fields(pair: Pair) -> None:
    """BOS, EOS, UNK and PAD by name, and BOS added where the file says so."""
    for key, value in pair.ours.special_tokens.items():
        assert value == str(getattr(pair.reference, key)), key
    hello = pair.ours.encode("hello", add_special_tokens=False)
    with_bos = [pair.ours.bos_token_id, *hello]
    assert pair.ours.encode("hello") == (with_bos if pair.name in ("llama3", "llama2", "gemma") else hello)


@pytest.mark.skipif(not DEFAULT_GGUF.is_file(), reason="the default model's GGUF is not prepared")
def test_smollm_cuts_every_digit_off(tmp_path: Path) -> None:
    """Before GPT-2's split, as llama.cpp does for "smollm": a space or newline run before a digit
    stays one token. transformers' GGUF tokenizer splits with GPT-2's regex alone and cuts the
    run before the digit into single tokens."""
    ours = build_gguf_tokenizer(read_gguf_header(DEFAULT_GGUF)).tokenizer
    assert ours.encode("x  1").tokens == ["x", "ĠĠ", "1"]
    assert ours.encode("a\n\n2024").tokens == ["a", "ĊĊ", "2", "0", "2", "4"]
    reference = transformers_tokenizer(DEFAULT_GGUF, tmp_path)
    assert reference.convert_ids_to_tokens(reference.encode("x  1")) == ["x", "Ġ", "Ġ", "1"]
    # Text with no whitespace before a digit splits alike.
    plain = [t for t in texts(()) if not any(c.isspace() and n.isdigit() for c, n in itertools.pairwise(t))]
    assert len(plain) > 150
    assert [ours.encode(t).ids for t in plain] == [reference.encode(t) for t in plain]


def test_byte_level_tokens_stored_as_text_are_respelled() -> None:
    """An ordinary token of a byte-level vocabulary stored as its text (not in the byte alphabet)
    is the same token once spelled in the alphabet."""
    header = read_gguf_header(FIXTURES / "bpe-qwen2.gguf")
    tokens = list(header.metadata["tokenizer.ggml.tokens"])
    the = tokens.index("Ġthe")
    tokens[the] = " the"
    built = build_gguf_tokenizer(replaced(header, **{"tokenizer.ggml.tokens": tokens})).tokenizer
    assert built.encode("in the end").tokens == build_gguf_tokenizer(header).tokenizer.encode("in the end").tokens
    assert the in built.encode("in the end").ids


@pytest.mark.parametrize(("pre", "want"), [("llama-bpe", ["abc"]), ("qwen2", ["a", "bc"])])
def test_llama3_takes_a_word_that_is_a_token_whole(pre: str, want: list[str]) -> None:
    """As llama.cpp and Llama 3's tokenizer.json do (`ignore_merges`), even where the merges
    would not reach it; other vocabularies merge."""
    header = replaced(
        read_gguf_header(FIXTURES / "bpe-qwen2.gguf"),
        drop=("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"),
        **{
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": ["a", "b", "c", "bc", "abc"],
            "tokenizer.ggml.token_type": [NORMAL] * 5,
            "tokenizer.ggml.merges": ["b c"],
            "tokenizer.ggml.add_bos_token": False,
        },
    )
    assert build_gguf_tokenizer(header).tokenizer.encode("abc").tokens == want


def test_placeholder_scores_rank_merges_by_position() -> None:
    """A SentencePiece vocabulary whose scores are all one placeholder value (converted from a
    tokenizer.json) is merged in the order its tokens are listed."""
    header = read_gguf_header(FIXTURES / "spm-llama.gguf")
    meta = header.metadata
    normal = [i for i, t in enumerate(meta["tokenizer.ggml.token_type"]) if t == NORMAL]
    # The same pieces listed best first, every score -1000.
    ranked = sorted(normal, key=lambda i: -meta["tokenizer.ggml.scores"][i])
    order = [i for i in range(len(meta["tokenizer.ggml.tokens"])) if i not in set(normal)] + ranked
    placeholder = replaced(
        header,
        **{
            "tokenizer.ggml.tokens": [meta["tokenizer.ggml.tokens"][i] for i in order],
            "tokenizer.ggml.token_type": [meta["tokenizer.ggml.token_type"][i] for i in order],
            "tokenizer.ggml.scores": [-1000.0] * len(order),
        },
    )
    want, got = build_gguf_tokenizer(header).tokenizer, build_gguf_tokenizer(placeholder).tokenizer
    for text in BASE:
        assert got.encode(text).tokens == want.encode(text).tokens, text


# --- prepare on a GGUF alone -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["spm-llama.gguf", "bpe-llama3.gguf"])
def test_prepare_gguf_dir_on_a_gguf_alone(
    name: str, tmp_path: Path, private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no tokenizer.json beside it, and neither transformers nor gguf-py importable, the
    prepared directory's tokenizer is transformers' for the same file."""
    reference = transformers_tokenizer(FIXTURES / name, tmp_path / "reference")
    copy = tmp_path / "alone" / name
    copy.parent.mkdir()
    shutil.copyfile(FIXTURES / name, copy)
    with monkeypatch.context() as patch:
        for module in ("transformers", "gguf"):
            patch.setitem(sys.modules, module, None)
        prepared = prepare_gguf_dir(copy)
    ours = Tokenizer(prepared)
    strings = texts(("<s>", "</s>", "<tool>", "<|begin_of_text|>", "<|eot_id|>"))
    found = mismatches(ours, reference, strings)
    assert not found, "\n".join(found[:15])
    config = json.loads((prepared / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True
    assert config.get("chat_template") == read_gguf_header(copy).metadata.get("tokenizer.chat_template")


# --- refusals --------------------------------------------------------------------------------------


def replaced(header: GGUFHeader, drop: tuple[str, ...] = (), **metadata: Any) -> GGUFHeader:
    """The header with some metadata changed or dropped (the tokenizer reads nothing else)."""
    changed = {k: v for k, v in header.metadata.items() if k not in drop} | metadata
    return dataclasses.replace(header, metadata=changed)


@pytest.fixture(scope="module")
def headers() -> dict[str, GGUFHeader]:
    return {name: read_gguf_header(FIXTURES / f"{name}.gguf") for name in ("spm-llama", "spm-gemma", "bpe-qwen2")}


def refusal(header: GGUFHeader, match: str) -> str:
    with pytest.raises(ModelSourceError, match=match) as info:
        build_gguf_tokenizer(header)
    message = str(info.value)
    assert str(header.path) in message
    return message


@pytest.mark.parametrize("model", ["bert", "rwkv", "t5", None])
def test_refuses_other_tokenizer_models(headers: dict[str, GGUFHeader], model: str | None) -> None:
    header = headers["bpe-qwen2"]
    header = (
        replaced(header, drop=("tokenizer.ggml.model",))
        if model is None
        else replaced(header, **{"tokenizer.ggml.model": model})
    )
    refusal(
        header, rf"its tokenizer model {model!r} \(tokenizer.ggml.model\) is not supported \(supported: gpt2, llama\)"
    )


def test_refuses_an_unknown_pre_tokenizer(headers: dict[str, GGUFHeader]) -> None:
    message = refusal(
        replaced(headers["bpe-qwen2"], **{"tokenizer.ggml.pre": "falcon"}),
        r"pre-tokenizer 'falcon' \(tokenizer.ggml.pre\) is not supported \(supported: default, gpt2, smollm, ",
    )
    assert "qwen2" in message and "llama-bpe" in message


@pytest.mark.parametrize("name", ["bpe-qwen2", "spm-llama"])
@pytest.mark.parametrize("tokens", [None, []], ids=["missing", "empty"])
def test_refuses_a_missing_vocabulary(headers: dict[str, GGUFHeader], name: str, tokens: list[str] | None) -> None:
    header = headers[name]
    header = (
        replaced(header, drop=("tokenizer.ggml.tokens",))
        if tokens is None
        else replaced(header, **{"tokenizer.ggml.tokens": tokens})
    )
    model = header.metadata["tokenizer.ggml.model"]
    refusal(header, rf"its '{model}' tokenizer has no vocabulary \(tokenizer.ggml.tokens is missing or empty\)")


def _duplicate(header: GGUFHeader) -> GGUFHeader:
    tokens = list(header.metadata["tokenizer.ggml.tokens"])
    tokens[-1] = tokens[-2]
    return replaced(header, **{"tokenizer.ggml.tokens": tokens})


@pytest.mark.parametrize(
    ("name", "change", "match"),
    [
        (
            "bpe-qwen2",
            lambda h: replaced(h, drop=("tokenizer.ggml.merges",)),
            r"has no merges \(tokenizer.ggml.merges\)",
        ),
        (
            "bpe-qwen2",
            lambda h: replaced(h, **{"tokenizer.ggml.merges": ["Ġ t", "a b c"]}),
            r"merge 'a b c' is not two tokens apart by one space",
        ),
        ("bpe-qwen2", lambda h: replaced(h, **{"tokenizer.ggml.merges": ["Ġ zzz"]}), r"cannot be built: .*zzz"),
        (
            "spm-llama",
            lambda h: replaced(h, drop=("tokenizer.ggml.scores",)),
            r"has no merges and no score per token \(tokenizer.ggml.scores\)",
        ),
        (
            "spm-llama",
            lambda h: replaced(h, **{"tokenizer.ggml.token_type": [NORMAL] * 3}),
            r"tokenizer.ggml.token_type must be one int per token",
        ),
        (
            "spm-gemma",
            lambda h: replaced(h, **{"tokenizer.ggml.bos_token_id": 10**6}),
            r"tokenizer.ggml.bos_token_id = 1000000 is not a token id \(vocabulary of \d+\)",
        ),
        (
            "spm-llama",
            lambda h: replaced(h, drop=("tokenizer.ggml.bos_token_id",)),
            r"tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is not set",
        ),
        ("spm-gemma", _duplicate, r"token '.*' is both id \d+ and id \d+"),
        (
            "spm-gemma",
            lambda h: replaced(h, **{"tokenizer.ggml.add_space_prefix": 1}),
            r"add_space_prefix must be a bool",
        ),
    ],
    ids=[
        "no-merges",
        "bad-merge",
        "merge-of-unknown-tokens",
        "no-scores",
        "token-types",
        "special-id",
        "bos-without-id",
        "duplicate-token",
        "flag",
    ],
)
def test_refuses_an_inconsistent_vocabulary(headers: dict[str, GGUFHeader], name: str, change: Any, match: str) -> None:
    refusal(change(headers[name]), match)


def test_byte_tokens_and_control_tokens_are_what_the_file_says(headers: dict[str, GGUFHeader]) -> None:
    """A character outside the SentencePiece vocabulary is spelled by its UTF-8 bytes' tokens, and
    decodes back; control tokens are special, user-defined ones plain."""
    header = headers["spm-gemma"]
    tokens, types = header.metadata["tokenizer.ggml.tokens"], header.metadata["tokenizer.ggml.token_type"]
    built = build_gguf_tokenizer(header).tokenizer
    encoding = built.encode("日", add_special_tokens=False)
    assert encoding.ids == [tokens.index(f"<0x{b:02X}>") for b in "日".encode()]
    assert all(types[i] == BYTE for i in encoding.ids)
    assert built.decode(encoding.ids) == "日"
    added = {t.content: t.special for t in built.get_added_tokens_decoder().values()}
    assert added["<start_of_turn>"] is True and types[tokens.index("<start_of_turn>")] == CONTROL
    assert added["\n\n"] is False
    assert built.decode(built.encode("<start_of_turn>a\n\nb", add_special_tokens=False).ids) == "a\n\nb"


@pytest.fixture(autouse=True)
def _quiet_transformers() -> Iterator[None]:
    """transformers logs a line per GGUF it reads."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    yield
    logging.set_verbosity(level)
