"""The tokenizer a GGUF file describes, built from its metadata alone: a `tokenizers.Tokenizer`
(what tokenizer.json holds) and the tokenizer_config.json fields the engine reads.

A GGUF carries no tokenizer.json, only llama.cpp's description of one under `tokenizer.ggml.*`.
`tokenizer.ggml.model` names the kind, and two are built here:

- "gpt2", byte-level BPE (SmolLM2, Qwen2/2.5, Llama 3): the tokens are spelled in GPT-2's byte
  alphabet, the merges are in the file, and `tokenizer.ggml.pre` names how text is split into
  words before the merges run (one of `PRE_TOKENIZERS`).
- "llama", SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3): spaces are spelled "▁", a character
  outside the vocabulary is spelled by its bytes' tokens <0x00>..<0xFF>, and the file has scores,
  not merges. SentencePiece merges the adjacent pair whose concatenation is the best-scored token;
  that is a BPE whose merge list holds every split of every token into two tokens, ranked by the
  whole token's score.

Tokens the file marks control or unknown, and the bos/eos/unk/pad tokens, become special added
tokens (matched whole in text, dropped by `skip_special_tokens`); user-defined ones become plain
added tokens (matched whole, kept when decoding), as llama.cpp treats them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from compiled_engine.errors import ModelSourceError
from compiled_engine.model.family import GGUFLayout
from compiled_engine.model.registry import family_of_gguf
from compiled_engine.weights.gguf import GGUFHeader

# llama.cpp's token types (`tokenizer.ggml.token_type`).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# GGUF key of each special token id, by its tokenizer_config.json name.
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}

# Word splitting regexes of the pre-tokenizers llama.cpp names (llama-vocab.cpp), in the
# `tokenizers` library's regex dialect. GPT-2's own is ByteLevel's built-in one.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level vocabulary splits text into words: GPT-2's regex, or `split` instead of
    it; `digits` first cuts every digit off on its own (StarCoder's vocabulary and SmolLM's learned
    no multi-digit tokens); `ignore_merges` takes a word that is a whole token as it is, before
    any merge (Llama 3's tokenizer does)."""

    split: str | None = None
    digits: bool = False
    ignore_merges: bool = False


_GPT2 = PreTokenizer()
_STARCODER = PreTokenizer(digits=True)
_LLAMA3 = PreTokenizer(split=_LLAMA3_SPLIT, ignore_merges=True)
_QWEN2 = PreTokenizer(split=_QWEN2_SPLIT)
# By the names llama.cpp gives them in `tokenizer.ggml.pre`. "default" is what a file without a
# name gets; for a byte-level vocabulary that is GPT-2's splitting.
PRE_TOKENIZERS = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}

# A family's quirks are its record's (GGUFLayout): Gemma's scores do not follow the order in which
# its merges were learned, the order of its tokens in the file does (that is how the Hugging Face
# tokenizer ranks a Gemma GGUF's merges); Phi-3's tokenizer puts "▁" before every piece of text,
# even one that starts with a space, where the others add it only to text that does not already
# start with one.
_NO_QUIRKS = GGUFLayout("")


@dataclass(frozen=True)
class GGUFTokenizer:
    """A GGUF's tokenizer: `tokenizer` for tokenizer.json, `config` for tokenizer_config.json."""

    tokenizer: Tokenizer
    config: dict[str, Any]


def build_gguf_tokenizer(header: GGUFHeader) -> GGUFTokenizer:
    """The tokenizer the GGUF's `tokenizer.ggml.*` metadata describes, or a ModelSourceError that
    names the file and what in it cannot be used."""
    kind = header.metadata.get("tokenizer.ggml.model")
    builders: dict[str, Callable[[_Vocabulary], Tokenizer]] = {"gpt2": _byte_level, "llama": _sentencepiece}
    if not isinstance(kind, str) or kind not in builders:  # (an array is no dictionary key)
        raise ModelSourceError(
            f"{header.path}: its tokenizer model {kind!r} (tokenizer.ggml.model) is not supported "
            f"(supported: {', '.join(builders)}); put the model's tokenizer.json beside the file"
        )
    vocab = _Vocabulary.read(header, kind)
    tokenizer = builders[kind](vocab)
    _add_special_tokens(tokenizer, vocab)
    add_bos = vocab.flag("tokenizer.ggml.add_bos_token", vocab.default_add_bos())
    add_eos = vocab.flag("tokenizer.ggml.add_eos_token", False)
    tokenizer.post_processor = _post_processor(vocab, add_bos, add_eos)
    config: dict[str, Any] = {name: vocab.tokens[i] for name, i in vocab.special_ids.items()}
    config |= {"add_bos_token": add_bos, "add_eos_token": add_eos, "clean_up_tokenization_spaces": False}
    return GGUFTokenizer(tokenizer, config)


@dataclass
class _Vocabulary:
    """The GGUF's vocabulary metadata, checked: `tokens` as the model's vocabulary spells them
    (with `_byte_level` or `_sentencepiece` respelling some), one type per token, and the special
    token ids the file names."""

    header: GGUFHeader
    kind: str
    tokens: list[str]
    types: list[int]
    special_ids: dict[str, int]

    @classmethod
    def read(cls, header: GGUFHeader, kind: str) -> _Vocabulary:
        where = f"{header.path}: its {kind!r} tokenizer"
        tokens = header.metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ModelSourceError(f"{where} has no vocabulary (tokenizer.ggml.tokens is missing or empty)")
        if not all(isinstance(t, str) for t in tokens):
            raise ModelSourceError(f"{where}: tokenizer.ggml.tokens must be a list of strings")
        # An empty token cannot be looked up; llama.cpp names it this way too.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = header.metadata.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
        if not isinstance(types, list) or len(types) != len(tokens) or not all(_is_int(t) for t in types):
            raise ModelSourceError(f"{where}: tokenizer.ggml.token_type must be one int per token ({len(tokens)})")
        special_ids: dict[str, int] = {}
        for name, key in SPECIAL_TOKEN_KEYS.items():
            value = header.metadata.get(key)
            if value is None:
                continue
            if not _is_int(value) or not 0 <= value < len(tokens):
                raise ModelSourceError(f"{where}: {key} = {value!r} is not a token id (vocabulary of {len(tokens)})")
            special_ids[name] = value
        return cls(header, kind, tokens, types, special_ids)

    def where(self) -> str:
        return f"{self.header.path}: its {self.kind!r} tokenizer"

    def flag(self, key: str, default: bool) -> bool:
        value = self.header.metadata.get(key, default)
        if not isinstance(value, bool):
            raise ModelSourceError(f"{self.where()}: {key} must be a bool, got {value!r}")
        return value

    def default_add_bos(self) -> bool:
        # Files that do not say: llama.cpp adds BOS for SentencePiece and Llama 3 vocabularies.
        if self.kind == "llama":
            return True
        return self.header.metadata.get("tokenizer.ggml.pre") in ("llama-bpe", "llama3", "llama-v3")

    def merges(self) -> list[tuple[str, str]] | None:
        merges = self.header.metadata.get("tokenizer.ggml.merges")
        if merges is None:
            return None
        if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
            raise ModelSourceError(f"{self.where()}: tokenizer.ggml.merges must be a list of strings")
        pairs = []
        for merge in merges:
            parts = merge.split(" ")
            if len(parts) != 2 or not all(parts):
                raise ModelSourceError(f"{self.where()}: merge {merge!r} is not two tokens apart by one space")
            pairs.append((parts[0], parts[1]))
        return pairs

    def vocab_dict(self) -> dict[str, int]:
        vocab: dict[str, int] = {}
        for i, token in enumerate(self.tokens):
            if token in vocab:
                raise ModelSourceError(f"{self.where()}: token {token!r} is both id {vocab[token]} and id {i}")
            vocab[token] = i
        return vocab


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bpe(vocab: _Vocabulary, merges: list[tuple[str, str]], **options: Any) -> models.BPE:
    try:
        return models.BPE(vocab=vocab.vocab_dict(), merges=merges, dropout=None, **options)
    except Exception as exc:  # the Rust library raises plain Exception (a merge of unknown tokens, ...)
        raise ModelSourceError(f"{vocab.where()} cannot be built: {exc}") from exc


# --- byte-level BPE ------------------------------------------------------------------------------


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value: the byte itself where it is a printable
    Latin-1 character, else one of the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, extra = [], 0
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + extra))
            extra += 1
    return alphabet


def _byte_level(vocab: _Vocabulary) -> Tokenizer:
    option = vocab.header.metadata.get("tokenizer.ggml.pre", "default")
    if not isinstance(option, str) or option not in PRE_TOKENIZERS:  # (an array is no dictionary key)
        raise ModelSourceError(
            f"{vocab.where()}: pre-tokenizer {option!r} (tokenizer.ggml.pre) is not supported "
            f"(supported: {', '.join(PRE_TOKENIZERS)}); put the model's tokenizer.json beside the file"
        )
    pre = PRE_TOKENIZERS[option]
    merges = vocab.merges()
    if merges is None:
        raise ModelSourceError(f"{vocab.where()} has no merges (tokenizer.ggml.merges)")
    # The file spells ordinary tokens in the byte alphabet but added ones (control, user-defined)
    # as their text: those keep their text, which is what an added token is matched by, and the
    # byte-level decoder passes a token with characters outside the alphabet through as it is.
    alphabet = byte_alphabet()
    spelled = set(alphabet)
    for i, token in enumerate(vocab.tokens):
        if vocab.types[i] in (NORMAL, UNUSED) and not set(token) <= spelled:
            vocab.tokens[i] = "".join(alphabet[b] for b in token.encode("utf-8"))
    tokenizer = Tokenizer(
        _bpe(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", ignore_merges=pre.ignore_merges)
    )
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pre.split is not None:
        steps.append(pre_tokenizers.Split(Regex(pre.split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.split is None))
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


# --- SentencePiece BPE -----------------------------------------------------------------------------


def _sentencepiece(vocab: _Vocabulary) -> Tokenizer:
    family = family_of_gguf(vocab.header.architecture or "")
    quirks = family.gguf if family is not None and family.gguf is not None else _NO_QUIRKS
    # A token of spaces only is stored with real spaces (llama.cpp's converter writes user-defined
    # tokens that way), which text never holds once its spaces are "▁": spelled back with "▁".
    taken = set(vocab.tokens)
    for i, token in enumerate(vocab.tokens):
        if set(token) == {" "} and "▁" * len(token) not in taken:
            vocab.tokens[i] = "▁" * len(token)
    merges = vocab.merges()
    if merges is None:
        merges = _merges_from_ranks(vocab, quirks.merges_by_position)
    unk = vocab.special_ids.get("unk_token")
    tokenizer = Tokenizer(
        _bpe(vocab, merges, unk_token=None if unk is None else vocab.tokens[unk], fuse_unk=True, byte_fallback=True)
    )
    prefix = vocab.flag("tokenizer.ggml.add_space_prefix", True)
    if prefix and quirks.always_prefixed:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        # "first": the "▁" goes before the text's start only, not before text that follows an
        # added token, and not before text that already starts with a space, as the Hugging Face
        # tokenizer of a Llama or Mistral GGUF has it (llama.cpp adds it in both places, as
        # `always_prefixed` does).
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False
        )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))  # the space the prefix added
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_ranks(vocab: _Vocabulary, by_position: bool) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best token first: by score (higher first), or by
    position in the file (earlier first). Splits of equally ranked tokens go longer left piece
    first, then longer right piece, then in token order, as the Hugging Face tokenizer orders
    them, so both merge alike where SentencePiece itself would look at the text."""
    positions = [float(-i) for i in range(len(vocab.tokens))]
    ranks = positions
    if not by_position:
        scores = vocab.header.metadata.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(vocab.tokens):
            raise ModelSourceError(
                f"{vocab.where()} has no merges and no score per token (tokenizer.ggml.scores) to rank them by"
            )
        if not all(isinstance(s, int | float) and not isinstance(s, bool) for s in scores):
            raise ModelSourceError(f"{vocab.where()}: tokenizer.ggml.scores must be numbers")
        ranks = [float(s) for s in scores]
        # A vocabulary converted from a tokenizer.json has one placeholder score for every token;
        # its tokens are then listed in the order their merges were learned.
        if len({r for r, t in zip(ranks, vocab.types, strict=True) if t == NORMAL}) <= 1:
            ranks = positions
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    found: list[tuple[float, int, int, int, int, int, str, str]] = []
    for i, token in enumerate(vocab.tokens):
        if vocab.types[i] == BYTE:  # reached only by falling back to bytes, never by a merge
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-ranks[i], -len(left), -len(right), i, ids[left], ids[right], left, right))
    found.sort(key=lambda m: m[:6])
    return [(m[6], m[7]) for m in found]


# --- both --------------------------------------------------------------------------------------------


def _add_special_tokens(tokenizer: Tokenizer, vocab: _Vocabulary) -> None:
    # Each added token's text is its vocabulary entry, so the library keeps its id.
    special_ids = set(vocab.special_ids.values())
    special, plain = [], []
    for i, token in enumerate(vocab.tokens):
        if vocab.types[i] in (CONTROL, UNKNOWN) or i in special_ids:
            special.append(AddedToken(token, special=True, normalized=False))
        elif vocab.types[i] == USER_DEFINED and not (vocab.kind == "llama" and set(token) == {"▁"}):
            # (a run of spaces in a SentencePiece vocabulary is reached by merges, as an ordinary token)
            plain.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != len(vocab.tokens):
        raise ModelSourceError(f"{vocab.where()} came out with {size} tokens instead of {len(vocab.tokens)}")


def _post_processor(vocab: _Vocabulary, add_bos: bool, add_eos: bool) -> processors.PostProcessor | None:
    """BOS before and EOS after each sequence, where the file asks for them."""
    ends: dict[str, int] = {}
    for name, wanted in (("bos", add_bos), ("eos", add_eos)):
        if not wanted:
            continue
        token_id = vocab.special_ids.get(f"{name}_token")
        if token_id is None:
            raise ModelSourceError(
                f"{vocab.where()}: tokenizer.ggml.add_{name}_token is true but tokenizer.ggml.{name}_token_id is not set"
            )
        ends[name] = token_id
    if not ends:
        return None
    bos = [vocab.tokens[ends["bos"]]] if "bos" in ends else []
    eos = [vocab.tokens[ends["eos"]]] if "eos" in ends else []
    return processors.TemplateProcessing(
        single=[*bos, "$A:0", *eos],
        pair=[*bos, "$A:0", *eos, *bos, "$B:1", *eos],
        special_tokens=[(vocab.tokens[i], i) for i in ends.values()],
    )
