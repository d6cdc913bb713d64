"""Quantizing at load: a dense weight (round to nearest, no calibration data), or a whole loaded
model from outside the model file (`quantize_model`), and installing weights that arrive quantized
(`install_linear`, `install_embedding`, used by the GGUF loader, weights/gguf_loader.py). Each weight
goes into the module of its form (`QuantizedLinear`, `QuantizedEmbedding`); which kernel then runs
each product is the kernel table's choice (linear/table.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compiled_engine.linear.install import replace
from compiled_engine.linear.quantized import QuantizedEmbedding, QuantizedLinear
from compiled_engine.linear.quantized_experts import QuantizedExperts
from compiled_engine.linear.quantized_weight import (
    INT4_BLOCK,
    INT4_GROUP_SIZES,
    QuantizationError,
    QuantizedWeight,
    pack_int4,
)
from compiled_engine.model.layers import DecoderModel, Linear
from compiled_engine.model.moe import Experts


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


HEAD_GROUP_SIZE = 32  # the head and the embedding, when quantized: int8 in groups of 32 (GGUF's Q8_0)


@dataclass(frozen=True)
class QuantizationScheme:
    """What to quantize at load. `format` "int8" (per output channel, or groups of `group_size`)
    or "int4" (groups of `group_size`, default 32). `head`: also the head and the embedding, as
    int8 in groups of 32 (with tied embeddings they are one table)."""

    format: str
    group_size: int | None = None
    head: bool = True

    def __post_init__(self) -> None:
        if self.format not in ("int8", "int4"):
            raise QuantizationError(f"a quantization scheme is int8 or int4, not {self.format!r}")
        if self.format == "int4" and self.group_size is not None and self.group_size not in INT4_GROUP_SIZES:
            raise QuantizationError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")
        if self.group_size is not None and self.group_size < 1:
            raise QuantizationError(f"group size must be positive, got {self.group_size}")


def quantize_model(model: DecoderModel, scheme: QuantizationScheme) -> DecoderModel:
    """Replace the layer products' Linear modules (q/k/v, o, gate/up, down) with QuantizedLinear,
    a mixture's experts with QuantizedExperts (every expert's rows in one weight), and with
    `scheme.head` the head and embedding too. Every weight is checked before any is replaced, so
    a refused shape leaves the model as it was."""
    planned: list[tuple[str, QuantizedWeight, torch.Tensor | None]] = []
    experts: list[tuple[str, QuantizedExperts]] = []
    for name, module in model.named_modules():
        try:
            if isinstance(module, Linear) and name != "lm_head":
                planned.append((name, quantize(module.weight, scheme.format, scheme.group_size), module.bias))
            elif isinstance(module, Experts):
                experts.append((name, quantize_experts(module, scheme)))
        except QuantizationError as error:
            raise QuantizationError(f"{name}: {error}") from error
    head = quantize_int8(model.lm_head.weight, HEAD_GROUP_SIZE) if scheme.head else None
    for name, weight, bias in planned:
        install_linear(model, name, weight, bias)
    for name, quantized in experts:
        install_experts(model, name, quantized)
    if head is not None:
        install_linear(model, "lm_head", head, model.lm_head.bias)
        if model.config.tie_word_embeddings:
            install_embedding(model, head)
        else:
            install_embedding(model, quantize_int8(model.embed_tokens.weight, HEAD_GROUP_SIZE))
    return model


def quantize_experts(experts: Experts, scheme: QuantizationScheme) -> QuantizedExperts:
    """Every expert's gate/up rows as one quantized weight, and every expert's down rows as
    another (each row quantized as a dense weight's would be)."""
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    return QuantizedExperts(
        quantize(gate_up.reshape(-1, gate_up.shape[-1]), scheme.format, scheme.group_size),
        quantize(down.reshape(-1, down.shape[-1]), scheme.format, scheme.group_size),
        experts.num_experts,
        experts.activation,
        None if experts.gate_up_bias is None else experts.gate_up_bias.detach(),
        None if experts.down_bias is None else experts.down_bias.detach(),
    )


def install_linear(model: nn.Module, name: str, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
    """Put a QuantizedLinear at module path `name` (for example "layers.0.mlp.down_proj")."""
    parent, _, child = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = getattr(owner, child)
    if tuple(old.weight.shape) != weight.shape:
        raise QuantizationError(f"{name}: a {list(weight.shape)} weight cannot replace {list(old.weight.shape)}")
    setattr(owner, child, QuantizedLinear(weight, bias))


def install_experts(model: nn.Module, name: str, experts: QuantizedExperts) -> None:
    """Put QuantizedExperts at module path `name` (for example "layers.0.mlp.experts")."""
    replace(model, name, experts)


def install_embedding(model: DecoderModel, weight: QuantizedWeight) -> None:
    if (weight.out_features, weight.in_features) != tuple(model.embed_tokens.weight.shape):
        raise QuantizationError(
            f"embed_tokens: a {list(weight.shape)} table cannot replace {list(model.embed_tokens.weight.shape)}"
        )
    model.embed_tokens = QuantizedEmbedding(weight)  # type: ignore[assignment]
