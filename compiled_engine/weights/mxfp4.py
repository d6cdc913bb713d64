"""MXFP4 expert tensors (the published gpt-oss checkpoints) read exactly as int8 weights.

An MXFP4 tensor of [..., rows, in] weights is stored as `*_blocks` uint8 [..., rows, in / 32, 16]
and `*_scales` uint8 [..., rows, in / 32]: each block of 32 consecutive weights of a row holds 16
bytes, weight 2j in the low nibble of byte j and weight 2j + 1 in its high nibble, each nibble an
fp4 e2m1 value (sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6), and one e8m0 scale byte s meaning
2^(s - 127). Twice an e2m1 value is an integer in -12..12, so a block is exactly 32 int8 weights
with the scale 2^(s - 128): the int8 format of linear/quantized_weight.py with groups of 32, with
no rounding anywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from compiled_engine.linear.quantized_weight import QuantizedWeight

BLOCK = 32  # weights per scale
# Twice each e2m1 value, by its 4-bit code (codes 8-15: the same magnitudes negated).
DOUBLED_E2M1 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)


def mxfp4_as_int8(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """The weight of `blocks` uint8 [..., rows, groups, 16] and `scales` uint8 [..., rows, groups]
    as one int8 QuantizedWeight of groups of 32, its leading dims' rows stacked: [prod(...) * rows,
    groups * 32] (an experts tensor [experts, rows, ...] gives every expert's rows in turn)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks [..., rows, groups, {BLOCK // 2}] and scales [..., rows, groups] disagree: "
            f"{list(blocks.shape)} and {list(scales.shape)}"
        )
    groups = blocks.shape[-2]
    flat = blocks.reshape(-1, groups, BLOCK // 2)
    doubled = DOUBLED_E2M1.to(blocks.device)
    data = torch.stack((doubled[(flat & 0x0F).long()], doubled[(flat >> 4).long()]), dim=-1)  # [rows, g, 16, 2]
    exponents = scales.reshape(-1, groups).to(torch.int32) - 128
    weight_scales = torch.ldexp(torch.ones(exponents.shape, device=scales.device), exponents)
    return QuantizedWeight(
        "int8", data.reshape(flat.shape[0], groups * BLOCK), weight_scales, None, BLOCK, groups * BLOCK
    )


def install_mxfp4_experts(model: nn.Module, packed: dict[str, dict[str, torch.Tensor]], device: torch.device) -> None:
    """Replace each `Experts` module whose gate_up_proj and down_proj arrived as MXFP4 (`packed`:
    parameter name -> {"blocks": ..., "scales": ...}) with QuantizedExperts of their int8
    weights, keeping its loaded biases. The Experts' own weights were never allocated."""
    from compiled_engine.linear.quantize import install_experts
    from compiled_engine.linear.quantized_experts import QuantizedExperts
    from compiled_engine.model.moe import Experts

    for path in sorted({name.rpartition(".")[0] for name in packed}):
        experts = model.get_submodule(path)
        assert isinstance(experts, Experts), f"{path} is not a mixture's experts"
        gate_up, down = (
            mxfp4_as_int8(packed[f"{path}.{name}"]["blocks"].to(device), packed[f"{path}.{name}"]["scales"].to(device))
            for name in ("gate_up_proj", "down_proj")
        )
        biases = [None if b is None else b.detach() for b in (experts.gate_up_bias, experts.down_bias)]
        install_experts(model, path, QuantizedExperts(gate_up, down, experts.num_experts, experts.activation, *biases))
