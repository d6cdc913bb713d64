"""A mixture of experts' products for a batch as one operator: the batch's (token, expert) pairs
grouped by expert, each chosen expert's gate/up product run once over just its tokens, the
activation, its down product, and the results summed into each token's row with the router's
weights, in fp32. Experts nobody chose are never read.

Two operators, both opaque to torch.compile (how many tokens each expert gets is data):
- `compiled_engine::expert_mlps`, experts as dense 3-D tensors [experts, rows, in]: on the CPU a
  loop over the chosen experts, on CUDA torch's grouped product, which needs no host
  synchronisation (`grouped_mm_expert_mlps`; unverified on a device);
- `compiled_engine::quantized_expert_mlps`, experts as quantized weights whose rows are every
  expert's stacked (`QuantizedExperts`, which replaces the model's `Experts` module from outside
  the model file): each expert's slice of rows runs the quantized product's kernels
  (linear/quantized_op.py), straight from its quantized bytes.

`reference_expert_mlps` is the meaning of both, a plain loop over every expert on dense weights:
the slow twin the tests hold them to.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from compiled_engine.linear.quantized_op import native_operator, quantized_linear
from compiled_engine.linear.quantized_weight import QuantizedWeight

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def reference_expert_mlps(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """Every expert in turn over the tokens that chose it, on dense weights, summed in fp32."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(ACTIVATIONS[activation](gate) * up, down[e])
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(x.dtype)


def expert_groups(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The batch's (token, slot) pairs ordered by expert (as flat indices into ids), and for each
    expert chosen at least once (expert, first, count) into that order."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    groups, first = [], 0
    for e, count in enumerate(counts):
        if count:
            groups.append((e, first, count))
            first += count
    return order, groups


def _grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    hidden: int,
    mlp: Any,
) -> torch.Tensor:
    """The grouped loop: `mlp(e, rows)` is expert e's MLP over the rows of x it was chosen for."""
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return out.to(x.dtype)
    k = ids.shape[1]
    order, groups = expert_groups(ids, num_experts)
    flat_weights = weights.reshape(-1).float()
    for e, first, count in groups:
        pairs = order[first : first + count]
        token = pairs // k
        y = mlp(e, x[token])
        out.index_add_(0, token, y.float() * flat_weights[pairs, None])
    return out.to(x.dtype)


def grouped_mm_expert_mlps(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The same as one grouped product per projection (torch._grouped_mm over the pairs sorted by
    expert), with no host synchronisation: every shape is fixed by the batch, so a CUDA graph can
    hold it. The GPU's way for dense experts; tested on the CPU, where torch runs it too."""
    tokens, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount would synchronise
    ends = counts.cumsum(0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x[token], gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    y = torch._grouped_mm(ACTIVATIONS[activation](gate) * up, down.transpose(1, 2), offs=ends)
    out = torch.zeros(tokens, down.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y.float() * weights.reshape(-1)[order, None].float())
    return out.to(x.dtype)


torch.library.define(
    "compiled_engine::expert_mlps",
    "(Tensor x, Tensor weights, Tensor ids, Tensor gate_up, Tensor down, str activation) -> Tensor",
)


@torch.library.impl("compiled_engine::expert_mlps", "CompositeExplicitAutograd")
def _expert_mlps(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    if x.device.type == "cuda":  # no host synchronisation: CUDA graphs capture it
        return grouped_mm_expert_mlps(x, weights, ids, gate_up, down, activation)
    act = ACTIVATIONS[activation]

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        return F.linear(act(gate) * up, down[e])

    return _grouped(x, weights, ids, gate_up.shape[0], down.shape[1], mlp)


@torch.library.register_fake("compiled_engine::expert_mlps")
def _expert_mlps_fake(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, *rest: Any
) -> torch.Tensor:
    return x.new_empty(x.shape)


def expert_mlps(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """x [tokens, hidden]; weights [tokens, k] and ids [tokens, k] (each token's experts);
    gate_up [experts, 2 * inter, hidden] (gate rows first), down [experts, hidden, inter]."""
    return torch.ops.compiled_engine.expert_mlps(x, weights, ids, gate_up, down, activation)


torch.library.define(
    "compiled_engine::quantized_expert_mlps",
    "(Tensor x, Tensor weights, Tensor ids, Tensor gate_up_data, Tensor gate_up_scales, Tensor? gate_up_offsets, "
    "int gate_up_group, Tensor down_data, Tensor down_scales, Tensor? down_offsets, int down_group, "
    "int num_experts, str activation) -> Tensor",
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
) -> torch.Tensor:
    gate_up = QuantizedWeight.of_tensors(gate_up_data, gate_up_scales, gate_up_offsets, gate_up_group)
    down = QuantizedWeight.of_tensors(down_data, down_scales, down_offsets, down_group)
    act, native = ACTIVATIONS[activation], native_operator() if x.device.type == "cpu" else None
    per_gate_up, per_down = gate_up.out_features // num_experts, down.out_features // num_experts

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = quantized_linear(rows, gate_up.narrow_rows(e * per_gate_up, per_gate_up), None, native).chunk(2, -1)
        return quantized_linear(act(gate) * up, down.narrow_rows(e * per_down, per_down), None, native)

    return _grouped(x, weights, ids, num_experts, per_down, mlp)


@torch.library.register_fake("compiled_engine::quantized_expert_mlps")
def _quantized_expert_mlps_fake(x: torch.Tensor, *rest: Any) -> torch.Tensor:
    return x.new_empty(x.shape)


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

    def __init__(self, gate_up: QuantizedWeight, down: QuantizedWeight, num_experts: int, activation: str) -> None:
        super().__init__()
        if gate_up.out_features % num_experts or down.out_features % num_experts:
            raise ValueError(f"{gate_up.out_features} and {down.out_features} rows are not {num_experts} experts' each")
        self.num_experts, self.activation = num_experts, activation
        self.intermediate_size = gate_up.out_features // num_experts // 2
        self.gate_up_group, self.down_group = gate_up.group_size, down.group_size
        for name, weight in (("gate_up", gate_up), ("down", down)):  # buffers: they move with the model
            self.register_buffer(f"{name}_data", weight.data)
            self.register_buffer(f"{name}_scales", weight.scales)
            self.register_buffer(f"{name}_offsets", weight.offsets)

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
        return torch.ops.compiled_engine.quantized_expert_mlps(
            x, weights, ids,
            self.gate_up_data, self.gate_up_scales, self.gate_up_offsets, self.gate_up_group,
            self.down_data, self.down_scales, self.down_offsets, self.down_group,
            self.num_experts, self.activation,
        )  # fmt: skip


def captures_in_cuda_graphs(model: nn.Module) -> bool:
    """Whether the model's experts run without host synchronisation (dense experts: the grouped
    product), so that its decode can be captured in CUDA graphs. Quantized experts loop over the
    chosen experts on the host: their model runs without graphs."""
    return not any(isinstance(m, QuantizedExperts) for m in model.modules())
