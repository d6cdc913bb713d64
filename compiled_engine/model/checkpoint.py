"""Where each tensor of a Hugging Face checkpoint lands in a model (`CheckpointTensor`), and the
layout pieces every family shares: fused q/k/v and gate/up rows, tensor-parallel parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from compiled_engine.model.config import ModelConfig
from compiled_engine.model.shard import TPShard


@dataclass(frozen=True)
class CheckpointTensor:
    """Where one tensor of a Hugging Face checkpoint lands in this model: in parameter `param`,
    from output feature (row) `start` on; in an experts' 3-D parameter, in expert `expert`'s
    slice. With tensor parallelism a rank reads only `part` of the tensor: (dim, first, count).
    `transposed`: the checkpoint holds each product as [in, out] (gpt-oss's experts), ours is
    [out, in]: the tensor is read whole and its last two dims swapped. `packed`: one tensor of a
    packed encoding of the parameter ("blocks" or "scales" of MXFP4 experts, weights/mxfp4.py),
    read whole as uint8 and kept apart for the loader to decode."""

    param: str
    shape: tuple[int, ...]  # the checkpoint tensor's whole shape
    start: int = 0
    part: tuple[int, int, int] | None = None
    expert: int | None = None
    transposed: bool = False
    packed: str | None = None

    @property
    def read_shape(self) -> tuple[int, ...]:
        if self.part is None:
            return self.shape
        dim, _, count = self.part
        return tuple(count if d == dim else n for d, n in enumerate(self.shape))

    def read(self, tensor_slice: Any) -> torch.Tensor:
        """This rank's part of a safetensors slice (only that part is read from disk)."""
        if self.part is None:
            whole: torch.Tensor = tensor_slice[:]
            return whole.transpose(-1, -2) if self.transposed else whole
        assert not self.transposed, "a transposed tensor is read whole"
        dim, first, count = self.part
        return tensor_slice[first : first + count] if dim == 0 else tensor_slice[:, first : first + count]

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """The part of `param` this tensor fills (writable)."""
        target = param if self.expert is None else param[self.expert]
        return target.narrow(0, self.start, self.read_shape[0])


Layout = dict[str, CheckpointTensor]


@dataclass(frozen=True)
class ShardRows:
    """Which rows (output features) of q, k/v and the MLP's intermediate this rank holds, as
    CheckpointTensor parts; None for all of them (no tensor parallelism)."""

    q: tuple[int, int, int] | None
    kv: tuple[int, int, int] | None
    intermediate: tuple[int, int, int] | None

    @classmethod
    def of(cls, config: ModelConfig, shard: TPShard) -> ShardRows:
        if shard.size == 1:
            return cls(None, None, None)
        hd = config.head_dim
        q_first, q_heads = shard.heads(config)
        kv_first, kv_heads = shard.kv_heads(config)
        i_first, i_count = shard.intermediate(config)
        return cls((0, q_first * hd, q_heads * hd), (0, kv_first * hd, kv_heads * hd), (0, i_first, i_count))

    @staticmethod
    def columns(rows: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        """The same range as columns: the input side of a row-parallel product."""
        return (1, rows[1], rows[2]) if rows is not None else None

    @staticmethod
    def count(rows: tuple[int, int, int] | None, whole: int) -> int:
        return rows[2] if rows is not None else whole


def embedding_layout(config: ModelConfig, norm: str = "model.norm.weight") -> Layout:
    """The embedding, the final norm and (untied) the head: whole on every rank."""
    T, h = CheckpointTensor, config.hidden_size
    layout = {
        "model.embed_tokens.weight": T("embed_tokens.weight", (config.vocab_size, h)),
        norm: T("norm.weight", (h,)),
    }
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = T("lm_head.weight", (config.vocab_size, h))
    return layout


def attention_layout(config: ModelConfig, shard: TPShard, layer: int) -> Layout:
    """Layer `layer`'s q/k/v (stacked into qkv_proj), o_proj, biases and q/k norms, from separate
    q_proj/k_proj/v_proj tensors."""
    T, h, hd = CheckpointTensor, config.hidden_size, config.head_dim
    rows = ShardRows.of(config, shard)
    q, kv = rows.count(rows.q, config.q_size), rows.count(rows.kv, config.kv_size)
    hf, ours = f"model.layers.{layer}.self_attn.", f"layers.{layer}.self_attn."
    layout: Layout = {}
    parts = (
        ("q_proj", 0, config.q_size, rows.q),
        ("k_proj", q, config.kv_size, rows.kv),
        ("v_proj", q + kv, config.kv_size, rows.kv),
    )
    for name, start, width, part in parts:
        layout[f"{hf}{name}.weight"] = T(f"{ours}qkv_proj.weight", (width, h), start, part)
        if config.qkv_bias:
            layout[f"{hf}{name}.bias"] = T(f"{ours}qkv_proj.bias", (width,), start, part)
    layout[f"{hf}o_proj.weight"] = T(f"{ours}o_proj.weight", (h, config.q_size), part=rows.columns(rows.q))
    if config.o_bias:
        layout[f"{hf}o_proj.bias"] = T(f"{ours}o_proj.bias", (h,))
    if config.qk_norm:  # per head, or over all heads at once (OLMoE's)
        q_width, k_width = (config.q_size, config.kv_size) if config.qk_norm_whole else (hd, hd)
        layout[f"{hf}q_norm.weight"] = T(f"{ours}q_norm.weight", (q_width,))
        layout[f"{hf}k_norm.weight"] = T(f"{ours}k_norm.weight", (k_width,))
    return layout


def mlp_layout(config: ModelConfig, shard: TPShard, layer: int) -> Layout:
    """Layer `layer`'s gate and up (stacked into gate_up_proj) and down, from separate tensors."""
    T, h, inter = CheckpointTensor, config.hidden_size, config.intermediate_size
    rows = ShardRows.of(config, shard).intermediate
    count = ShardRows.count(rows, inter)
    hf, ours = f"model.layers.{layer}.mlp.", f"layers.{layer}.mlp."
    return {
        f"{hf}gate_proj.weight": T(f"{ours}gate_up_proj.weight", (inter, h), 0, rows),
        f"{hf}up_proj.weight": T(f"{ours}gate_up_proj.weight", (inter, h), count, rows),
        f"{hf}down_proj.weight": T(f"{ours}down_proj.weight", (h, inter), part=ShardRows.columns(rows)),
    }


def decoder_layout(config: ModelConfig, shard: TPShard, norms: tuple[str, ...]) -> Layout:
    """Every tensor a checkpoint with separate q/k/v and gate/up tensors and the layer norms
    `norms` holds, and which part of it `shard` reads: q/k/v and gate/up rows (column parallel),
    o_proj and down_proj columns (row parallel); embeddings, norms and the head whole."""
    layout = embedding_layout(config)
    for i in range(config.num_layers):
        layout |= attention_layout(config, shard, i) | mlp_layout(config, shard, i) | norm_layout(config, i, norms)
    return layout


def norm_layout(config: ModelConfig, layer: int, names: tuple[str, ...]) -> Layout:
    """Layer `layer`'s norms of the hidden size, by their (shared) checkpoint and module names."""
    return {
        f"model.layers.{layer}.{name}.weight": CheckpointTensor(f"layers.{layer}.{name}.weight", (config.hidden_size,))
        for name in names
    }
