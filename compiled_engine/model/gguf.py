"""GGUF files: Llama and Qwen3 models as llama.cpp writes them, run with their quantized tensors
kept quantized.

`prepare_gguf_dir` turns a user's `.gguf` file into a model directory the rest of the engine
reads (config.json and tokenizer files from the GGUF's metadata, `model.gguf` a link to the file);
`load_gguf_model` fills the model from the file: Q8_0 becomes an int8 QuantizedWeight in groups of
32, Q4_0 and Q4_1 int4 in groups of 32 whose nibble bytes are the file's own, and F32, F16 and BF16
dense parameters. The file is parsed here, in plain Python, with every count and offset checked
against the file's size: nothing in it is executed, and the engine needs no GGUF library to run one.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from compiled_engine.cache_paths import models_dir
from compiled_engine.errors import CompiledEngineError, ModelConfigError, ModelLoadError, ModelSourceError
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.default_model import GGUF_NAME
from compiled_engine.model.llama import RotaryEmbedding, Transformer
from compiled_engine.quantization.apply import install_embedding, install_linear
from compiled_engine.quantization.weights import QuantizedWeight, concat_rows

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# ggml tensor types by number, for naming them; only the first six are loaded.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
DENSE_TYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
BLOCK = 32  # weights per block in Q8_0, Q4_0 and Q4_1
BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20}  # fp16 d (and for Q4_1 fp16 m), then the weights
SUPPORTED_TYPES = ", ".join(TYPE_NAMES[t] for t in (F32, F16, BF16, Q8_0, Q4_0, Q4_1))

# Metadata value types: their struct formats (little-endian), and the two composite ones.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def type_name(ggml_type: int) -> str:
    return TYPE_NAMES.get(ggml_type, f"type {ggml_type}")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry in a GGUF file. `shape` is in torch order ([out, in] for a weight, the
    reverse of the file's dimension list); `offset` is absolute in the file."""

    name: str
    shape: tuple[int, ...]
    type: int
    offset: int


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata and tensor directory, everything before the tensor data."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    alignment: int
    file_size: int

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None


class _Cursor:
    """Bounds-checked little-endian reads from the header bytes."""

    def __init__(self, data: mmap.mmap, path: Path, error: type[CompiledEngineError]) -> None:
        self.data, self.path, self.error, self.pos = data, path, error, 0

    def fail(self, what: str) -> CompiledEngineError:
        return self.error(f"{self.path} is not a readable GGUF file: {what}")

    def need(self, count: int, what: str) -> None:
        if count < 0 or self.pos + count > len(self.data):
            raise self.fail(f"it ends inside {what} (truncated?)")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        length = self.scalar("Q", what)
        self.need(length, what)
        raw = self.data[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8 text") from exc

    def value(self, value_type: int, what: str) -> Any:
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type], what)
        if value_type == _STRING:
            return self.string(what)
        if value_type != _ARRAY:
            raise self.fail(f"{what} has unknown value type {value_type}")
        item_type = self.scalar("I", what)
        count = self.scalar("Q", what)
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            size = struct.calcsize("<" + fmt) * count
            self.need(size, what)
            items = list(struct.unpack_from(f"<{count}{fmt}", self.data, self.pos))
            self.pos += size
            return items
        self.need(count * 8, what)  # every string or array item takes at least 8 bytes
        if item_type == _STRING:  # vocabularies: tens of thousands of strings, so read inline
            return self._strings(count, what)
        return [self.value(item_type, what) for _ in range(count)]

    def _strings(self, count: int, what: str) -> list[str]:
        data, pos, end, unpack = self.data, self.pos, len(self.data), struct.Struct("<Q").unpack_from
        items: list[str] = []
        try:
            for _ in range(count):
                (length,) = unpack(data, pos)
                pos += 8
                if pos + length > end:
                    raise self.fail(f"it ends inside {what} (truncated?)")
                items.append(data[pos : pos + length].decode("utf-8"))
                pos += length
        except struct.error as exc:
            raise self.fail(f"it ends inside {what} (truncated?)") from exc
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} holds a string that is not UTF-8 text") from exc
        self.pos = pos
        return items


def read_gguf_header(path: str | Path, error: type[CompiledEngineError] = ModelLoadError) -> GGUFHeader:
    """Parse a GGUF file's header: metadata and tensor directory, every length and offset checked
    against the file's size. Raises `error` (naming the file) for anything that is not a GGUF
    file of version 2 or 3, little-endian, whole."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise error(f"{path} is not a GGUF file: it has only {size} bytes, less than a header (truncated?)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse_header(data, path, size, error)
    except OSError as exc:
        raise error(f"cannot read {path}: {exc}") from exc


def _parse_header(data: mmap.mmap, path: Path, size: int, error: type[CompiledEngineError]) -> GGUFHeader:
    if data[:4] != MAGIC:
        raise error(f"{path} is not a GGUF file (it starts with {bytes(data[:4])!r}, not {MAGIC!r})")
    cursor = _Cursor(data, path, error)
    cursor.pos = 4
    version = cursor.scalar("I", "the version")
    if version & 0xFFFF == 0 and version != 0:
        raise error(f"{path} is a big-endian GGUF file; only little-endian files are supported")
    if version not in SUPPORTED_VERSIONS:
        raise error(f"{path} is GGUF version {version}; supported: {', '.join(map(str, SUPPORTED_VERSIONS))}")
    tensor_count = cursor.scalar("Q", "the tensor count")
    kv_count = cursor.scalar("Q", "the metadata count")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string("a metadata key")
        value_type = cursor.scalar("I", f"metadata '{key}'")
        if key in metadata:
            raise cursor.fail(f"metadata key '{key}' appears twice")
        metadata[key] = cursor.value(value_type, f"metadata '{key}'")
    entries: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = cursor.string("a tensor name")
        n_dims = cursor.scalar("I", f"tensor '{name}'")
        if not 1 <= n_dims <= 4:
            raise cursor.fail(f"tensor '{name}' has {n_dims} dimensions")
        dims = tuple(cursor.scalar("Q", f"tensor '{name}'") for _ in range(n_dims))
        ggml_type = cursor.scalar("I", f"tensor '{name}'")
        offset = cursor.scalar("Q", f"tensor '{name}'")
        entries.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1 or alignment & (alignment - 1):
        raise cursor.fail(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, shape, ggml_type, offset in entries:
        if name in tensors:
            raise cursor.fail(f"tensor '{name}' appears twice")
        if offset % alignment:
            raise cursor.fail(f"tensor '{name}' has offset {offset}, not a multiple of the alignment {alignment}")
        if data_start + offset > size:
            raise cursor.fail(f"tensor '{name}' starts at byte {data_start + offset}, past the end ({size} bytes)")
        tensors[name] = GGUFTensor(name, shape, ggml_type, data_start + offset)
    return GGUFHeader(path, version, metadata, tensors, alignment, size)


def gguf_file(model_dir: Path) -> Path | None:
    """The GGUF file a model directory's weights come from, if it has one."""
    path = Path(model_dir) / GGUF_NAME
    return path if path.is_file() else None


# --- config and tokenizer: prepare_gguf_dir -------------------------------------------------------


def _meta(header: GGUFHeader, key: str, kind: type, default: Any = None, required: bool = True) -> Any:
    value = header.metadata.get(key)
    if value is None:
        if required:
            raise ModelSourceError(f"{header.path}: GGUF metadata '{key}' is missing")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ModelSourceError(f"{header.path}: GGUF metadata '{key}' must be {kind.__name__}, got {value!r}")
    return value


def gguf_config_dict(header: GGUFHeader) -> dict[str, Any]:
    """The Hugging Face style config.json of a Llama or Qwen3 GGUF, from its metadata (and its
    tensor list: the head is tied when there is no `output.weight`)."""
    arch = _meta(header, "general.architecture", str)
    if arch not in ARCHITECTURES:
        raise ModelSourceError(
            f"{header.path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    if _meta(header, f"{arch}.expert_count", int, 0, required=False) > 0:
        raise ModelSourceError(f"{header.path}: mixture-of-experts GGUF models ({arch}.expert_count) are not supported")
    hidden = _meta(header, f"{arch}.embedding_length", int)
    heads = _meta(header, f"{arch}.attention.head_count", int)
    kv_heads = header.metadata.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list) and kv_heads and all(k == kv_heads[0] for k in kv_heads):
        kv_heads = kv_heads[0]  # a per-layer list, all the same
    if not isinstance(kv_heads, int) or isinstance(kv_heads, bool):
        raise ModelSourceError(
            f"{header.path}: GGUF metadata '{arch}.attention.head_count_kv' must be one int, got {kv_heads!r}"
        )
    rope_dims = _meta(header, f"{arch}.rope.dimension_count", int, required=False)
    head_dim = _meta(header, f"{arch}.attention.key_length", int, required=False)
    if head_dim is None:
        head_dim = rope_dims if rope_dims is not None else hidden // max(heads, 1)
    value_dim = _meta(header, f"{arch}.attention.value_length", int, head_dim, required=False)
    if value_dim != head_dim:
        raise ModelSourceError(f"{header.path}: value heads of {value_dim} differ from key heads of {head_dim}")
    if rope_dims is not None and rope_dims != head_dim:
        raise ModelSourceError(f"{header.path}: rotary embedding over {rope_dims} of {head_dim} dims is not supported")
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if isinstance(tokens, list) else _meta(header, f"{arch}.vocab_size", int)
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": [ARCHITECTURES[arch]],
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _meta(header, f"{arch}.feed_forward_length", int),
        "num_hidden_layers": _meta(header, f"{arch}.block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _meta(header, f"{arch}.attention.layer_norm_rms_epsilon", float),
        "rope_theta": _meta(header, f"{arch}.rope.freq_base", float, 10000.0, required=False),
        "max_position_embeddings": _meta(header, f"{arch}.context_length", int),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "attention_bias": "blk.0.attn_q.bias" in header.tensors,
    }
    scaling = _meta(header, f"{arch}.rope.scaling.type", str, "none", required=False)
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _meta(header, f"{arch}.rope.scaling.factor", float)}
    elif scaling != "none":
        raise ModelSourceError(f"{header.path}: rope scaling type {scaling!r} is not supported (only linear)")
    bos = _meta(header, "tokenizer.ggml.bos_token_id", int, required=False)
    eos = [
        token
        for token in (
            _meta(header, "tokenizer.ggml.eos_token_id", int, required=False),
            _meta(header, "tokenizer.ggml.eot_token_id", int, required=False),
        )
        if token is not None
    ]
    eos = list(dict.fromkeys(eos))  # one end of turn may be the end of text too
    if bos is not None:
        config["bos_token_id"] = bos
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def _cache_key(resolved: Path) -> str:
    stat = resolved.stat()
    return hashlib.sha256(f"{resolved}\n{stat.st_size}\n{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def _is_prepared(model_dir: Path, resolved: Path) -> bool:
    link = model_dir / GGUF_NAME
    return (
        (model_dir / "config.json").is_file()
        and (model_dir / "tokenizer.json").is_file()
        and link.is_file()
        and link.resolve() == resolved
    )


def prepare_gguf_dir(gguf_path: Path) -> Path:
    """The model directory for a user's `.gguf` file, built once in the engine cache (keyed by the
    file's path, size and modification time) and reused: config.json from the GGUF metadata,
    the tokenizer files (a tokenizer.json beside the file, else one built from the GGUF's
    vocabulary by transformers), generation_config.json, and `model.gguf` a link to the file.
    Built in a temporary directory renamed into place, so a directory that exists is complete."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ModelSourceError(f"GGUF file {path} does not exist")
    resolved = path.resolve()
    target = models_dir() / "gguf" / _cache_key(resolved)
    if _is_prepared(target, resolved):
        return target
    header = read_gguf_header(resolved, ModelSourceError)
    config = gguf_config_dict(header)
    try:
        ModelConfig.from_dict(config, source=f"{resolved} (its metadata)")
    except ModelConfigError as exc:
        raise ModelSourceError(str(exc)) from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as scratch_name:
        build = Path(scratch_name) / "model"
        build.mkdir()
        _write_json(build / "config.json", config)
        generation: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        pad = _meta(header, "tokenizer.ggml.padding_token_id", int, required=False)
        if pad is not None:
            generation["pad_token_id"] = pad
        _write_json(build / "generation_config.json", generation)
        _write_tokenizer(header, path.absolute(), build)
        (build / GGUF_NAME).symlink_to(resolved)
        if _is_prepared(target, resolved):  # another process finished first
            return target
        if target.exists():
            os.replace(target, Path(scratch_name) / "stale")  # incomplete or stale: dropped with the scratch
        try:
            os.replace(build, target)
        except OSError:
            if not _is_prepared(target, resolved):
                raise
    return target


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(header: GGUFHeader, source: Path, build: Path) -> None:
    # Beside the path as given, not the resolved one: a Hub snapshot's files are links into a
    # folder of blobs, and its tokenizer.json sits beside the link.
    beside = source.parent
    if (beside / "tokenizer.json").is_file():
        _check_beside_tokenizer(header, beside / "tokenizer.json")
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (beside / name).is_file():
                shutil.copyfile(beside / name, build / name)
    else:
        _convert_tokenizer(source, build)
    config_path = build / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    template = header.metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template and not config.get("chat_template"):
        config["chat_template"] = template
    for key in ("is_local", "local_files_only"):  # facts about the build, not the model
        config.pop(key, None)
    _write_json(config_path, config)


def _check_beside_tokenizer(header: GGUFHeader, tokenizer_path: Path) -> None:
    # A tokenizer.json of another model in the same folder would silently garble every prompt.
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        return
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # the Rust library raises plain Exception
        raise ModelSourceError(f"{tokenizer_path} beside {header.path.name} cannot be loaded: {exc}") from exc
    if size != len(tokens):
        raise ModelSourceError(
            f"{tokenizer_path} has {size} tokens but {header.path.name} a vocabulary of {len(tokens)}: "
            f"it belongs to another model; move it away to use the GGUF's own vocabulary"
        )


def _convert_tokenizer(path: Path, build: Path) -> None:
    hint = "pip install 'compiled_engine[convert]' (or put the model's tokenizer.json beside the .gguf file)"
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ModelSourceError(
            f"building a tokenizer from the vocabulary in {path.name} needs transformers: {hint}"
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(build)
    except ImportError as exc:
        raise ModelSourceError(f"building a tokenizer from {path.name} needs transformers and gguf: {hint}") from exc
    except Exception as exc:  # transformers and the tokenizers library raise many kinds
        raise ModelSourceError(f"cannot build a tokenizer from the vocabulary in {path}: {exc}") from exc
    if not (build / "tokenizer.json").is_file():
        raise ModelSourceError(f"transformers wrote no tokenizer.json for {path}")


# --- weights: load_gguf_model ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """A GGUF tensor the config implies: its name, torch-order shape, and for llama's q/k the head
    count of the rope permutation llama.cpp applied to its rows."""

    name: str
    shape: tuple[int, ...]
    rope_heads: int | None = None


@dataclass(frozen=True)
class _Target:
    """Where parts land: module `module`'s weight (parts stacked by rows) or, with `param` set,
    that dense parameter."""

    module: str
    parts: tuple[_Part, ...]
    param: str | None = None


ROPE_FREQS = "rope_freqs.weight"


def _targets(config: ModelConfig) -> list[_Target]:
    h, hd, inter, vocab = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    permuted = config.architecture == "llama"  # llama.cpp reorders q/k rows for its rope; not Qwen's
    q_heads = config.num_heads if permuted else None
    kv_heads = config.num_kv_heads if permuted else None
    P, T = _Part, _Target
    targets = [
        T("embed_tokens", (P("token_embd.weight", (vocab, h)),)),
        T("", (P("output_norm.weight", (h,)),), "norm.weight"),
    ]
    if not config.tie_word_embeddings:
        targets.append(T("lm_head", (P("output.weight", (vocab, h)),)))
    for i in range(config.num_layers):
        blk, ours = f"blk.{i}.", f"layers.{i}."
        attn = ours + "self_attn."
        targets.append(
            T(
                attn + "qkv_proj",
                (
                    P(blk + "attn_q.weight", (q, h), q_heads),
                    P(blk + "attn_k.weight", (kv, h), kv_heads),
                    P(blk + "attn_v.weight", (kv, h)),
                ),
            )
        )
        targets.append(T(attn + "o_proj", (P(blk + "attn_output.weight", (h, q)),)))
        if config.attention_bias:
            biases = (P(blk + "attn_q.bias", (q,), q_heads), P(blk + "attn_k.bias", (kv,), kv_heads))
            targets.append(T("", (*biases, P(blk + "attn_v.bias", (kv,))), attn + "qkv_proj.bias"))
            targets.append(T("", (P(blk + "attn_output.bias", (h,)),), attn + "o_proj.bias"))
        if config.qk_norm:
            targets.append(T("", (P(blk + "attn_q_norm.weight", (hd,)),), attn + "q_norm.weight"))
            targets.append(T("", (P(blk + "attn_k_norm.weight", (hd,)),), attn + "k_norm.weight"))
        gate_up = (P(blk + "ffn_gate.weight", (inter, h)), P(blk + "ffn_up.weight", (inter, h)))
        targets.append(T(ours + "mlp.gate_up_proj", gate_up))
        targets.append(T(ours + "mlp.down_proj", (P(blk + "ffn_down.weight", (h, inter)),)))
        targets.append(T("", (P(blk + "attn_norm.weight", (h,)),), ours + "input_layernorm.weight"))
        targets.append(T("", (P(blk + "ffn_norm.weight", (h,)),), ours + "post_attention_layernorm.weight"))
    return targets


def _tensor_bytes(info: GGUFTensor) -> int:
    if info.type in DENSE_TYPES:
        return math.prod(info.shape) * DENSE_TYPES[info.type].itemsize
    return math.prod(info.shape) // BLOCK * BLOCK_BYTES[info.type]


def _check(header: GGUFHeader, config: ModelConfig, targets: list[_Target]) -> dict[str, _Part]:
    """Every part's name, shape and type against the file, before a byte of data is read."""
    path = header.path
    arch = header.architecture
    if arch != config.architecture:
        raise ModelLoadError(f"{path} holds a {arch!r} model, the config a {config.architecture!r} one")
    parts = {part.name: part for target in targets for part in target.parts}
    optional = {ROPE_FREQS: _Part(ROPE_FREQS, (config.head_dim // 2,))} if arch == "llama" else {}
    for name in header.tensors:
        if name not in parts and name not in optional:
            raise ModelLoadError(
                f"unexpected tensor '{name}' in {path.name}: the {config.architecture} config has no such parameter"
            )
    missing = [name for name in parts if name not in header.tensors]
    if missing:
        shown = ", ".join(f"'{n}'" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{path}: missing tensors {shown}{more}")
    parts.update({name: part for name, part in optional.items() if name in header.tensors})
    spans: list[tuple[int, int, str]] = []
    for name, part in parts.items():
        info = header.tensors[name]
        if info.shape != part.shape:
            raise ModelLoadError(
                f"tensor '{name}' in {path.name} has shape {list(info.shape)}, the config implies {list(part.shape)}"
            )
        if info.type not in DENSE_TYPES and info.type not in BLOCK_BYTES:
            raise ModelLoadError(
                f"tensor '{name}' in {path.name} has type {type_name(info.type)}, which this engine does not "
                f"load (supported: {SUPPORTED_TYPES})"
            )
        if info.type in BLOCK_BYTES and (len(info.shape) != 2 or info.shape[-1] % BLOCK):
            raise ModelLoadError(
                f"tensor '{name}' in {path.name} is {type_name(info.type)} with shape {list(info.shape)}: "
                f"quantized tensors must be matrices whose rows are whole blocks of {BLOCK}"
            )
        end = info.offset + _tensor_bytes(info)
        if end > header.file_size:
            raise ModelLoadError(
                f"tensor '{name}' in {path} ends at byte {end}, past the end of the file "
                f"({header.file_size} bytes): the file is truncated or its offsets are wrong"
            )
        spans.append((info.offset, end, name))
    spans.sort()
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise ModelLoadError(f"tensors '{name}' and '{other}' in {path} overlap: its offsets are wrong")
    return parts


Weight = QuantizedWeight | torch.Tensor


def _read(f: io.BufferedReader, header: GGUFHeader, part: _Part) -> Weight:
    """One tensor from the file, on the CPU: a QuantizedWeight for Q8_0/Q4_0/Q4_1, else a dense
    tensor of the file's own dtype; llama's q/k rows put back in Hugging Face order."""
    info = header.tensors[part.name]
    buffer = bytearray(_tensor_bytes(info))
    f.seek(info.offset)
    if f.readinto(buffer) != len(buffer):
        raise ModelLoadError(f"tensor '{part.name}' in {header.path} is cut short: the file changed or is truncated")
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    dense = DENSE_TYPES.get(info.type)
    weight = _quantized(raw, info) if dense is None else raw.view(dense).reshape(info.shape)
    return weight if part.rope_heads is None else _unpermute(weight, part.rope_heads)


def _quantized(raw: torch.Tensor, info: GGUFTensor) -> QuantizedWeight:
    rows, width = info.shape
    blocks = raw.reshape(rows, width // BLOCK, BLOCK_BYTES[info.type])

    def half(start: int) -> torch.Tensor:  # an fp16 field of every block, as fp32 [rows, blocks]
        return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()

    d = half(0)
    if info.type == Q8_0:
        data = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, width)
        return QuantizedWeight("int8", data, d, None, BLOCK, width)
    if info.type == Q4_0:  # d * (q - 8)
        return QuantizedWeight("int4", blocks[..., 2:].reshape(rows, width // 2), d, -8 * d, BLOCK, width)
    return QuantizedWeight("int4", blocks[..., 4:].reshape(rows, width // 2), d, half(2), BLOCK, width)  # Q4_1


def _unpermute(weight: Weight, heads: int) -> Weight:
    # llama.cpp stores each head's rows interleaved (pairs of the two rotary halves): row
    # h*d + 2j + s of the file is row h*d + s*d/2 + j of the Hugging Face weight.
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(weight, torch.Tensor):
        return weight[order]
    offsets = None if weight.offsets is None else weight.offsets[order]
    return QuantizedWeight(
        weight.format, weight.data[order], weight.scales[order], offsets, weight.group_size, weight.in_features
    )


def _dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    return weight.dequantize(dtype) if isinstance(weight, QuantizedWeight) else weight.to(dtype)


def _fuse(weights: list[Weight], dtype: torch.dtype, dequantize: bool) -> Weight:
    """Parts stacked by rows: quantized when every part is of one format and group (with
    `dequantize`, that stack dequantized: the same rows, one conversion), else dense."""
    if all(isinstance(w, QuantizedWeight) for w in weights):
        quantized = cast(list[QuantizedWeight], weights)
        first = quantized[0]
        if all((w.format, w.group_size) == (first.format, first.group_size) for w in quantized):
            stacked = first if len(quantized) == 1 else concat_rows(quantized)
            return stacked.dequantize(dtype) if dequantize else stacked
    dense = [_dense(w, dtype) for w in weights]
    return dense[0] if len(dense) == 1 else torch.cat(dense)


def load_gguf_model(
    gguf_path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    dequantize: bool = False,
) -> Transformer:
    """Build the model on the meta device and fill it from a GGUF file: Q8_0, Q4_0 and Q4_1
    tensors stay quantized (QuantizedLinear, and QuantizedEmbedding for the embedding, which a tied
    head shares), F32/F16/BF16 become dense parameters of `dtype`. With `dequantize`, every
    weight is dense, dequantized exactly as QuantizedWeight.dequantize() does. Names, shapes, types
    and offsets are all checked before any tensor is read."""
    path = Path(gguf_path)
    header = read_gguf_header(path)
    targets = _targets(config)
    parts = _check(header, config, targets)
    with torch.device("meta"):
        model = Transformer(config)
    params: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    with path.open("rb") as f:
        for target in targets:
            weight = _fuse([_read(f, header, part) for part in target.parts], dtype, dequantize)
            if target.param is not None:
                params[target.param] = _dense(weight, dtype).to(device)
            elif isinstance(weight, QuantizedWeight):
                quantized[target.module] = weight.to(device)
            else:
                params[target.module + ".weight"] = weight.to(device)
        rope_freqs = _read(f, header, parts[ROPE_FREQS]) if ROPE_FREQS in parts else None
    for module, weight in quantized.items():
        if module == "embed_tokens":
            install_embedding(model, weight)
        else:
            install_linear(model, module, weight, params.pop(module + ".bias", None))
    model.load_state_dict(params, strict=False, assign=True)
    if config.tie_word_embeddings:
        if isinstance(model.embed_tokens, nn.Embedding):
            model.lm_head.weight = cast(nn.Parameter, model.embed_tokens.weight)  # one tensor, as in the file
        else:
            install_linear(model, "lm_head", model.embed_tokens.weight)  # the same quantized table
    model.rotary = RotaryEmbedding(config.rope, config.head_dim).to(device)
    if rope_freqs is not None:
        _apply_rope_freqs(model, config, rope_freqs, path)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"{path}: nothing was loaded into {', '.join(left[:5])}")
    return model.eval()


def _apply_rope_freqs(model: Transformer, config: ModelConfig, rope_freqs: Weight, path: Path) -> None:
    # Llama 3.1's rope scaling as llama.cpp stores it: one divisor per rotary frequency.
    if config.rope.type != "default":
        raise ModelLoadError(f"{path} has {ROPE_FREQS} and the config rope scaling {config.rope.type!r}: both scale")
    divisors = _dense(rope_freqs, torch.float32).to(model.rotary.inv_freq.device)
    model.rotary.inv_freq = model.rotary.inv_freq / divisors
