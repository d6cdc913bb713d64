"""GGUF files as llama.cpp writes them: the format, read in plain Python.

The header (version, metadata, tensor directory) is parsed with every count, length and offset
checked against the file's size; nothing in it is executed, and the engine needs no GGUF library
to run one. A tensor's data is read as its bytes, checked for its type and extent
(`check_tensor`, `check_no_overlaps`): a dense tensor of the file's dtype, or its quantized
blocks as bytes, which weights/gguf_blocks.py decodes. What the tensors mean for a model is
elsewhere: the model directory in weights/gguf_dir.py, the weights in weights/gguf_loader.py.
"""

from __future__ import annotations

import io
import itertools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compiled_engine.errors import CompiledEngineError, ModelLoadError
from compiled_engine.weights.default_model import GGUF_NAME

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml tensor types by number, for naming them; BLOCK_TYPES and DENSE_TYPES are those loaded.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 0, 1, 2, 3, 6, 7, 8, 30
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4 = 10, 11, 12, 13, 14, 20, 23, 39
TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
DENSE_TYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
# The quantized types loaded: (weights, bytes) per block; the k-quants' super-blocks are 256 wide.
BLOCK_TYPES = {
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34), IQ4_NL: (32, 18),
    Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), IQ4_XS: (256, 136),
    MXFP4: (32, 17),
}  # fmt: skip
SUPPORTED_TYPES = ", ".join(TYPE_NAMES[t] for t in (*DENSE_TYPES, *BLOCK_TYPES))

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


def tensor_bytes(info: GGUFTensor) -> int:
    if info.type in DENSE_TYPES:
        return math.prod(info.shape) * DENSE_TYPES[info.type].itemsize
    weights, nbytes = BLOCK_TYPES[info.type]
    return math.prod(info.shape) // weights * nbytes


def check_tensor(header: GGUFHeader, name: str) -> tuple[int, int]:
    """That tensor `name` is of a type this engine loads, in whole blocks, and inside the file;
    returns the span of its bytes, (start, end)."""
    path, info = header.path, header.tensors[name]
    if info.type not in DENSE_TYPES and info.type not in BLOCK_TYPES:
        raise ModelLoadError(
            f"tensor '{name}' in {path.name} has type {type_name(info.type)}, which this engine does not "
            f"load (supported: {SUPPORTED_TYPES})"
        )
    if info.type in BLOCK_TYPES:
        weights = BLOCK_TYPES[info.type][0]
        if len(info.shape) < 2 or info.shape[-1] % weights:
            raise ModelLoadError(
                f"tensor '{name}' in {path.name} is {type_name(info.type)} with shape {list(info.shape)}: "
                f"quantized tensors must be matrices (or stacks of them) whose rows are whole blocks of {weights}"
            )
    end = info.offset + tensor_bytes(info)
    if end > header.file_size:
        raise ModelLoadError(
            f"tensor '{name}' in {path} ends at byte {end}, past the end of the file "
            f"({header.file_size} bytes): the file is truncated or its offsets are wrong"
        )
    return info.offset, end


def check_no_overlaps(header: GGUFHeader, spans: list[tuple[int, int, str]]) -> None:
    """That no two tensors' bytes, (start, end, name), overlap."""
    spans = sorted(spans)
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise ModelLoadError(f"tensors '{name}' and '{other}' in {header.path} overlap: its offsets are wrong")


def read_tensor(f: io.BufferedReader, header: GGUFHeader, name: str) -> torch.Tensor:
    """Tensor `name`'s bytes from the open file, on the CPU: a dense tensor of the file's own
    dtype, or (a quantized type) its blocks as uint8 [rows, blocks, block bytes], the rows of a
    stack of matrices (a mixture's experts, [experts, rows, in]) one after another."""
    info = header.tensors[name]
    buffer = bytearray(tensor_bytes(info))
    f.seek(info.offset)
    if f.readinto(buffer) != len(buffer):
        raise ModelLoadError(f"tensor '{name}' in {header.path} is cut short: the file changed or is truncated")
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    dense = DENSE_TYPES.get(info.type)
    if dense is not None:
        return raw.view(dense).reshape(info.shape)
    width = info.shape[-1]
    weights, nbytes = BLOCK_TYPES[info.type]
    return raw.reshape(-1, width // weights, nbytes)
