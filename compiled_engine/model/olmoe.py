"""OLMoE (OLMoE-1B-7B): Llama's network with q and k each RMS-normalised over all their heads at
once (not per head), optionally clamped with v to +-`clip_qkv`, and a mixture of experts in every
layer (model/moe.py): softmax router, top-k, not renormalised unless `norm_topk_prob`."""

from __future__ import annotations

from typing import Any

from compiled_engine.model.checkpoint import Layout
from compiled_engine.model.config import ConfigRules, ModelConfig
from compiled_engine.model.family import Family, GGUFExperts, GGUFLayout, GGUFMetadata
from compiled_engine.model.llama import Transformer
from compiled_engine.model.moe import moe_decoder_layout
from compiled_engine.model.moe_config import MoEConfig, MoEKeys, read_moe
from compiled_engine.model.shard import NO_SHARD, TPShard


def checkpoint_layout(config: ModelConfig, shard: TPShard = NO_SHARD) -> Layout:
    return moe_decoder_layout(config, shard)


def _moe(raw: dict[str, Any], source: str) -> MoEConfig:
    return read_moe(raw, source, MoEKeys(intermediate_size="intermediate_size"))


def _gguf_fields(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's clamp of q, k and v; its converter writes none for OLMoE.
    clip = meta.arch("attention.clamp_kqv", float, 0.0)
    return {"clip_qkv": clip} if clip else {}


OLMOE = Family(
    "olmoe",
    ("olmoe",),
    ("OlmoeForCausalLM",),
    Transformer,
    checkpoint_layout,
    ConfigRules(qk_norm_whole=True, moe=_moe),
    GGUFLayout("olmoe", _gguf_fields, experts=GGUFExperts(renormalize=False, width_key="intermediate_size")),
    no_tensor_parallel="its q/k norms span every head, which no rank holds",
)
