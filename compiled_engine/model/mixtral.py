"""Mixtral (8x7B, 8x22B): Mistral's attention (a sliding window on every layer when the config
sets one) and a mixture of experts in every layer (model/moe.py): softmax router, top-k, always
renormalised. Its checkpoint names the mixture `block_sparse_moe` and each expert's products w1
(gate), w3 (up) and w2 (down)."""

from __future__ import annotations

from typing import Any

from compiled_engine.model.checkpoint import Layout
from compiled_engine.model.config import ConfigRules, ModelConfig
from compiled_engine.model.family import Family, GGUFExperts, GGUFLayout
from compiled_engine.model.llama import Transformer, every_layer_slides
from compiled_engine.model.moe import ExpertNames, moe_decoder_layout
from compiled_engine.model.moe_config import MoEConfig, MoEKeys, read_moe
from compiled_engine.model.shard import NO_SHARD, TPShard

NAMES = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")


def checkpoint_layout(config: ModelConfig, shard: TPShard = NO_SHARD) -> Layout:
    return moe_decoder_layout(config, shard, NAMES)


def _moe(raw: dict[str, Any], source: str) -> MoEConfig:
    keys = MoEKeys(
        num_experts=("num_local_experts",),
        intermediate_size="intermediate_size",
        renormalize=None,
        renormalize_default=True,
    )
    return read_moe(raw, source, keys)


MIXTRAL = Family(
    "mixtral",
    ("mixtral",),
    ("MixtralForCausalLM",),
    Transformer,
    checkpoint_layout,
    ConfigRules(layer_types=every_layer_slides, moe=_moe),
    # llama.cpp writes Mixtral as a llama model with experts (q/k rows permuted as llama's).
    GGUFLayout(
        "llama",
        permuted_qk=True,
        experts=GGUFExperts(
            renormalize=True, count_key="num_local_experts", width_key="intermediate_size", renormalize_key=None
        ),
    ),
    tool_call_parser="mistral",
)
