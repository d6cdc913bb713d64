"""A mixture of experts in place of a decoder layer's MLP, the one every MoE family uses, set by
its `MoEConfig` (model/moe_config.py): a router that picks each token's top-k experts and weighs
them, the experts (gated MLPs stored as 3-D tensors, one slice per expert), and an optional
shared expert that every token goes through.

The experts' products run as one operator (experts/op.py): grouped by expert, each chosen
expert's weights read once for all its tokens, experts nobody chose never read. It is opaque to
torch.compile (how many tokens each expert gets is data), and quantized experts replace the
`Experts` module from outside this file (linear/install.py), as quantized products replace
`Linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from compiled_engine.experts.op import expert_mlps
from compiled_engine.model.checkpoint import (
    CheckpointTensor,
    Layout,
    attention_layout,
    embedding_layout,
    mlp_layout,
    norm_layout,
)
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.layers import GatedMLP, Linear
from compiled_engine.model.moe_config import MoEConfig
from compiled_engine.model.shard import TPShard


class Router(nn.Module):
    """Each token's top-k experts and their weights (fp32) from x @ weight.T (+ bias)."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.router_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        logits = F.linear(x, self.weight, self.bias).float()
        if moe.softmax_after_topk:
            chosen, ids = torch.topk(logits, moe.top_k, dim=-1)
            weights = torch.softmax(chosen, dim=-1)
        else:
            scores = torch.softmax(logits, dim=-1) if moe.scoring == "softmax" else torch.sigmoid(logits)
            weights, ids = torch.topk(scores, moe.top_k, dim=-1)
            if moe.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if moe.routed_scaling != 1.0:
            weights = weights * moe.routed_scaling
        return weights, ids


class Experts(nn.Module):
    """The experts' weights: gate and up rows of expert e in gate_up_proj[e] (gate first; with
    gpt-oss's activation interleaved, gate rows even), its down projection in down_proj[e], as
    Hugging Face's fused expert tensors hold them; their biases where the family has them."""

    def __init__(self, config: ModelConfig, shard: TPShard, moe: MoEConfig) -> None:
        super().__init__()
        # With tensor parallelism, this rank's share of every expert's intermediate features.
        self.num_experts, self.intermediate_size = moe.num_experts, shard.split(moe.intermediate_size)[1]
        self.activation = moe.expert_activation or config.hidden_act
        h, inter, e = config.hidden_size, self.intermediate_size, moe.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, inter))
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * inter)) if moe.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(e, h)) if moe.expert_bias else None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over each token's chosen experts e of weight * down_e(glu(gate_up_e x))."""
        return expert_mlps(
            x, weights, ids, self.gate_up_proj, self.down_proj, self.activation, self.gate_up_bias, self.down_bias
        )


class SparseMoE(nn.Module):
    """router -> experts, plus the shared expert (gated by sigmoid(x @ shared_expert_gate.T)
    where the family has that gate)."""

    def __init__(self, config: ModelConfig, shard: TPShard, moe: MoEConfig) -> None:
        super().__init__()
        self.gate = Router(config.hidden_size, moe)
        self.experts = Experts(config, shard, moe)
        shared = shard.split(moe.shared_intermediate_size)[1]
        self.shared_expert = GatedMLP(config, shard, shared) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1) if moe.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def feed_forward(config: ModelConfig, shard: TPShard, layer: int) -> nn.Module:
    """Layer `layer`'s feed-forward: the mixture of experts, or a plain gated MLP where the config
    keeps that layer dense."""
    moe = config.moe
    if moe is not None and moe.sparse(layer):
        return SparseMoE(config, shard, moe)
    return GatedMLP(config, shard)


@dataclass(frozen=True)
class ExpertNames:
    """How one family's checkpoint names its mixture's tensors within a layer."""

    block: str = "mlp"  # the mixture's module in a layer
    gate: str = "gate_proj"  # each expert's products
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str = "shared_expert"
    shared_gate: str = "shared_expert_gate"


def moe_decoder_layout(config: ModelConfig, shard: TPShard, names: ExpertNames = ExpertNames()) -> Layout:
    """Every tensor of a checkpoint with separate q/k/v tensors, the usual layer norms, and in
    each sparse layer a router and one set of tensors per expert (dense layers: mlp_layout).
    With tensor parallelism a rank reads its share of every expert's intermediate features (and
    the shared expert's): gate and up rows, down columns; the router whole."""
    moe, h = config.moe, config.hidden_size
    assert moe is not None
    T = CheckpointTensor
    layout = embedding_layout(config)
    for i in range(config.num_layers):
        layout |= attention_layout(config, shard, i)
        layout |= norm_layout(config, i, ("input_layernorm", "post_attention_layernorm"))
        if not moe.sparse(i):
            layout |= mlp_layout(config, shard, i)
            continue
        hf, ours, inter = f"model.layers.{i}.{names.block}.", f"layers.{i}.mlp.", moe.intermediate_size
        layout[f"{hf}gate.weight"] = T(f"{ours}gate.weight", (moe.num_experts, h))
        rows, local = _share(shard, inter)
        for e in range(moe.num_experts):
            expert = f"{hf}experts.{e}."
            layout[f"{expert}{names.gate}.weight"] = T(f"{ours}experts.gate_up_proj", (inter, h), 0, rows, e)
            layout[f"{expert}{names.up}.weight"] = T(f"{ours}experts.gate_up_proj", (inter, h), local, rows, e)
            layout[f"{expert}{names.down}.weight"] = T(f"{ours}experts.down_proj", (h, inter), 0, _columns(rows), e)
        shared = moe.shared_intermediate_size
        if shared:
            mlp, (rows, local) = f"{ours}shared_expert.", _share(shard, shared)
            layout[f"{hf}{names.shared}.gate_proj.weight"] = T(f"{mlp}gate_up_proj.weight", (shared, h), 0, rows)
            layout[f"{hf}{names.shared}.up_proj.weight"] = T(f"{mlp}gate_up_proj.weight", (shared, h), local, rows)
            layout[f"{hf}{names.shared}.down_proj.weight"] = T(f"{mlp}down_proj.weight", (h, shared), 0, _columns(rows))
        if moe.shared_gate:
            layout[f"{hf}{names.shared_gate}.weight"] = T(f"{ours}shared_expert_gate.weight", (1, h))
    return layout


def _share(shard: TPShard, width: int) -> tuple[tuple[int, int, int] | None, int]:
    """This rank's rows of a `width`-row tensor as a CheckpointTensor part (None: all), and how many."""
    first, count = shard.split(width)
    return (None if shard.size == 1 else (0, first, count)), count


def _columns(rows: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    return None if rows is None else (1, rows[1], rows[2])
