"""How a mixture-of-experts layer routes and what its experts are (`MoEConfig`), read from a
config.json by each MoE family through `read_moe` with its own keys (`MoEKeys`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from compiled_engine.errors import ModelConfigError

Scoring = Literal["softmax", "sigmoid"]


class MoEConfig(msgspec.Struct, frozen=True):
    """One MoE layer's router and experts (the same in every sparse layer of a model).

    The router scores the experts from x (softmax or sigmoid of x @ gate.T), picks the top_k
    (after adding the selection-only bias where a family has one), takes their scores (divided by
    their sum when `renormalize`), times `routed_scaling`; with `softmax_after_topk` the k chosen
    logits are softmaxed instead (gpt-oss). Each expert is a gated MLP of `intermediate_size`.
    With `expert_bias` each expert's two products add a bias; `expert_activation` is the experts'
    own activation (experts/op.py's EXPERT_ACTIVATIONS; None: the model's `hidden_act`).
    `packed_experts` names the checkpoint's encoding of the expert tensors ("mxfp4"), or None
    for plain floats.
    A shared expert of `shared_intermediate_size` (0: none) runs on every token, scaled by
    sigmoid(x @ shared_gate.T) when `shared_gate`. Layers in `dense_layers` have a plain MLP of
    the model's own intermediate size instead."""

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: Scoring = "softmax"
    renormalize: bool = False
    routed_scaling: float = 1.0
    softmax_after_topk: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str | None = None
    packed_experts: str | None = None
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    dense_layers: tuple[int, ...] = ()

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class MoEKeys:
    """Where one family's config.json keeps its MoE fields, and what it fixes."""

    num_experts: tuple[str, ...] = ("num_experts", "num_local_experts")
    intermediate_size: str = "moe_intermediate_size"
    renormalize: str | None = "norm_topk_prob"  # None: `renormalize_default` always
    renormalize_default: bool = False
    shared_intermediate_size: str | None = None
    shared_gate: bool = False
    sparse_step: bool = False  # `decoder_sparse_step` and `mlp_only_layers` (Qwen's)


def _positive_int(raw: dict[str, Any], key: str, source: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"{source}: field '{key}' must be a positive integer, got {value!r}")
    return value


def read_moe(raw: dict[str, Any], source: str, keys: MoEKeys) -> MoEConfig:
    """The MoE fields of config.json `raw`, checked."""
    expert_key = next((k for k in keys.num_experts if raw.get(k) is not None), keys.num_experts[0])
    num_experts = _positive_int(raw, expert_key, source)
    top_k = _positive_int(raw, "num_experts_per_tok", source)
    if top_k > num_experts:
        raise ModelConfigError(f"{source}: num_experts_per_tok={top_k} is more than the {num_experts} experts")
    renormalize = keys.renormalize_default
    if keys.renormalize is not None and raw.get(keys.renormalize) is not None:
        renormalize = raw[keys.renormalize]
        if not isinstance(renormalize, bool):
            raise ModelConfigError(f"{source}: field '{keys.renormalize}' must be true or false, got {renormalize!r}")
    shared = 0
    if keys.shared_intermediate_size is not None and raw.get(keys.shared_intermediate_size):
        shared = _positive_int(raw, keys.shared_intermediate_size, source)
    dense: tuple[int, ...] = ()
    if keys.sparse_step:
        layers = _positive_int(raw, "num_hidden_layers", source)
        step = raw.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
            raise ModelConfigError(f"{source}: field 'decoder_sparse_step' must be a positive integer, got {step!r}")
        only = raw.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ModelConfigError(f"{source}: field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=_positive_int(raw, keys.intermediate_size, source),
        renormalize=renormalize,
        shared_intermediate_size=shared,
        shared_gate=keys.shared_gate and shared > 0,
        dense_layers=dense,
    )
