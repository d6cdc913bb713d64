"""Quantized weight matrices: plain tensors on any device, and what they mean.

Two formats cover every scheme the engine runs, each with groups of `group_size` consecutive
weights along a row (the input dimension) sharing fp32 constants:

- **int8**: `w = scale * q`, q int8, or with offsets `w = scale * q + offset`. Per output channel
  is one group the width of the row; GGUF's Q8_0 is groups of 32, and the GGUF types of five or
  six bits and the k-quants' groups of 16 are int8 too (weights/gguf_blocks.py).
- **int4, asymmetric**: `w = scale * q + offset`, q in 0..15. GGUF's Q4_1 is exactly this with
  groups of 32 (its fp16 d and m are the scale and the offset), and Q4_0 is `d * (q - 8)`, that is
  offset `-8 d`.

int4 weights are packed two to a byte in blocks of 32 weights, as GGUF lays them out: byte j of a
block holds weight j in its low nibble and weight j + 16 in its high nibble. So a GGUF block's
bytes are used as they are, and the group size of int4 is a multiple of 32.

`dequantize()` is the meaning of a weight: the reference path every kernel is tested against is
`F.linear(x, weight.dequantize())`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

INT4_BLOCK = 32  # weights per packed block: 16 bytes of nibbles
INT4_GROUP_SIZES = (32, 64, 128)
FORMATS = ("int8", "int4")


class QuantizationError(ValueError):
    """A weight that cannot be quantized in the asked format (shape, group), or tensors that do
    not describe a quantized weight."""


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A quantized [out_features, in_features] matrix.

    int8: `data` int8 [out, in]; int4: `data` uint8 [out, in / 2], packed in blocks of 32.
    `scales` and `offsets` (required for int4, optional for int8) fp32 [out, in / group_size].
    """

    format: str  # "int8" or "int4"
    data: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    in_features: int

    @classmethod
    def of_tensors(
        cls, data: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group_size: int
    ) -> QuantizedWeight:
        """The weight a module's buffers or an operator's arguments hold (int8 data: the int8
        format; uint8: int4), unchecked: it was checked where it was made, and this runs per
        forward (a check would cost a few microseconds a product) and while torch.compile traces."""
        weight = cls.__new__(cls)
        int4 = data.dtype == torch.uint8
        weight.__dict__.update(
            format="int4" if int4 else "int8", data=data, scales=scales, offsets=offsets, group_size=group_size,
            in_features=data.shape[1] * (2 if int4 else 1),
        )  # fmt: skip
        return weight

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise QuantizationError(f"not a valid {self.format} weight: {problem}")

    def _problem(self) -> str | None:
        out, g, width = self.out_features, self.group_size, self.in_features
        if self.format not in FORMATS:
            return f"format must be one of {FORMATS}"
        if g < 1 or width % g != 0:
            return f"group size {g} does not divide the row width {width}"
        if self.format == "int8":
            if self.data.dtype != torch.int8 or tuple(self.data.shape) != (out, width):
                return f"data must be int8 [{out}, {width}], got {self.data.dtype} {list(self.data.shape)}"
        else:
            if g % INT4_BLOCK != 0:
                return f"int4 groups are whole blocks of {INT4_BLOCK} weights, not {g}"
            if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (out, width // 2):
                return f"data must be uint8 [{out}, {width // 2}], got {self.data.dtype} {list(self.data.shape)}"
            if self.offsets is None:
                return "int4 weights need offsets"
        for name, t in (("scales", self.scales), ("offsets", self.offsets)):
            if t is None:
                continue
            if t.dtype != torch.float32 or tuple(t.shape) != (out, width // g):
                return f"{name} must be float32 [{out}, {width // g}], got {t.dtype} {list(t.shape)}"
            if t.device != self.data.device:
                return f"{name} are on {t.device}, the data on {self.data.device}"
        return None

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held: data, scales and offsets."""
        tensors = [self.data, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense [out, in] matrix (computed in fp32, then cast)."""
        return dequantize_rows(self, None).to(dtype)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` dequantized to fp32 (an embedding lookup reads only these)."""
        return dequantize_rows(self, index)

    def __getitem__(self, rows: torch.Tensor) -> QuantizedWeight:
        """Output rows `rows`, in that order (copies), as a dense matrix's `weight[rows]`."""
        offsets = None if self.offsets is None else self.offsets[rows]
        return QuantizedWeight(
            self.format, self.data[rows], self.scales[rows], offsets, self.group_size, self.in_features
        )

    def narrow_rows(self, start: int, count: int) -> QuantizedWeight:
        """Output rows start..start+count (views)."""
        offsets = None if self.offsets is None else self.offsets.narrow(0, start, count)
        return QuantizedWeight(
            self.format,
            self.data.narrow(0, start, count),
            self.scales.narrow(0, start, count),
            offsets,
            self.group_size,
            self.in_features,
        )

    def narrow_cols(self, start: int, count: int) -> QuantizedWeight:
        """Input columns start..start+count (a tensor-parallel rank's share of a row-parallel
        product), copied contiguous; both must be whole groups."""
        g = self.group_size
        if start % g or count % g or start < 0 or count < 1 or start + count > self.in_features:
            raise QuantizationError(
                f"columns {start}..{start + count} of a weight {self.in_features} wide are not whole groups of {g}"
            )
        per_byte = 2 if self.format == "int4" else 1

        def cols(t: torch.Tensor, unit: int) -> torch.Tensor:
            return t.narrow(1, start // unit, count // unit).contiguous()

        offsets = None if self.offsets is None else cols(self.offsets, g)
        return QuantizedWeight(self.format, cols(self.data, per_byte), cols(self.scales, g), offsets, g, count)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        offsets = None if self.offsets is None else self.offsets.to(device)
        return QuantizedWeight(
            self.format,
            self.data.to(device),
            self.scales.to(device),
            offsets,
            self.group_size,
            self.in_features,
        )


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one width along the output rows (q, k and v into one qkv weight; gate and
    up into gate_up). Weights of different formats or groups meet in a common one, exactly: int4
    rows become int8 rows of the same values (when any part is int8), groups are split to the
    largest that divides every part's (each constant repeated), and a part without offsets gets
    zero ones when another has them. A GGUF file often quantizes q, k and v differently."""
    first = weights[0]
    for w in weights[1:]:
        if w.in_features != first.in_features:
            raise QuantizationError(
                f"cannot stack a weight of width {w.in_features} onto one of width {first.in_features}"
            )
    fmt = "int8" if any(w.format == "int8" for w in weights) else "int4"
    group = math.gcd(*(w.group_size for w in weights))
    if (fmt == "int8" and group % 8) or (fmt == "int4" and group % INT4_BLOCK):
        raise QuantizationError(
            f"cannot stack {fmt} weights of groups {sorted({w.group_size for w in weights})}: no common group"
        )
    offsets_wanted = fmt == "int4" or any(w.offsets is not None for w in weights)
    parts = [_as_form(w, fmt, group, offsets_wanted) for w in weights]
    offsets = None
    if offsets_wanted:
        offsets = torch.cat([w.offsets for w in parts if w.offsets is not None])
    return QuantizedWeight(
        fmt,
        torch.cat([w.data for w in parts]),
        torch.cat([w.scales for w in parts]),
        offsets,
        group,
        first.in_features,
    )


def _as_form(weight: QuantizedWeight, fmt: str, group: int, offsets: bool) -> QuantizedWeight:
    """The same weight as `fmt` in groups of `group` (which divides its own), with offsets when
    `offsets` (zero where it had none): every dequantized value unchanged."""
    data, scales, offs = weight.data, weight.scales, weight.offsets
    if weight.format != fmt:  # int4 -> int8: the same values 0..15
        data = unpack_int4(data).to(torch.int8)
    split = weight.group_size // group
    if split > 1:
        scales = scales.repeat_interleave(split, dim=1)
        offs = None if offs is None else offs.repeat_interleave(split, dim=1)
    if offsets and offs is None:
        offs = torch.zeros_like(scales)
    return QuantizedWeight(fmt, data, scales, offs, group, weight.in_features)


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """uint8 [..., in / 2] packed in blocks of 32 -> the values 0..15 as uint8 [..., in]."""
    lead = data.shape[:-1]
    blocks = data.reshape(*lead, -1, INT4_BLOCK // 2)
    low, high = blocks & 15, blocks >> 4
    return torch.cat((low, high), dim=-1).reshape(*lead, -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, in] with values 0..15 (in a multiple of 32) -> the packed [rows, in / 2]."""
    rows = values.shape[0]
    blocks = values.to(torch.uint8).reshape(rows, -1, INT4_BLOCK)
    half = INT4_BLOCK // 2
    return (blocks[..., :half] | (blocks[..., half:] << 4)).reshape(rows, -1)


def dequantize_rows(weight: QuantizedWeight, index: torch.Tensor | None) -> torch.Tensor:
    """fp32 rows `index` of `weight` (all rows for None), in plain torch: the reference."""
    data, scales, offsets = weight.data, weight.scales, weight.offsets
    if index is not None:
        data, scales = data[index], scales[index]
        offsets = None if offsets is None else offsets[index]
    q = unpack_int4(data) if weight.format == "int4" else data
    lead, width = q.shape[:-1], q.shape[-1]
    grouped = q.reshape(*lead, width // weight.group_size, weight.group_size).float() * scales[..., None]
    if offsets is not None:
        grouped = grouped + offsets[..., None]
    return grouped.reshape(*lead, width)
