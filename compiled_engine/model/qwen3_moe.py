"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm) and a
mixture of experts in place of the MLP (model/moe.py): softmax router, top-k, renormalised when
`norm_topk_prob`; dense layers where `mlp_only_layers` or `decoder_sparse_step` say."""

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


def read_qwen_moe(raw: dict[str, Any], source: str) -> MoEConfig:
    return read_moe(raw, source, MoEKeys(sparse_step=True))


QWEN3_MOE = Family(
    "qwen3_moe",
    ("qwen3_moe",),
    ("Qwen3MoeForCausalLM",),
    Transformer,
    checkpoint_layout,
    ConfigRules(qk_norm=True, layer_types=qwen_layer_types, moe=read_qwen_moe),
    GGUFLayout("qwen3moe", experts=GGUFExperts(renormalize=True)),  # llama.cpp always renormalises
)
