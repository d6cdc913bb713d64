"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) and a mixture
of experts (model/moe.py) with a shared expert that every token goes through, scaled by a sigmoid
gate of its own; the routed weights not renormalised unless `norm_topk_prob`."""

from __future__ import annotations

from typing import Any

from compiled_engine.model.checkpoint import Layout
from compiled_engine.model.config import ConfigRules, ModelConfig
from compiled_engine.model.family import Family, GGUFExperts, GGUFLayout
from compiled_engine.model.llama import Transformer, qwen_layer_types
from compiled_engine.model.moe import moe_decoder_layout
from compiled_engine.model.moe_config import MoEConfig, MoEKeys, read_moe
from compiled_engine.model.shard import NO_SHARD, TPShard


def checkpoint_layout(config: ModelConfig, shard: TPShard = NO_SHARD) -> Layout:
    return moe_decoder_layout(config, shard)


def _moe(raw: dict[str, Any], source: str) -> MoEConfig:
    keys = MoEKeys(shared_intermediate_size="shared_expert_intermediate_size", shared_gate=True, sparse_step=True)
    return read_moe(raw, source, keys)


QWEN2_MOE = Family(
    "qwen2_moe",
    ("qwen2_moe",),
    ("Qwen2MoeForCausalLM",),
    Transformer,
    checkpoint_layout,
    ConfigRules(fixed_qkv_bias=True, layer_types=qwen_layer_types, moe=_moe),
    GGUFLayout("qwen2moe", experts=GGUFExperts(renormalize=False, shared=True)),
)
