"""GGUF's quantized block types as the engine's two formats (linear/quantized_weight.py), exactly.

Every type llama.cpp writes for the common files is integers times per-group constants, so each
becomes an int4 or int8 QuantizedWeight with no value changed: its `dequantize()` equals
gguf-py's `dequantize` bit for bit (the tests hold it to that). The constants are fp16 numbers
times small integers, exact in fp32, and each weight is then one fp32 multiply (and one add), in
the order gguf-py computes it.

| type | llama.cpp's meaning | here |
| --- | --- | --- |
| Q4_0 | `d * (q - 8)`, q 4-bit, blocks of 32 | int4, offset `-8 d` (the file's nibble bytes as they are) |
| Q4_1 | `d * q + m` | int4 (the file's nibble bytes) |
| Q5_0 | `d * (q - 16)`, q 5-bit | int8 `q - 16`, scale d |
| Q5_1 | `d * q + m`, q 5-bit | int8 q, scale d, offset m |
| Q8_0 | `d * q`, q int8 | int8 (the file's bytes) |
| IQ4_NL | `d * table[q]`, q 4-bit, a fixed table of 16 int8 | int8 `table[q]`, scale d |
| Q2_K | `(d * s) * q - dmin * m`, q 2-bit, 4-bit s and m per 16 | int8, groups of 16, offsets |
| Q3_K | `d * (s - 32) * q`, q 3-bit (-4..3), 6-bit s per 16 | int8, groups of 16 |
| Q4_K | `(d * s) * q - dmin * m`, q 4-bit, 6-bit s and m per 32 | int4, offset `-(dmin * m)` |
| Q5_K | as Q4_K with q 5-bit | int8, offsets |
| Q6_K | `(d * s) * q`, q 6-bit (-32..31), int8 s per 16 | int8, groups of 16 |
| IQ4_XS | `d * (s - 32) * table[q]`, 6-bit s per 32 | int8 `table[q]` |
| MXFP4 | `2^(e - 128) * table[q]`, an e8m0 byte e, q 4-bit e2m1 codes (table: twice their values) | int8 `table[q]`, scale `2^(e - 128)` |

The repack costs memory where a type's bits do not fit a format's (five or six bits held in a
byte, int8 groups of 16): docs/quantization.md lists the bytes each reads. Codebook types (IQ1,
IQ2, IQ3) and anything else are refused by weights/gguf.py before a byte is read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from compiled_engine.linear.quantized_weight import QuantizedWeight, pack_int4, unpack_int4
from compiled_engine.weights.gguf import (
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
)
from compiled_engine.weights.mxfp4 import DOUBLED_E2M1

# IQ4_NL's and IQ4_XS's 16 levels (ggml-common.h's kvalues_iq4nl).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, as fp32 [rows, blocks]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _bits(data: torch.Tensor, widths: int, count: int) -> torch.Tensor:
    """[..., n] bytes -> [..., count, n]: field k is (byte >> (widths * k)) & (2**widths - 1)."""
    shifts = torch.arange(0, widths * count, widths, dtype=torch.uint8).reshape(count, 1)
    return (data.unsqueeze(-2) >> shifts) & ((1 << widths) - 1)


def _flat(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.reshape(rows, -1).contiguous()


def _int8(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group: int) -> QuantizedWeight:
    rows = q.shape[0]
    width = q[0].numel()
    flat_offsets = None if offsets is None else _flat(offsets, rows)
    return QuantizedWeight("int8", _flat(q.to(torch.int8), rows), _flat(scales, rows), flat_offsets, group, width)


def _q8_0(b: torch.Tensor) -> QuantizedWeight:
    return _int8(b[..., 2:].contiguous().view(torch.int8), _half(b, 0), None, 32)


def _q4_0(b: torch.Tensor) -> QuantizedWeight:
    d, rows = _half(b, 0), b.shape[0]
    return QuantizedWeight("int4", _flat(b[..., 2:], rows), d, -8 * d, 32, b.shape[1] * 32)


def _q4_1(b: torch.Tensor) -> QuantizedWeight:
    rows = b.shape[0]
    return QuantizedWeight("int4", _flat(b[..., 4:], rows), _half(b, 0), _half(b, 2), 32, b.shape[1] * 32)


def _five_bits(high: torch.Tensor, nibbles: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 32 values a block: 4 bytes of high bits (bit i: value i) and 16 of nibbles."""
    tops = _bits(high, 1, 8).transpose(-1, -2).reshape(*high.shape[:-1], 32)
    return unpack_int4(nibbles) | (tops << 4)


def _q5_0(b: torch.Tensor) -> QuantizedWeight:
    q = _five_bits(b[..., 2:6], b[..., 6:22]).to(torch.int8) - 16
    return _int8(q, _half(b, 0), None, 32)


def _q5_1(b: torch.Tensor) -> QuantizedWeight:
    return _int8(_five_bits(b[..., 4:8], b[..., 8:24]), _half(b, 0), _half(b, 2), 32)


def _iq4_nl(b: torch.Tensor) -> QuantizedWeight:
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.int8)
    return _int8(levels[unpack_int4(b[..., 2:]).long()], _half(b, 0), None, 32)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> the 8 groups' 6-bit scales and mins, as fp32 [..., 8]."""
    d, m, both = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat((d & 63, (both & 15) | ((d >> 2) & 48)), dim=-1)
    mins = torch.cat((m & 63, (both >> 4) | ((m >> 2) & 48)), dim=-1)
    return scales.float(), mins.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 bytes -> 256 values 0..15: each 32 bytes hold a group in their low nibbles
    and the next group in their high nibbles."""
    return _bits(qs.reshape(*qs.shape[:-1], 4, 32), 4, 2).reshape(*qs.shape[:-1], 256)


def _q4_k(b: torch.Tensor) -> QuantizedWeight:
    rows = b.shape[0]
    scales, mins = _k_scales(b[..., 4:16])
    d = _half(b, 0)[..., None] * scales
    dm = _half(b, 2)[..., None] * mins
    values = _k_nibbles(b[..., 16:144])
    return QuantizedWeight(
        "int4", pack_int4(_flat(values, rows)), _flat(d, rows), _flat(-dm, rows), 32, b.shape[1] * 256
    )


def _q5_k(b: torch.Tensor) -> QuantizedWeight:
    scales, mins = _k_scales(b[..., 4:16])
    d = _half(b, 0)[..., None] * scales
    dm = _half(b, 2)[..., None] * mins
    tops = _bits(b[..., 16:48], 1, 8).reshape(*b.shape[:-1], 256)  # bit k of byte j: group k, value j
    return _int8(_k_nibbles(b[..., 48:176]) | (tops << 4), d, -dm, 32)


def _q6_k(b: torch.Tensor) -> QuantizedWeight:
    lead = b.shape[:-1]
    low = _bits(b[..., 0:128].reshape(*lead, 2, 64), 4, 2).reshape(*lead, 256)
    high = _bits(b[..., 128:192].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 256)
    q = (low | (high << 4)).to(torch.int8) - 32
    d = _half(b, 208)[..., None] * b[..., 192:208].contiguous().view(torch.int8).float()
    return _int8(q, d, None, 16)


def _q2_k(b: torch.Tensor) -> QuantizedWeight:
    lead = b.shape[:-1]
    packed = b[..., 0:16]
    dl = _half(b, 80)[..., None] * (packed & 15).float()
    ml = _half(b, 82)[..., None] * (packed >> 4).float()
    q = _bits(b[..., 16:80].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 256)
    return _int8(q, dl, -ml, 16)


def _q3_k(b: torch.Tensor) -> QuantizedWeight:
    lead = b.shape[:-1]
    packed = b[..., 96:108]
    low = _bits(packed[..., 0:8], 4, 2).reshape(*lead, 16)
    high = _bits(packed[..., 8:12], 2, 4).reshape(*lead, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    d = _half(b, 108)[..., None] * scales
    q = _bits(b[..., 32:96].reshape(*lead, 2, 32), 2, 4).reshape(*lead, 256).to(torch.int8)
    unset = 1 - _bits(b[..., 0:32], 1, 8).reshape(*lead, 256).to(torch.int8)  # a clear bit subtracts 4
    return _int8(q - 4 * unset, d, None, 16)


def _iq4_xs(b: torch.Tensor) -> QuantizedWeight:
    lead = b.shape[:-1]
    high = b[..., 2:4].contiguous().view(torch.int16).squeeze(-1).int()  # 2 bits per group, low first
    high = (high.unsqueeze(-1) >> torch.arange(0, 16, 2)) & 3
    low = _bits(b[..., 4:8], 4, 2).transpose(-1, -2).reshape(*lead, 8)  # byte k: groups 2k, 2k + 1
    scales = ((low.int() | (high << 4)) - 32).float()
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.int8)
    q = levels[unpack_int4(b[..., 8:136]).long()]
    return _int8(q, _half(b, 0)[..., None] * scales, None, 32)


def _mxfp4(b: torch.Tensor) -> QuantizedWeight:
    # The exponent byte first, then the nibbles in Q4_0's order (value j low, value j + 16 high);
    # twice an e2m1 value is an int8, so the scale 2^(e - 128) (gpt-oss's MXFP4 in weights/mxfp4.py).
    levels = DOUBLED_E2M1.to(b.device)
    exponents = b[..., 0].to(torch.int32) - 128
    return _int8(levels[unpack_int4(b[..., 1:]).long()], torch.ldexp(torch.ones(exponents.shape), exponents), None, 32)


DECODERS: dict[int, Callable[[torch.Tensor], QuantizedWeight]] = {
    Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0, IQ4_NL: _iq4_nl,
    Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k, IQ4_XS: _iq4_xs, MXFP4: _mxfp4,
}  # fmt: skip


def decode_blocks(blocks: torch.Tensor, ggml_type: int) -> QuantizedWeight:
    """A quantized tensor's blocks, uint8 [rows, blocks, block bytes] as weights/gguf.py reads them,
    as the QuantizedWeight [rows, blocks * block weights] that means the same values."""
    return DECODERS[ggml_type](blocks)
