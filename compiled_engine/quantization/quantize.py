"""Quantizing a dense weight at load time (round to nearest, no calibration data)."""

from __future__ import annotations

import torch

from compiled_engine.quantization.weights import (
    INT4_BLOCK,
    QuantizationError,
    QuantizedWeight,
    pack_int4,
)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8: per output channel (`group_size` None) or per group of `group_size`
    weights along the row. scale = max |w| / 127, q = round(w / scale)."""
    out, width = _check_matrix(weight)
    g = width if group_size is None else group_size
    if g < 1 or width % g != 0:
        raise QuantizationError(f"int8 group size {g} does not divide the row width {width}")
    groups = weight.detach().float().reshape(out, width // g, g)
    scales = groups.abs().amax(-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q.reshape(out, width), scales.contiguous(), None, g, width)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric int4 per group: offset = min, scale = (max - min) / 15, q = round((w - min) / scale),
    so each group's smallest and largest weights are exact."""
    out, width = _check_matrix(weight)
    if group_size % INT4_BLOCK != 0 or width % group_size != 0:
        raise QuantizationError(
            f"int4 group size {group_size} must be a multiple of {INT4_BLOCK} that divides the row width {width}"
        )
    groups = weight.detach().float().reshape(out, width // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = (high - low) / 15.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((groups - low[..., None]) / safe[..., None]).clamp_(0, 15)
    data = pack_int4(q.reshape(out, width))
    return QuantizedWeight("int4", data, scales.contiguous(), low.contiguous(), group_size, width)


def quantize(weight: torch.Tensor, fmt: str, group_size: int | None) -> QuantizedWeight:
    """`fmt` "int8" (group_size None: per channel) or "int4" (group_size None: 32)."""
    if fmt == "int8":
        return quantize_int8(weight, group_size)
    if fmt == "int4":
        return quantize_int4(weight, 32 if group_size is None else group_size)
    raise QuantizationError(f"unknown quantization format {fmt!r}: int8 or int4")


def _check_matrix(weight: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise QuantizationError(f"only 2-D floating-point weights quantize, got {weight.dtype} {list(weight.shape)}")
    return int(weight.shape[0]), int(weight.shape[1])
