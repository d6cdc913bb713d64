"""The ways a GGUF file is refused, one row each: every refusal of the header reader
(weights/gguf.py) and of the family mapping to a config (weights/gguf_config.py), and those of the
tokenizer built from the file's vocabulary (weights/gguf_tokenizer.py) and of the weight loader
(weights/gguf_loader.py) that no other module checks. Each row writes a small file here, byte by
byte, broken in one place, and expects the typed error a user gets from the entry point the engine
calls (`prepare_gguf_dir` for `--model file.gguf`, else the reader or the loader), with a message
that names the problem (and the file, from `prepare_gguf_dir`, which leaves nothing half-built in
the cache). The unbroken files are accepted (`test_the_unbroken_files_are_accepted`), so each row
is refused for its own break alone."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from compiled_engine.errors import ModelLoadError, ModelSourceError
from compiled_engine.model.registry import config_from_dict
from compiled_engine.weights.gguf import read_gguf_header
from compiled_engine.weights.gguf_config import gguf_config_dict
from compiled_engine.weights.gguf_dir import prepare_gguf_dir
from compiled_engine.weights.gguf_loader import load_gguf_model

# Metadata value types, and the ggml tensor types used here.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
F32, F64 = 0, 28
ALIGNMENT = 32

TOKENS = ["<|endoftext|>", "a", "b", "ab"]
FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


# --- writing GGUF files byte by byte ------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A metadata value given as its type number and encoded bytes: what no Python value spells."""

    type: int
    payload: bytes


@dataclass(frozen=True)
class Tensor:
    """One tensor directory entry and its data; `dims` in the file's order (torch's reversed),
    `offset` None for right after the previous tensor's data, aligned."""

    name: str
    dims: tuple[int, ...]
    data: bytes = b""
    type: int = F32
    offset: int | None = None


def f32(name: str, values: list[float]) -> Tensor:
    return Tensor(name, (len(values),), np.asarray(values, dtype=np.float32).tobytes())


def _string(text: str | bytes) -> bytes:
    raw = text if isinstance(text, bytes) else text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(value: Any) -> tuple[int, bytes]:
    """A metadata value's type and bytes: bytes as a string (of any encoding), an int as uint32,
    a float as float32, a list as an array of its first item's type."""
    if isinstance(value, Raw):
        return value.type, value.payload
    if isinstance(value, bool):
        return BOOL, struct.pack("<?", value)
    if isinstance(value, int):
        return UINT32, struct.pack("<I", value)
    if isinstance(value, float):
        return FLOAT32, struct.pack("<f", value)
    if isinstance(value, str | bytes):
        return STRING, _string(value)
    items = [_value(item) for item in value]
    item_type = items[0][0] if items else UINT32
    return ARRAY, struct.pack("<IQ", item_type, len(items)) + b"".join(payload for _, payload in items)


def gguf_bytes(
    metadata: Iterable[tuple[str | bytes, Any]],
    tensors: tuple[Tensor, ...] = (),
    *,
    magic: bytes = b"GGUF",
    version: bytes = struct.pack("<I", 3),
) -> bytes:
    """A GGUF file: header, metadata in the order given (a key may repeat), tensor directory,
    then the tensors' data from the first aligned byte after it (with no tensors, the file ends
    right after its metadata)."""
    pairs = list(metadata)
    out = bytearray(magic + version + struct.pack("<QQ", len(tensors), len(pairs)))
    for key, value in pairs:
        kind, payload = _value(value)
        out += _string(key) + struct.pack("<I", kind) + payload
    data = bytearray()
    for tensor in tensors:
        offset = len(data) if tensor.offset is None else tensor.offset
        out += _string(tensor.name) + struct.pack(f"<I{len(tensor.dims)}Q", len(tensor.dims), *tensor.dims)
        out += struct.pack("<IQ", tensor.type, offset)
        data += tensor.data + bytes(-len(tensor.data) % ALIGNMENT)
    if not tensors:  # nothing follows the metadata: the file ends there
        return bytes(out)
    return bytes(out + bytes(-len(out) % ALIGNMENT) + data)


def metadata_of(arch: str = "llama") -> dict[str, Any]:
    """A tiny model's metadata (two layers, hidden 64 in four heads of 16 over two kv heads) with
    a byte-level BPE vocabulary of four tokens."""
    return {
        "general.architecture": arch,
        f"{arch}.block_count": 2,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [3, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }


def phi3_factors(count: int = 8) -> tuple[Tensor, ...]:
    """Phi-3's longrope factors, one per rotated pair of its head of 16."""
    return tuple(f32(name, [1.0] * count) for name in FACTORS)


def write(
    tmp: Path,
    arch: str = "llama",
    changes: Mapping[str, Any] | None = None,
    *,
    drop: tuple[str, ...] = (),
    tensors: tuple[Tensor, ...] = (),
) -> Path:
    """The tiny model's file with metadata changed (or added) and dropped."""
    metadata = {key: value for key, value in metadata_of(arch).items() if key not in drop} | dict(changes or {})
    return write_bytes(tmp, gguf_bytes(metadata.items(), tensors))


def write_phi3(tmp: Path, tensors: tuple[Tensor, ...] | None = None) -> Path:
    """A Phi-3 file that declares longrope, with its factors unless `tensors` says otherwise."""
    changes = {"phi3.rope.scaling.attn_factor": 1.2}
    return write(tmp, "phi3", changes, tensors=phi3_factors() if tensors is None else tensors)


def write_bytes(tmp: Path, data: bytes) -> Path:
    path = tmp / "model.gguf"
    path.write_bytes(data)
    return path


# --- entry points ------------------------------------------------------------------------------------


def prepare(path: Path) -> object:
    """What `--model file.gguf` runs: the header, the config, the tokenizer."""
    return prepare_gguf_dir(path)


def read_then_shrink(path: Path) -> object:
    """The config of a header read before the file lost its last bytes (a download overwritten,
    a file truncated meanwhile): Phi-3's rope factors are read from the data."""
    header = read_gguf_header(path, ModelSourceError)
    path.write_bytes(path.read_bytes()[:-ALIGNMENT])
    return gguf_config_dict(header)


def load_as_mistral(path: Path) -> object:
    """The loader given a config of a family llama.cpp writes as another (Mistral, as llama)."""
    config = config_from_dict(gguf_config_dict(read_gguf_header(path, ModelSourceError)))
    return load_gguf_model(
        path, msgspec.structs.replace(config, architecture="mistral"), torch.float32, torch.device("cpu")
    )


# --- the refusals ------------------------------------------------------------------------------------


def _truncated_strings(tmp: Path) -> Path:
    # Two strings whose 16 length bytes are there, but the first string's text leaves too few
    # bytes for the second one's length.
    array = Raw(ARRAY, struct.pack("<IQ", STRING, 2) + _string("abcdefghi") + b"xyz")
    return write_bytes(tmp, gguf_bytes([("general.architecture", "llama"), ("tokenizer.ggml.tokens", array)]))


def _string_past_the_end(tmp: Path) -> Path:
    array = Raw(ARRAY, struct.pack("<IQ", STRING, 1) + struct.pack("<Q", 1000) + b"abcdefgh")
    return write_bytes(tmp, gguf_bytes([("general.architecture", "llama"), ("tokenizer.ggml.tokens", array)]))


@dataclass(frozen=True)
class Row:
    """A file `build` writes in the test's folder, refused by `entry` with `error` matching `match`."""

    build: Callable[[Path], Path]
    match: str
    error: type[Exception] = ModelSourceError
    entry: Callable[[Path], object] = prepare


HEADER_ROWS = {
    # Already tested in tests/test_gguf.py, here for completeness.
    "shorter-than-a-header": Row(
        lambda t: write_bytes(t, b"GGUF" + bytes(10)), r"it has only 14 bytes, less than a header \(truncated\?\)"
    ),
    "wrong-magic": Row(
        lambda t: write_bytes(t, gguf_bytes(metadata_of().items(), magic=b"GGML")),
        r"is not a GGUF file \(it starts with b'GGML', not b'GGUF'\)",
    ),
    "truncated-metadata": Row(
        lambda t: write_bytes(t, gguf_bytes(metadata_of().items())[:100]),
        r"it ends inside metadata 'llama.block_count' \(truncated\?\)",
    ),
    "truncated-directory": Row(
        lambda t: write_bytes(t, gguf_bytes(metadata_of().items(), phi3_factors())[:-80]),
        r"it ends inside tensor 'rope_factors_short.weight' \(truncated\?\)",
    ),
    "misaligned-offset": Row(
        lambda t: write(t, tensors=(Tensor("a.weight", (8,), bytes(32), offset=8),)),
        r"tensor 'a.weight' has offset 8, not a multiple of the alignment 32",
    ),
    "offset-past-the-end": Row(
        lambda t: write(t, tensors=(Tensor("a.weight", (8,), bytes(32), offset=1 << 20),)),
        r"tensor 'a.weight' starts at byte \d+, past the end \(\d+ bytes\)",
    ),
    # New.
    "directory": Row(lambda t: t, r"cannot read .*: .*Is a directory", ModelLoadError, read_gguf_header),
    "big-endian": Row(
        lambda t: write_bytes(t, gguf_bytes(metadata_of().items(), version=struct.pack(">I", 3))),
        r"is a big-endian GGUF file; only little-endian files are supported",
    ),
    "version-1": Row(
        lambda t: write_bytes(t, gguf_bytes(metadata_of().items(), version=struct.pack("<I", 1))),
        r"is GGUF version 1; supported: 2, 3$",
    ),
    "version-4": Row(
        lambda t: write_bytes(t, gguf_bytes(metadata_of().items(), version=struct.pack("<I", 4))),
        r"is GGUF version 4; supported: 2, 3$",
    ),
    "key-not-utf8": Row(
        lambda t: write_bytes(t, gguf_bytes([*metadata_of().items(), (b"general.\xffname", "x")])),
        r"is not a readable GGUF file: a metadata key is not UTF-8 text",
    ),
    "string-not-utf8": Row(
        lambda t: write(t, changes={"general.name": b"caf\xe9"}),
        r"is not a readable GGUF file: metadata 'general.name' is not UTF-8 text",
    ),
    "token-not-utf8": Row(
        lambda t: write(t, changes={"tokenizer.ggml.tokens": [*TOKENS[:3], b"\xc3("]}),
        r"metadata 'tokenizer.ggml.tokens' holds a string that is not UTF-8 text",
    ),
    "strings-truncated": Row(_truncated_strings, r"it ends inside metadata 'tokenizer.ggml.tokens' \(truncated\?\)"),
    "string-past-the-end": Row(
        _string_past_the_end, r"it ends inside metadata 'tokenizer.ggml.tokens' \(truncated\?\)"
    ),
    "unknown-value-type": Row(
        lambda t: write(t, changes={"general.name": Raw(13, b"tiny")}),
        r"metadata 'general.name' has unknown value type 13",
    ),
    "unknown-array-item-type": Row(
        lambda t: write(t, changes={"general.tags": Raw(ARRAY, struct.pack("<IQ", 99, 2) + bytes(16))}),
        r"metadata 'general.tags' has unknown value type 99",
    ),
    "duplicate-key": Row(
        lambda t: write_bytes(t, gguf_bytes([*metadata_of().items(), ("llama.block_count", 3)])),
        r"metadata key 'llama.block_count' appears twice",
    ),
    "no-dimensions": Row(lambda t: write(t, tensors=(Tensor("a.weight", ()),)), r"tensor 'a.weight' has 0 dimensions"),
    "five-dimensions": Row(
        lambda t: write(t, tensors=(Tensor("a.weight", (1, 1, 1, 1, 1), bytes(4)),)),
        r"tensor 'a.weight' has 5 dimensions",
    ),
    "alignment-not-a-power-of-two": Row(
        lambda t: write(t, changes={"general.alignment": 48}), r"general.alignment 48 is not a power of two"
    ),
    "alignment-not-an-int": Row(
        lambda t: write(t, changes={"general.alignment": "32"}), r"general.alignment '32' is not a power of two"
    ),
    "duplicate-tensor": Row(
        lambda t: write(t, tensors=(f32("a.weight", [1.0]), f32("a.weight", [2.0]))),
        r"tensor 'a.weight' appears twice",
    ),
    "data-cut-short": Row(
        write_phi3,
        r"tensor 'rope_factors_short.weight' in .* is cut short: the file changed or is truncated",
        entry=read_then_shrink,
    ),
}

FAMILY_ROWS = {
    # Already tested in tests/test_gguf.py and tests/test_gguf_families.py, here for completeness.
    "required-metadata-missing": Row(
        lambda t: write(t, drop=("llama.embedding_length",)), r"GGUF metadata 'llama.embedding_length' is missing"
    ),
    "unknown-architecture": Row(
        lambda t: write(t, "gpt2"),
        r"GGUF architecture 'gpt2' is not supported \(supported: llama, qwen2, qwen3, gemma2, gemma3, phi3, "
        r"qwen3moe, qwen2moe, olmoe, granitemoe, gpt-oss\)$",
    ),
    "partial-rotary-outside-phi3": Row(
        lambda t: write(t, "qwen2", {"qwen2.rope.dimension_count": 8}),
        r"rotary embedding over 8 of 16 dims is not supported for qwen2$",
    ),
    "rope-scaling-type": Row(
        lambda t: write(t, "qwen2", {"qwen2.rope.scaling.type": "yarn"}),
        r"rope scaling type 'yarn' is not supported for qwen2 \(only linear\)$",
    ),
    "longrope-without-factors": Row(
        lambda t: write_phi3(t, ()),
        r"it declares longrope \(phi3.rope.scaling.attn_factor\) but has neither rope_factors_long.weight nor "
        r"rope_factors_short.weight: the rope's factors are missing$",
    ),
    "longrope-with-one-factor-tensor": Row(
        lambda t: write_phi3(t, phi3_factors()[:1]),
        r"it has rope_factors_long.weight but not rope_factors_short.weight: longrope needs both$",
    ),
    # New.
    "architecture-missing": Row(
        lambda t: write(t, drop=("general.architecture",)), r"GGUF metadata 'general.architecture' is missing$"
    ),
    "metadata-of-another-type": Row(
        lambda t: write(t, changes={"llama.block_count": "2"}),
        r"GGUF metadata 'llama.block_count' must be int, got '2'$",
    ),
    "bool-for-an-int": Row(
        lambda t: write(t, changes={"llama.context_length": True}),
        r"GGUF metadata 'llama.context_length' must be int, got True$",
    ),
    "no-attention-heads": Row(
        lambda t: write(t, "gemma2", {"gemma2.attention.head_count": 0, "gemma2.block_count": 46}),
        r"0 attention heads of 64 dims each: both must be positive$",
    ),
    "heads-of-no-dims": Row(
        lambda t: write(t, changes={"llama.attention.key_length": 0, "llama.rope.dimension_count": 16}),
        r"4 attention heads of 0 dims each: both must be positive$",
    ),
    "mixture-of-experts": Row(
        lambda t: write(t, "qwen2", {"qwen2.expert_count": 8}),
        r"mixture-of-experts GGUF models \(qwen2.expert_count\) are not supported$",
    ),
    "kv-heads-per-layer": Row(
        lambda t: write(t, changes={"llama.attention.head_count_kv": [2, 1]}),
        r"GGUF metadata 'llama.attention.head_count_kv' must be one int, got \[2, 1\]$",
    ),
    "value-heads-of-another-size": Row(
        lambda t: write(t, changes={"llama.attention.value_length": 32}),
        r"value heads of 32 differ from key heads of 16$",
    ),
    "sliding-pattern-of-another-length": Row(
        lambda t: write(t, "gemma2", {"gemma2.attention.sliding_window_pattern": [True, False, True]}),
        r"'gemma2.attention.sliding_window_pattern' must hold one flag per layer$",
    ),
    "sliding-pattern-not-flags": Row(
        lambda t: write(t, "gemma2", {"gemma2.attention.sliding_window_pattern": [1, 0]}),
        r"'gemma2.attention.sliding_window_pattern' must hold one flag per layer$",
    ),
    "sliding-pattern-neither-period-nor-flags": Row(
        lambda t: write(
            t, "gemma3", {"gemma3.attention.sliding_window": 16, "gemma3.attention.sliding_window_pattern": "odd"}
        ),
        r"'gemma3.attention.sliding_window_pattern' must be a period or flags$",
    ),
    "gemma2-sliding-rope-base": Row(
        lambda t: write(t, "gemma2", {"gemma2.rope.freq_base": 10000.0, "gemma2.rope.freq_base_swa": 1e6}),
        r"a Gemma 2 sliding-layer rope base \(1000000.0\) other than the global one \(10000.0\) is not supported$",
    ),
    "longrope-factors-of-another-shape": Row(
        lambda t: write_phi3(t, phi3_factors(4)),
        r"tensor 'rope_factors_long.weight' has shape \[4\], the rope implies \[8\]$",
    ),
    "longrope-factors-of-an-unloaded-type": Row(
        lambda t: write_phi3(t, (*phi3_factors()[:1], Tensor(FACTORS[1], (8,), bytes(64), F64))),
        r"tensor 'rope_factors_short.weight' in model.gguf has type F64, which this engine does not load",
    ),
    "longrope-factors-past-the-end": Row(
        lambda t: write_bytes(t, write_phi3(t).read_bytes()[:-1]),
        r"tensor 'rope_factors_short.weight' in .* ends at byte \d+, past the end of the file",
    ),
}

TOKENIZER_ROWS = {
    # Already tested (on headers, not files) in tests/test_gguf_tokenizer.py, here for completeness.
    "tokenizer-model": Row(
        lambda t: write(t, changes={"tokenizer.ggml.model": "rwkv"}),
        r"its tokenizer model 'rwkv' \(tokenizer.ggml.model\) is not supported \(supported: gpt2, llama\)",
    ),
    "bos-without-its-id": Row(
        lambda t: write(t, changes={"tokenizer.ggml.add_bos_token": True}, drop=("tokenizer.ggml.bos_token_id",)),
        r"tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is not set",
    ),
    # New.
    "tokenizer-model-not-a-string": Row(
        lambda t: write(t, changes={"tokenizer.ggml.model": ["gpt2"]}),
        r"its tokenizer model \['gpt2'\] \(tokenizer.ggml.model\) is not supported \(supported: gpt2, llama\)",
    ),
    "pre-tokenizer-not-a-string": Row(
        lambda t: write(t, changes={"tokenizer.ggml.pre": ["qwen2"]}),
        r"pre-tokenizer \['qwen2'\] \(tokenizer.ggml.pre\) is not supported",
    ),
    "tokens-not-strings": Row(
        lambda t: write(t, changes={"tokenizer.ggml.tokens": [0, 1, 2, 3]}),
        r"tokenizer.ggml.tokens must be a list of strings$",
    ),
    "merges-not-strings": Row(
        lambda t: write(t, changes={"tokenizer.ggml.merges": 1}), r"tokenizer.ggml.merges must be a list of strings$"
    ),
    "eos-without-its-id": Row(
        lambda t: write(t, changes={"tokenizer.ggml.add_eos_token": True}, drop=("tokenizer.ggml.eos_token_id",)),
        r"tokenizer.ggml.add_eos_token is true but tokenizer.ggml.eos_token_id is not set",
    ),
    "scores-not-numbers": Row(
        lambda t: write(
            t,
            changes={"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": ["0", "1", "2", "3"]},
            drop=("tokenizer.ggml.merges",),
        ),
        r"tokenizer.ggml.scores must be numbers$",
    ),
}

LOADER_ROWS = {
    # New.
    "family-without-a-layout": Row(
        write, r"llama.cpp writes no GGUF of its own for mistral models", ModelLoadError, load_as_mistral
    ),
}

ROWS = HEADER_ROWS | FAMILY_ROWS | TOKENIZER_ROWS | LOADER_ROWS


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_refusal(row: Row, tmp_path: Path, private_cache: Path) -> None:
    path = row.build(tmp_path)
    with pytest.raises(row.error, match=row.match) as info:
        row.entry(path)
    if row.entry is prepare:
        assert path.name in str(info.value)  # the file is named
        built = private_cache / "models" / "gguf"
        assert not built.exists() or not any(built.iterdir())  # nothing half-built left behind


@pytest.mark.parametrize(
    "build",
    [write, lambda t: write(t, "gemma2"), lambda t: write(t, "gemma3"), write_phi3],
    ids=["llama", "gemma2", "gemma3", "phi3"],
)
def test_the_unbroken_files_are_accepted(build: Callable[[Path], Path], tmp_path: Path, private_cache: Path) -> None:
    path = build(tmp_path)
    assert (prepare_gguf_dir(path) / "config.json").is_file()
