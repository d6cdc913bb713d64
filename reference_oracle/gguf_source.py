"""The oracle's own reading of a GGUF file: config, tokenizer and weights all through transformers
(`from_pretrained(..., gguf_file=...)`, which reads the file with gguf-py), from a folder that holds
nothing but the file, so no config.json or tokenizer.json that another reader wrote beside it can
leak in. Then what that reading says against another reader's config.json and tokenizer, field by
field and on fixed probe strings.

transformers reads only some of a GGUF's metadata keys into a config (for each family, its
GGUF_CONFIG_MAPPING): layers, sizes, heads, the rope base, the norm epsilon, the vocabulary size,
the special token ids, and (for Gemma) the head size and sliding window; a tied head from the
missing `output.weight`. Those are checked. What it reads no key for (rope scaling and partial
rotary, Gemma's soft caps, query scale and which layers slide, a window outside Gemma, a
Qwen3 head size, biases) it would take from its config class's defaults, which need not be the
file's: for those the oracle takes the other reader's values, and says which, so a report can
name what went unchecked.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Every computation-deciding config field, as (name, the key of transformers' GGUF reading it
# comes from). Checked when transformers read that key from the file.
CHECKED_FIELDS: tuple[tuple[str, str], ...] = (
    ("model_type", "model_type"),
    ("num_hidden_layers", "num_hidden_layers"),
    ("hidden_size", "hidden_size"),
    ("intermediate_size", "intermediate_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_key_value_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("vocab_size", "vocab_size"),
    ("max_position_embeddings", "max_position_embeddings"),
    ("rms_norm_eps", "rms_norm_eps"),
    ("rope_theta", "rope_theta"),
    ("sliding_window", "sliding_window"),
    ("tie_word_embeddings", "tie_word_embeddings"),
    ("bos_token_id", "bos_token_id"),
    ("eos_token_id", "eos_token_id"),
)
# Config attributes that decide the computation but that transformers reads from no GGUF key of
# the families the engine loads (or only sometimes): taken from the other reader's config when
# transformers did not read them.
TAKEN_WHEN_UNREAD = (
    "head_dim",
    "sliding_window",
    "rope_parameters",
    "layer_types",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "hidden_act",
    "hidden_activation",
    "attention_bias",
    "use_sliding_window",
    "max_window_layers",
    "original_max_position_embeddings",
)
# llama.cpp writes Mistral as a llama model; transformers calls it mistral when its name says so.
MODEL_TYPE_ALIASES = {"mistral": "llama"}

# Texts both tokenizers encode, with and without the special tokens they add: ASCII, runs of
# spaces, tabs and newlines, accents, other scripts, emoji (bytes outside most vocabularies),
# digits, and the empty string. The special tokens' own spellings are added to them.
PROBES = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  two leading spaces,\ta tab,\nnewlines\n\nand   three spaces ",
    "naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 🤖🎉 and a lone combining mark e\u0301",
    "numbers 3.14159, 1,000,000 and 12/05/2023; code: x = f(y) + 42",
    "",
)
CHAT_PROBE = [
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "naïve 日本語 🤖"},
]


@dataclass
class ConfigCheck:
    """Where transformers' reading of a GGUF and another reader's config.json part."""

    checked: list[str] = field(default_factory=list)  # fields transformers read and compared
    disagreements: list[str] = field(default_factory=list)  # "field: ours X, transformers Y"
    taken: list[str] = field(default_factory=list)  # fields the oracle took from the other reader


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _same(a: Any, b: Any) -> bool:
    # GGUF stores float32: a value read as a double by one reader and kept as float32 by another
    # is the same value.
    if isinstance(a, float) and isinstance(b, float):
        return bool(np.float32(a) == np.float32(b))
    return bool(a == b)


def _rope_theta(config: Any) -> Any:
    rope = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in rope:  # per layer type (Gemma 3): the global layers' base
        rope = rope["full_attention"]
    return rope.get("rope_theta", getattr(config, "rope_theta", None))


def _with_rope_theta(rope: dict[str, Any], theta: Any) -> dict[str, Any]:
    if "full_attention" in rope:
        return {**rope, "full_attention": {**rope["full_attention"], "rope_theta": theta}}
    return {**rope, "rope_theta": theta}


def _ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    return frozenset([value] if isinstance(value, int) else value)


def field_value(config: Any, name: str, extra_eos: frozenset[int] = frozenset()) -> Any:
    """A field as the computation sees it, from a transformers config."""
    if name == "model_type":
        return MODEL_TYPE_ALIASES.get(config.model_type, config.model_type)
    if name == "num_key_value_heads":
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if name == "head_dim":
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if name == "rope_theta":
        return _rope_theta(config)
    if name == "eos_token_id":
        return _ids(config.eos_token_id) | extra_eos
    return getattr(config, name, None)


def compare_configs(ours: Any, theirs: Any, read: set[str], extra_eos: frozenset[int] = frozenset()) -> ConfigCheck:
    """Check `ours` (the other reader's config, as a transformers config) against `theirs`
    (transformers' reading of the GGUF, whose keys read from the file are `read`), then set on
    `theirs` what transformers read no key for from `ours`. `extra_eos`: end-of-generation ids
    the file names beside its eos (llama.cpp stops at `tokenizer.ggml.eot_token_id` too)."""
    check = ConfigCheck()
    # transformers derives the head size from hidden / heads where its class has none of its own.
    derived = {"head_dim"} if getattr(theirs, "head_dim", None) is None else set()
    for name, key in CHECKED_FIELDS:
        if key not in read | derived | {"model_type", "tie_word_embeddings"}:
            continue
        mine = field_value(ours, name)
        other = field_value(theirs, name, extra_eos)
        check.checked.append(name)
        if name == "eos_token_id":
            mine, other = sorted(mine), sorted(other)
        if not _same(mine, other):
            check.disagreements.append(f"{name}: ours {_short(mine)}, transformers {_short(other)}")
    for name in TAKEN_WHEN_UNREAD:
        if name in read | derived or not hasattr(theirs, name):  # read, or a knob its class lacks
            continue
        mine, other = getattr(ours, name, None), getattr(theirs, name, None)
        if name == "rope_parameters" and "rope_theta" in read and isinstance(mine, dict):
            # The base is transformers' (checked above); what it reads no key for is the rest.
            mine = _with_rope_theta(mine, _rope_theta(theirs))
        if _same(mine, other):
            continue
        setattr(theirs, name, mine)
        check.taken.append(f"{name} = {_short(mine)} (transformers' default {_short(other)})")
    return check


def fit_pad_token(config: Any) -> None:
    """A padding id that the file does not set falls back to the config class's default, which can
    lie past a small vocabulary (Phi-3's 32000), and the embedding then refuses it. It decides no
    logit (it only marks the embedding row that gets no gradient): outside the vocabulary, none."""
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and not 0 <= pad < config.vocab_size:
        config.pad_token_id = None


@dataclass
class TokenizerCheck:
    """Where another tokenizer parts from transformers' reading of a GGUF's vocabulary."""

    compared: list[str] = field(default_factory=list)  # the probe texts compared
    unspellable: list[str] = field(default_factory=list)  # probes the vocabulary cannot spell
    chat_template: bool = False  # whether a conversation was compared through both templates
    disagreements: list[str] = field(default_factory=list)


def spells(tokenizer: Any, text: str) -> bool:
    """Whether transformers' tokenizer gives `text` back from its ids. A vocabulary without byte
    tokens has no spelling for a character outside it, and what such a character becomes (an
    unknown token, as SentencePiece has it, or nothing, as transformers' GGUF tokenizer has it) is
    no reading of the file: only texts it spells are compared."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return bool(tokenizer.decode(ids, skip_special_tokens=False) == text)


def compare_tokenizers(
    theirs: Any,
    encode: Callable[[str, bool], list[int]],
    encode_chat: Callable[[list[dict[str, str]]], list[int]] | None,
) -> TokenizerCheck:
    """Where another tokenizer (`encode(text, add_special_tokens)`, and `encode_chat(messages)`
    with a generation prompt, None without a chat template) parts from transformers' tokenizer
    `theirs`: on the probe texts it spells, with and without the special tokens each adds, and on
    a short conversation through both chat templates."""
    check = TokenizerCheck()
    specials = [t for t in (theirs.bos_token, theirs.eos_token) if isinstance(t, str) and t]
    for text in [*PROBES, *(f"{s}special {s} tokens{s}" for s in specials)]:
        if not spells(theirs, text):
            check.unspellable.append(text)
            continue
        check.compared.append(text)
        for add_special in (True, False):
            mine = encode(text, add_special)
            other = [int(i) for i in theirs(text, add_special_tokens=add_special)["input_ids"]]
            if mine != other:
                kind = "with" if add_special else "without"
                check.disagreements.append(
                    f"tokenizer encodes {text!r} ({kind} special tokens): ours {_short(mine, 200)}, "
                    f"transformers {_short(other, 200)}"
                )
    has_template = bool(getattr(theirs, "chat_template", None))
    if (encode_chat is not None) != has_template:
        check.disagreements.append(
            f"chat template: ours {'present' if encode_chat else 'none'}, "
            f"transformers {'present' if has_template else 'none'}"
        )
    elif encode_chat is not None:
        check.chat_template = True
        check.disagreements += _chat_disagreement(theirs, encode_chat)
    return check


def _chat_disagreement(theirs: Any, encode_chat: Callable[[list[dict[str, str]]], list[int]]) -> list[str]:
    mine: list[int] | str
    other: list[int] | str
    try:
        mine = encode_chat(CHAT_PROBE)
    except Exception as exc:  # a template can raise anything
        mine = f"error: {exc}"
    try:
        encoded = theirs.apply_chat_template(CHAT_PROBE, add_generation_prompt=True, tokenize=True)
        ids = encoded if isinstance(encoded, list) else encoded["input_ids"]
        other = [int(i) for i in ids]
    except Exception as exc:
        other = f"error: {exc}"
    if mine == other or (isinstance(mine, str) and isinstance(other, str)):
        return []  # the same ids, or a template that refuses this conversation in both
    return [f"chat template renders a conversation as: ours {_short(mine, 200)}, transformers {_short(other, 200)}"]


@contextmanager
def gguf_alone(path: Path) -> Iterator[tuple[str, str]]:
    """A folder holding only a link to the GGUF file (a copy where links fail): (folder, name)."""
    resolved = Path(path).resolve()
    with tempfile.TemporaryDirectory(prefix="oracle-gguf-") as folder:
        target = Path(folder) / resolved.name
        try:
            os.symlink(resolved, target)
        except OSError:
            shutil.copyfile(resolved, target)
        yield folder, resolved.name


def eot_token_ids(path: Path) -> frozenset[int]:
    """The end-of-turn id a GGUF names beside its eos (llama.cpp stops at both), read by gguf-py."""
    from gguf import GGUFReader

    found = GGUFReader(path).fields.get("tokenizer.ggml.eot_token_id")
    return frozenset() if found is None else frozenset([int(found.contents())])


@dataclass
class GGUFReading:
    """transformers' reading of a GGUF file: its config (with what it reads no key for taken from
    the other reader's, see ConfigCheck.taken), tokenizer, the keys it read, and the ids that end
    a generation."""

    path: Path
    config: Any
    tokenizer: Any
    read: set[str]
    eos_token_ids: frozenset[int]
    check: ConfigCheck | None  # None without another reader's config to check


def read_gguf(path: Path, ours_dir: Path | None) -> tuple[GGUFReading, Any]:
    """transformers' config and tokenizer of the GGUF file at `path`, checked against the
    config.json in `ours_dir` when given, and its model (fp32, eager attention)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with gguf_alone(path) as (folder, name):
        theirs = AutoConfig.from_pretrained(folder, gguf_file=name)
        read = set(load_gguf_checkpoint(str(Path(folder) / name), return_tensors=False)["config"])
        extra_eos = eot_token_ids(Path(folder) / name)
        check = None
        if ours_dir is not None:
            ours = AutoConfig.from_pretrained(ours_dir)
            check = compare_configs(ours, theirs, read, extra_eos)
        fit_pad_token(theirs)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, config=theirs, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    eos = field_value(theirs, "eos_token_id", extra_eos)
    return GGUFReading(Path(path), theirs, tokenizer, read, eos, check), model
