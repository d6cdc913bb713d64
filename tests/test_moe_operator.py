"""The mixture of experts' pieces against their slow twins: the grouped experts operator (dense
and quantized experts, every format, 1-64 rows, k = 1, 2, 4, 8) against a plain loop over every
expert on dense weights; experts nobody chose are never read; the router's variants against the
formulas they implement; gpt-oss's experts (biases, the clamped SwiGLU) against transformers'."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from compiled_engine.experts.op import (
    SWIGLU_LIMIT,
    SWIGLU_OAI,
    expert_mlps,
    grouped_mm_expert_mlps,
    reference_expert_mlps,
)
from compiled_engine.linear.crossover import RowCrossover
from compiled_engine.linear.quantize import quantize
from compiled_engine.linear.quantized_experts import QuantizedExperts, native_experts_operator
from compiled_engine.model.moe import Router
from compiled_engine.model.moe_config import MoEConfig

EXPERTS, HIDDEN, INTER = 8, 128, 64
ROWS = (1, 2, 5, 16, 64)
TOPK = (1, 2, 4, 8)


def _batch(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, generator=g)
    return x, weights, ids


def _dense_experts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2, torch.randn(
        EXPERTS, HIDDEN, INTER, generator=g
    ) * 0.2


@pytest.mark.parametrize("k", TOPK)
@pytest.mark.parametrize("rows", ROWS)
def test_grouped_dense_experts_match_the_loop_over_every_expert(rows: int, k: int) -> None:
    gate_up, down = _dense_experts(0)
    x, weights, ids = _batch(rows, k, seed=rows * 10 + k)
    for activation in ("silu", "gelu_tanh"):
        expected = reference_expert_mlps(x, weights, ids, gate_up, down, activation)
        got = expert_mlps(x, weights, ids, gate_up, down, activation)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# (format, group size): int8 per channel and grouped, int4 groups of 32 and of 64
FORMATS = (("int8", None), ("int8", 32), ("int4", 32), ("int4", 64))


# How the quantized experts run: the native operator with its crossovers as installed, with
# every expert on the direct kernel's strips, with every expert through the many-row kernel or
# dequantize-then-GEMM; and the Python loop over the quantized product (no compiler).
WAYS = {
    "native": RowCrossover(4, 64),
    "native-direct": RowCrossover(64, 64),
    "native-gemm": RowCrossover(0, 64),
    "native-dequantize": RowCrossover(0, 0),
    "python": None,
}


@functools.cache
def _quantized_experts(fmt: tuple[str, int | None], activation: str) -> QuantizedExperts:
    gate_up, down = _dense_experts(1)
    return QuantizedExperts(
        quantize(gate_up.reshape(-1, HIDDEN), fmt[0], fmt[1]), quantize(down.reshape(-1, INTER), fmt[0], fmt[1]),
        EXPERTS, activation,
    )  # fmt: skip


# The quick tier takes 1, 5 and 64 rows and k = 1, 2, 8; the full tier the rest.
QUICK_ROWS = [r if r in (1, 5, 64) else pytest.param(r, marks=pytest.mark.full) for r in ROWS]
QUICK_TOPK = [k if k != 4 else pytest.param(k, marks=pytest.mark.full) for k in TOPK]


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[0]}-g{f[1]}")
@pytest.mark.parametrize("k", QUICK_TOPK)
@pytest.mark.parametrize("rows", QUICK_ROWS)
def test_quantized_experts_match_the_loop_over_their_dequantized_weights(
    rows: int, k: int, fmt: tuple[str, int | None], way: str
) -> None:
    activation = "gelu_tanh" if k == 2 else "silu"
    experts = _quantized_experts(fmt, activation)
    crossover = WAYS[way]
    experts.native = None if crossover is None else native_experts_operator()  # (the experts are shared)
    if crossover is not None:
        assert experts.native is not None
        experts.crossover = crossover
    x, weights, ids = _batch(rows, k, seed=rows * 10 + k + 1)
    dense_gate_up, dense_down = experts.dense()
    expected = reference_expert_mlps(x, weights, ids, dense_gate_up, dense_down, activation)
    torch.testing.assert_close(experts(x, weights, ids), expected, atol=1e-4, rtol=1e-4)


def test_the_native_operator_refuses_ids_outside_the_experts() -> None:
    gate_up, down = _dense_experts(1)
    experts = QuantizedExperts(
        quantize(gate_up.reshape(-1, HIDDEN), "int4", 32),
        quantize(down.reshape(-1, INTER), "int4", 32),
        EXPERTS,
        "silu",
    )
    x, weights, ids = _batch(3, 2, seed=9)
    ids[1, 1] = EXPERTS
    with pytest.raises(RuntimeError, match=f"expert {EXPERTS} of {EXPERTS}"):
        experts(x, weights, ids)


def test_experts_nobody_chose_are_never_read() -> None:
    """Unchosen experts' weights are NaN: any read of them would reach the output."""
    gate_up, down = _dense_experts(2)
    chosen = [1, 6]
    x, weights, _ = _batch(16, 2, seed=3)
    ids = torch.tensor([chosen if i % 2 else chosen[::-1] for i in range(16)])
    poisoned_gate_up, poisoned_down = gate_up.clone(), down.clone()
    others = [e for e in range(EXPERTS) if e not in chosen]
    poisoned_gate_up[others], poisoned_down[others] = float("nan"), float("nan")
    expected = reference_expert_mlps(x, weights, ids, gate_up, down, "silu")
    torch.testing.assert_close(expert_mlps(x, weights, ids, poisoned_gate_up, poisoned_down, "silu"), expected)
    quantized = QuantizedExperts(
        quantize(gate_up.reshape(-1, HIDDEN), "int4", 32),
        quantize(down.reshape(-1, INTER), "int4", 32),
        EXPERTS,
        "silu",
    )
    dense_gate_up, dense_down = quantized.dense()
    expected = reference_expert_mlps(x, weights, ids, dense_gate_up, dense_down, "silu")
    rows_per_expert = 2 * INTER
    for e in others:  # the scales of every other expert's rows
        quantized.gate_up_scales[e * rows_per_expert : (e + 1) * rows_per_expert] = float("nan")
        quantized.down_scales[e * HIDDEN : (e + 1) * HIDDEN] = float("nan")
    torch.testing.assert_close(quantized(x, weights, ids), expected, atol=1e-4, rtol=1e-4)


def test_no_tokens_gives_an_empty_result() -> None:
    gate_up, down = _dense_experts(0)
    empty = expert_mlps(
        torch.empty(0, HIDDEN), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64), gate_up, down, "silu"
    )
    assert empty.shape == (0, HIDDEN)


def _router(moe: MoEConfig, seed: int = 0) -> Router:
    router = Router(HIDDEN, moe)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g))
        if router.bias is not None:
            router.bias.copy_(torch.randn(EXPERTS, generator=g))
    return router


def test_router_variants_compute_what_their_configs_say() -> None:
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4))

    def logits_of(router: Router) -> torch.Tensor:
        bias = router.bias if router.bias is not None else 0.0
        return (x @ router.weight.T + bias).double()

    base = MoEConfig(num_experts=EXPERTS, top_k=3, intermediate_size=INTER)
    cases = {
        "softmax": (base, lambda z: torch.softmax(z, -1), False),
        "softmax, renormalised, scaled": (
            MoEConfig(EXPERTS, 3, INTER, renormalize=True, routed_scaling=2.5),
            lambda z: torch.softmax(z, -1),
            True,
        ),
        "sigmoid": (MoEConfig(EXPERTS, 3, INTER, scoring="sigmoid"), torch.sigmoid, False),
    }
    for name, (moe, score, renormalize) in cases.items():
        router = _router(moe)
        weights, ids = router(x)
        scores = score(logits_of(router))
        expected_ids = scores.topk(3, dim=-1).indices
        assert torch.equal(ids, expected_ids), name
        expected = scores.gather(-1, expected_ids)
        if renormalize:
            expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.double(), expected * moe.routed_scaling, atol=1e-6, rtol=1e-6, msg=name)
    # gpt-oss: a router bias, and a softmax over the chosen k logits
    router = _router(MoEConfig(EXPERTS, 4, INTER, softmax_after_topk=True, router_bias=True), seed=1)
    weights, ids = router(x)
    top = logits_of(router).topk(4, dim=-1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(weights.double(), torch.softmax(top.values, -1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("k", TOPK)
@pytest.mark.parametrize("rows", ROWS)
def test_the_grouped_product_way_matches_the_loop(rows: int, k: int) -> None:
    """The GPU's way (one grouped product per projection, no host synchronisation), run by torch
    on the CPU: fp32 as the loop, and bf16 within bf16's rounding."""
    gate_up, down = _dense_experts(5)
    x, weights, ids = _batch(rows, k, seed=rows * 10 + k + 2)
    expected = reference_expert_mlps(x, weights, ids, gate_up, down, "silu")
    torch.testing.assert_close(
        grouped_mm_expert_mlps(x, weights, ids, gate_up, down, "silu"), expected, atol=1e-5, rtol=1e-5
    )
    bf16 = grouped_mm_expert_mlps(x.bfloat16(), weights, ids, gate_up.bfloat16(), down.bfloat16(), "silu")
    assert ((bf16.float() - expected).norm() / expected.norm()).item() < 0.02


# ---------------------------------------------------------------------------------------------
# gpt-oss's experts: biases on both products and the clamped SwiGLU over interleaved features


@functools.cache
def _gpt_oss_experts() -> Any:
    """transformers' own GptOssExperts with random weights large enough that the clamps bite."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)
    config._experts_implementation = "eager"
    experts = GptOssExperts(config)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * (0.5 if param.dim() == 3 else 1.0))
    return experts


def _ours_of(experts: Any) -> tuple[torch.Tensor, ...]:
    # The checkpoint holds [experts, in, out] products; ours are [experts, out, in].
    return (
        experts.gate_up_proj.detach().transpose(1, 2).contiguous(),
        experts.down_proj.detach().transpose(1, 2).contiguous(),
        experts.gate_up_proj_bias.detach(),
        experts.down_proj_bias.detach(),
    )


@pytest.mark.parametrize("k", (1, 4))
@pytest.mark.parametrize("rows", (1, 5, 64))
@torch.inference_mode()
def test_gpt_oss_experts_match_transformers(rows: int, k: int) -> None:
    hf = _gpt_oss_experts()
    gate_up, down, gate_up_bias, down_bias = _ours_of(hf)
    x, weights, ids = _batch(rows, k, seed=rows + k)
    x = x * 2
    expected = hf(x, ids, weights)
    hidden = torch.einsum("th,eoh->teo", x, gate_up) + gate_up_bias  # every expert's gate/up features
    assert hidden[..., 0::2].max() > SWIGLU_LIMIT and hidden[..., 1::2].abs().max() > SWIGLU_LIMIT  # clamps bite
    args = (x, weights, ids, gate_up, down, SWIGLU_OAI, gate_up_bias, down_bias)
    torch.testing.assert_close(reference_expert_mlps(*args), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(expert_mlps(*args), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(grouped_mm_expert_mlps(*args), expected, atol=1e-4, rtol=1e-5)
    without_biases = reference_expert_mlps(x, weights, ids, gate_up, down, SWIGLU_OAI)
    assert (without_biases - expected).abs().max() > 1e-2


@pytest.mark.parametrize("way", ["native", "native-dequantize", "python"])
@pytest.mark.parametrize("fmt", (("int8", 32), ("int4", 32)), ids=lambda f: f"{f[0]}-g{f[1]}")
@pytest.mark.parametrize("rows", (1, 5, 64))
@torch.inference_mode()
def test_quantized_gpt_oss_experts_match_the_loop_over_their_dequantized_weights(
    rows: int, fmt: tuple[str, int], way: str
) -> None:
    """Biases and the clamped SwiGLU, in the C++ operator (its direct strips, and its
    dequantize-then-GEMM) and in the Python loop over the quantized product."""
    gate_up, down, gate_up_bias, down_bias = _ours_of(_gpt_oss_experts())
    experts = QuantizedExperts(
        quantize(gate_up.reshape(-1, HIDDEN), *fmt), quantize(down.reshape(-1, INTER), *fmt),
        EXPERTS, SWIGLU_OAI, gate_up_bias, down_bias,
    )  # fmt: skip
    crossover = WAYS[way]
    if crossover is None:
        experts.native = None
    else:
        assert experts.native is not None
        experts.crossover = crossover
    x, weights, ids = _batch(rows, 4, seed=rows)
    dense_gate_up, dense_down = experts.dense()
    expected = reference_expert_mlps(x, weights, ids, dense_gate_up, dense_down, SWIGLU_OAI, gate_up_bias, down_bias)
    torch.testing.assert_close(experts(x, weights, ids), expected, atol=1e-4, rtol=1e-4)
