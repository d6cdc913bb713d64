"""A mixture of experts' products for a batch as one operator, `compiled_engine::expert_mlps`,
which the model's `Experts` module calls (model/moe.py) as its attention calls attention/op.py:
the batch's (token, expert) pairs grouped by expert, each chosen expert's gate/up product run
once over just its tokens, the activation, its down product, and the results summed into each
token's row with the router's weights, in fp32. Experts nobody chose are never read. It is opaque
to torch.compile (how many tokens each expert gets is data).

On the CPU it loops over the chosen experts (`grouped`, shared with the quantized experts of
linear/quantized_experts.py); on CUDA it is torch's grouped product, which needs no host
synchronisation, so CUDA graphs hold it (`grouped_mm_expert_mlps`; unverified on a device).
`reference_expert_mlps` is the meaning of both, a plain loop over every expert on dense weights:
the slow twin the tests hold them to.

An expert is down(glu(gate_up x + b1)) + b2, the biases optional (gpt-oss has them). `glu` is
the activation's, from gate_up's product of 2 * inter features: SiLU or GELU-tanh of the first
half times the second, or gpt-oss's clamped SwiGLU (`SWIGLU_OAI`) over interleaved features.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
# gpt-oss's experts: gate = even features, up = odd ones; gate clamped above at the limit, up to
# +-limit; gate * sigmoid(alpha * gate) * (up + 1).
SWIGLU_OAI = "swiglu_oai"
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
EXPERT_ACTIVATIONS = (*ACTIVATIONS, SWIGLU_OAI)


def glu(activation: str, gate_up: torch.Tensor) -> torch.Tensor:
    """The gated activation of a gate/up product [rows, 2 * inter]: [rows, inter]."""
    if activation == SWIGLU_OAI:
        gate = gate_up[..., ::2].clamp(max=SWIGLU_LIMIT)
        up = gate_up[..., 1::2].clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        return gate * torch.sigmoid(gate * SWIGLU_ALPHA) * (up + 1)
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


def _bias(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias is None else bias[e]


def reference_expert_mlps(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every expert in turn over the tokens that chose it, on dense weights, summed in fp32."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        h = glu(activation, F.linear(x[token], gate_up[e], _bias(gate_up_bias, e)))
        y = F.linear(h, down[e], _bias(down_bias, e))
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


def grouped(
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
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
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
    expert = flat[order]  # each sorted pair's expert: its rows' biases
    projected = torch._grouped_mm(x[token], gate_up.transpose(1, 2), offs=ends)
    if gate_up_bias is not None:
        projected = projected + gate_up_bias[expert]
    y = torch._grouped_mm(glu(activation, projected), down.transpose(1, 2), offs=ends)
    if down_bias is not None:
        y = y + down_bias[expert]
    out = torch.zeros(tokens, down.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y.float() * weights.reshape(-1)[order, None].float())
    return out.to(x.dtype)


torch.library.define(
    "compiled_engine::expert_mlps",
    "(Tensor x, Tensor weights, Tensor ids, Tensor gate_up, Tensor down, str activation, Tensor? gate_up_bias=None, "
    "Tensor? down_bias=None) -> Tensor",
)


@torch.library.impl("compiled_engine::expert_mlps", "CompositeExplicitAutograd")
def _expert_mlps(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    if x.device.type == "cuda":  # no host synchronisation: CUDA graphs capture it
        return grouped_mm_expert_mlps(x, weights, ids, gate_up, down, activation, gate_up_bias, down_bias)

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = glu(activation, F.linear(rows, gate_up[e], _bias(gate_up_bias, e)))
        return F.linear(h, down[e], _bias(down_bias, e))

    return grouped(x, weights, ids, gate_up.shape[0], down.shape[1], mlp)


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
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [tokens, hidden]; weights [tokens, k] and ids [tokens, k] (each token's experts);
    gate_up [experts, 2 * inter, hidden] (gate rows first, or interleaved for SWIGLU_OAI), down
    [experts, hidden, inter]; the optional biases [experts, 2 * inter] and [experts, hidden]."""
    return torch.ops.compiled_engine.expert_mlps(x, weights, ids, gate_up, down, activation, gate_up_bias, down_bias)
