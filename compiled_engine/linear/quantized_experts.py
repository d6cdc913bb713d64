"""A mixture's experts kept quantized (`QuantizedExperts`, which replaces the model's `Experts`
module from outside the model file, as `QuantizedLinear` replaces `Linear`), and their operator
`compiled_engine::quantized_expert_mlps_f32` (linear/kernels/quant_op.cpp): on the CPU, one call
a layer sorts the batch's (token, expert) pairs by expert and runs every chosen expert's products
straight from its quantized bytes, the experts with few rows (decode) as one parallel loop over
(expert, strip of rows), those with many one after the other through the many-row kernels.
Elsewhere, or without a compiler, `compiled_engine::quantized_expert_mlps` runs the grouped loop
of experts/op.py with each expert's slice through the quantized product (linear/quantized_op.py).
Both are held to experts/op.py's reference loop on the dequantized weights
(`QuantizedExperts.dense`). The C++ operator also adds expert biases and runs gpt-oss's clamped
SwiGLU (its constants, SWIGLU_ALPHA and SWIGLU_LIMIT, are the C++ code's too)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from compiled_engine.experts.op import SWIGLU_OAI, glu, grouped
from compiled_engine.linear.crossover import RowCrossover
from compiled_engine.linear.quantized_op import native_operator, quantized_linear
from compiled_engine.linear.quantized_weight import QuantizedWeight

torch.library.define(
    "compiled_engine::quantized_expert_mlps",
    "(Tensor x, Tensor weights, Tensor ids, Tensor gate_up_data, Tensor gate_up_scales, Tensor? gate_up_offsets, "
    "int gate_up_group, Tensor down_data, Tensor down_scales, Tensor? down_offsets, int down_group, "
    "int num_experts, str activation, Tensor? gate_up_bias=None, Tensor? down_bias=None) -> Tensor",
)


@torch.library.impl("compiled_engine::quantized_expert_mlps", "CompositeExplicitAutograd")
def _quantized_expert_mlps(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up_data: torch.Tensor,
    gate_up_scales: torch.Tensor,
    gate_up_offsets: torch.Tensor | None,
    gate_up_group: int,
    down_data: torch.Tensor,
    down_scales: torch.Tensor,
    down_offsets: torch.Tensor | None,
    down_group: int,
    num_experts: int,
    activation: str,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    gate_up = QuantizedWeight.of_tensors(gate_up_data, gate_up_scales, gate_up_offsets, gate_up_group)
    down = QuantizedWeight.of_tensors(down_data, down_scales, down_offsets, down_group)
    native = native_operator() if x.device.type == "cpu" else None
    per_gate_up, per_down = gate_up.out_features // num_experts, down.out_features // num_experts

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        b1 = None if gate_up_bias is None else gate_up_bias[e]
        b2 = None if down_bias is None else down_bias[e]
        h = glu(activation, quantized_linear(rows, gate_up.narrow_rows(e * per_gate_up, per_gate_up), b1, native))
        return quantized_linear(h, down.narrow_rows(e * per_down, per_down), b2, native)

    return grouped(x, weights, ids, num_experts, per_down, mlp)


@torch.library.register_fake("compiled_engine::quantized_expert_mlps")
def _quantized_expert_mlps_fake(x: torch.Tensor, *rest: Any) -> torch.Tensor:
    return x.new_empty(x.shape)


# The rows an expert takes on the direct kernel's strips (all chosen experts in one parallel loop)
# before the many-row kernels (one expert after another). Measured on a layer of Granite-1B-A400M's
# shape in Q4_K_M (docs/benchmarks.md, 2026-12-08): at 16 tokens (about 4 rows an expert, some 8
# or more) 16 rows direct took 5.0 ms a layer against 6.5 with the dense products' default 4; at
# 4 and 64 tokens the two were within 3%.
EXPERT_CROSSOVER = RowCrossover(16, 64)

# The C++ operator's codes of the experts' activations.
NATIVE_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, SWIGLU_OAI: 2}


def native_experts_operator() -> torch._ops.OpOverload | None:
    """`compiled_engine::quantized_expert_mlps_f32` (linear/kernels/quant_op.cpp), or None when the
    native operator cannot be built (the Python loop below then runs the same kernels)."""
    if native_operator() is None:
        return None
    _register_native_fake()
    op: torch._ops.OpOverload = torch.ops.compiled_engine.quantized_expert_mlps_f32.default
    return op


@functools.cache
def _register_native_fake() -> None:
    torch.library.register_fake("compiled_engine::quantized_expert_mlps_f32")(_quantized_expert_mlps_fake)


class QuantizedExperts(nn.Module):
    """A mixture's experts as two quantized weights: `gate_up` holds every expert's gate and up
    rows (expert e's 2 * inter rows from e * 2 * inter, gate first), `down` every expert's down
    rows (expert e's `hidden` rows from e * hidden). Each is one QuantizedWeight, so an expert's
    slice is a view and the quantized product's kernels run on it as they are."""

    gate_up_data: torch.Tensor
    gate_up_scales: torch.Tensor
    gate_up_offsets: torch.Tensor | None
    down_data: torch.Tensor
    down_scales: torch.Tensor
    down_offsets: torch.Tensor | None
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None

    def __init__(
        self,
        gate_up: QuantizedWeight,
        down: QuantizedWeight,
        num_experts: int,
        activation: str,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        # The C++ operator (one call a layer: every chosen expert's products in one parallel loop)
        # for CPU weights, or None; and the rows an expert takes before the many-row kernels.
        self.native = native_experts_operator() if gate_up.device.type == "cpu" else None
        self.crossover = EXPERT_CROSSOVER
        if gate_up.out_features % num_experts or down.out_features % num_experts:
            raise ValueError(f"{gate_up.out_features} and {down.out_features} rows are not {num_experts} experts' each")
        self.num_experts, self.activation = num_experts, activation
        self.intermediate_size = gate_up.out_features // num_experts // 2
        self.gate_up_group, self.down_group = gate_up.group_size, down.group_size
        for name, weight in (("gate_up", gate_up), ("down", down)):  # buffers: they move with the model
            self.register_buffer(f"{name}_data", weight.data)
            self.register_buffer(f"{name}_scales", weight.scales)
            self.register_buffer(f"{name}_offsets", weight.offsets)
        # Dense biases [experts, 2 * inter] and [experts, hidden] (gpt-oss's), or None.
        self.register_buffer("gate_up_bias", gate_up_bias)
        self.register_buffer("down_bias", down_bias)

    @property
    def gate_up(self) -> QuantizedWeight:
        return QuantizedWeight.of_tensors(
            self.gate_up_data, self.gate_up_scales, self.gate_up_offsets, self.gate_up_group
        )

    @property
    def down(self) -> QuantizedWeight:
        return QuantizedWeight.of_tensors(self.down_data, self.down_scales, self.down_offsets, self.down_group)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) dequantized to the dense [experts, rows, in] tensors (the twin's)."""
        e = self.num_experts
        gate_up, down = self.gate_up.dequantize(), self.down.dequantize()
        return gate_up.reshape(e, -1, gate_up.shape[1]), down.reshape(e, -1, down.shape[1])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tensors = (
            self.gate_up_data, self.gate_up_scales, self.gate_up_offsets, self.gate_up_group,
            self.down_data, self.down_scales, self.down_offsets, self.down_group, self.num_experts,
        )  # fmt: skip
        native = self.native if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" else None
        if native is not None:
            rows, activation = self.crossover, NATIVE_ACTIVATIONS[self.activation]
            return native(
                x, weights.float(), ids, *tensors, activation, rows.direct_max_rows, rows.gemm_max_rows,
                self.gate_up_bias, self.down_bias,
            )  # fmt: skip
        return torch.ops.compiled_engine.quantized_expert_mlps(
            x, weights, ids, *tensors, self.activation, self.gate_up_bias, self.down_bias
        )


def captures_in_cuda_graphs(model: nn.Module) -> bool:
    """Whether the model's experts run without host synchronisation (dense experts: the grouped
    product), so that its decode can be captured in CUDA graphs. Quantized experts loop over the
    chosen experts on the host: their model runs without graphs."""
    return not any(isinstance(m, QuantizedExperts) for m in model.modules())
