"""A GGUF file's weights in a model (every family llama.cpp writes, each as its record's GGUF
layout names and transforms them), its quantized tensors kept quantized:
`load_gguf_model` checks every name, shape, type and offset against the config before a byte of
data is read, then fills the model: each quantized type becomes the int4 or int8 QuantizedWeight
that means the same values (weights/gguf_blocks.py), and F32, F16 and BF16 dense
parameters; llama's q/k rows are put back in Hugging Face order and Gemma's norms lose the 1
llama.cpp added. A mixture's experts (3-D tensors, [experts, rows, in]) stay in their file's
types too, every expert's rows in one QuantizedExperts (each expert's gate rows, then its up
rows; gpt-oss's gate and up, stored apart, interleaved again, its expert biases beside them), or
dense Experts parameters from an F16/F32/BF16 file; the router is dense. Under tensor
parallelism each rank keeps its slice of the sharded products (column-parallel rows, row-parallel
whole groups of columns), quantized. The file format itself is read by weights/gguf.py.
"""

from __future__ import annotations

import io
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from compiled_engine.errors import ModelConfigError, ModelLoadError
from compiled_engine.linear.quantize import install_embedding, install_experts, install_linear
from compiled_engine.linear.quantized_experts import QuantizedExperts
from compiled_engine.linear.quantized_weight import QuantizedWeight, concat_rows
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.family import LONG_FACTORS, ROPE_FREQS, SHORT_FACTORS, GGUFLayout
from compiled_engine.model.layers import DecoderModel, in_layers
from compiled_engine.model.moe import Experts
from compiled_engine.model.registry import build_model, check_shard, family_of, family_of_gguf
from compiled_engine.model.shard import NO_SHARD, TPShard
from compiled_engine.weights.gguf import (
    DENSE_TYPES,
    GGUFHeader,
    check_no_overlaps,
    check_tensor,
    read_gguf_header,
    read_tensor,
)
from compiled_engine.weights.gguf_blocks import decode_blocks
from compiled_engine.weights.safetensors_loader import rebuild_rotaries

ROPE_FACTORS = (LONG_FACTORS, SHORT_FACTORS)


@dataclass(frozen=True)
class _Part:
    """A GGUF tensor the config implies: its name, torch-order shape, for llama's q/k the head
    count of the rope permutation llama.cpp applied to its rows, what llama.cpp added to every
    value (Gemma's norms: 1), and the (start, count) of its rows or columns this tensor-parallel
    rank keeps (None: all)."""

    name: str
    shape: tuple[int, ...]
    rope_heads: int | None = None
    offset: float = 0.0
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None


@dataclass(frozen=True)
class _Target:
    """Where parts land: module `module`'s weight (parts stacked by rows) or, with `param` set,
    that dense parameter; with `experts`, `param` of the Experts module `module` (each expert's
    rows of every part in turn, or with `interleaved` alternating), or its half of a
    QuantizedExperts in its place."""

    module: str
    parts: tuple[_Part, ...]
    param: str | None = None
    experts: bool = False
    interleaved: bool = False  # two parts' rows (or bias values) alternate per expert: gpt-oss's gate/up


def _layout(config: ModelConfig) -> GGUFLayout:
    layout = family_of(config).gguf
    if layout is None:
        raise ModelLoadError(f"llama.cpp writes no GGUF of its own for {config.architecture} models")
    return layout


def _targets(config: ModelConfig, shard: TPShard = NO_SHARD, names: Collection[str] = ()) -> list[_Target]:
    """Every tensor a GGUF of this config holds and where it lands, as the family's layout
    (model/family.py) names and transforms them, and what of it `shard` keeps; `names`, the
    file's tensors, say where a mixture's gate and up experts are merged in one."""
    layout = _layout(config)
    h, hd, inter, vocab = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    q_heads = config.num_heads if layout.permuted_qk else None
    kv_heads = config.num_kv_heads if layout.permuted_qk else None
    shift = layout.norm_offset
    P, T = _Part, _Target
    q_rows = kv_rows = inter_rows = None
    if shard.size > 1:
        (q0, qn), (k0, kn), (i0, i_n) = shard.heads(config), shard.kv_heads(config), shard.intermediate(config)
        q_rows, kv_rows, inter_rows = (q0 * hd, qn * hd), (k0 * hd, kn * hd), (i0, i_n)
    targets = [
        T("embed_tokens", (P("token_embd.weight", (vocab, h)),)),
        T("", (P("output_norm.weight", (h,), offset=shift),), "norm.weight"),
    ]
    if not config.tie_word_embeddings:
        targets.append(T("lm_head", (P("output.weight", (vocab, h)),)))
    for i in range(config.num_layers):
        blk, ours = f"blk.{i}.", f"layers.{i}."
        attn = ours + "self_attn."
        qkv: tuple[_Part, ...]
        qkv_bias: tuple[_Part, ...]
        if layout.fused_qkv:
            qkv = (P(blk + "attn_qkv.weight", (q + 2 * kv, h)),)
            qkv_bias = (P(blk + "attn_qkv.bias", (q + 2 * kv,)),)
        else:
            qkv = (
                P(blk + "attn_q.weight", (q, h), q_heads, rows=q_rows),
                P(blk + "attn_k.weight", (kv, h), kv_heads, rows=kv_rows),
                P(blk + "attn_v.weight", (kv, h), rows=kv_rows),
            )
            qkv_bias = (
                P(blk + "attn_q.bias", (q,), q_heads, rows=q_rows),
                P(blk + "attn_k.bias", (kv,), kv_heads, rows=kv_rows),
                P(blk + "attn_v.bias", (kv,), rows=kv_rows),
            )
        targets.append(T(attn + "qkv_proj", qkv))
        targets.append(T(attn + "o_proj", (P(blk + "attn_output.weight", (h, q), cols=q_rows),)))
        if config.qkv_bias:
            targets.append(T("", qkv_bias, attn + "qkv_proj.bias"))
        if config.o_bias:  # whole on every rank (row-parallel: added once, after the sum)
            targets.append(T("", (P(blk + "attn_output.bias", (h,)),), attn + "o_proj.bias"))
        if config.attention_sinks:
            targets.append(T("", (P(blk + "attn_sinks.weight", (config.num_heads,)),), attn + "sinks"))
        if config.qk_norm:
            q_norm, k_norm = (q, kv) if config.qk_norm_whole else (hd, hd)
            targets.append(T("", (P(blk + "attn_q_norm.weight", (q_norm,), offset=shift),), attn + "q_norm.weight"))
            targets.append(T("", (P(blk + "attn_k_norm.weight", (k_norm,), offset=shift),), attn + "k_norm.weight"))
        for theirs, norm in layout.layer_norms:
            targets.append(T("", (P(f"{blk}{theirs}.weight", (h,), offset=shift),), f"{ours}{norm}.weight"))
        if config.moe is not None and config.moe.sparse(i):
            targets += _expert_targets(config, blk, ours + "mlp.", names)
            continue
        if layout.fused_gate_up:
            gate_up: tuple[_Part, ...] = (P(blk + "ffn_up.weight", (2 * inter, h)),)  # gate rows, then up
        else:
            gate_up = (
                P(blk + "ffn_gate.weight", (inter, h), rows=inter_rows),
                P(blk + "ffn_up.weight", (inter, h), rows=inter_rows),
            )
        targets.append(T(ours + "mlp.gate_up_proj", gate_up))
        targets.append(T(ours + "mlp.down_proj", (P(blk + "ffn_down.weight", (h, inter), cols=inter_rows),)))
    return targets


def _expert_targets(config: ModelConfig, blk: str, mlp: str, names: Collection[str]) -> list[_Target]:
    """A sparse layer's tensors: the router, the experts (gate and up separate, or merged as the
    converter's option writes them), and the gated shared expert where the family has one."""
    moe = config.moe
    assert moe is not None
    h, n, inter, shared = config.hidden_size, moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size
    P, T = _Part, _Target
    layout = _layout(config).experts
    assert layout is not None
    experts = mlp + "experts"
    if blk + "ffn_gate_up_exps.weight" in names and not layout.interleaved:
        gate_up: tuple[_Part, ...] = (P(blk + "ffn_gate_up_exps.weight", (n, 2 * inter, h)),)
    else:
        gate_up = (P(blk + "ffn_gate_exps.weight", (n, inter, h)), P(blk + "ffn_up_exps.weight", (n, inter, h)))
    mixed = layout.interleaved
    targets = [
        T("", (P(blk + "ffn_gate_inp.weight", (n, h)),), mlp + "gate.weight"),
        T(experts, gate_up, experts + ".gate_up_proj", experts=True, interleaved=mixed),
        T(experts, (P(blk + "ffn_down_exps.weight", (n, h, inter)),), experts + ".down_proj", experts=True),
    ]
    if layout.biases:  # dense, whole
        biases = (P(blk + "ffn_gate_exps.bias", (n, inter)), P(blk + "ffn_up_exps.bias", (n, inter)))
        targets += [
            T("", (P(blk + "ffn_gate_inp.bias", (n,)),), mlp + "gate.bias"),
            T(experts, biases, experts + ".gate_up_bias", experts=True, interleaved=mixed),
            T(experts, (P(blk + "ffn_down_exps.bias", (n, h)),), experts + ".down_bias", experts=True),
        ]
    if shared:
        gate_up = (P(blk + "ffn_gate_shexp.weight", (shared, h)), P(blk + "ffn_up_shexp.weight", (shared, h)))
        targets.append(T(mlp + "shared_expert.gate_up_proj", gate_up))
        targets.append(T(mlp + "shared_expert.down_proj", (P(blk + "ffn_down_shexp.weight", (h, shared)),)))
    if moe.shared_gate:
        targets.append(T(mlp + "shared_expert_gate", (P(blk + "ffn_gate_inp_shexp.weight", (1, h)),)))
    return targets


def _rope_parts(config: ModelConfig) -> tuple[dict[str, _Part], dict[str, _Part]]:
    """The rope's own tensors, (required, optional): Phi-3's longrope factors, which the config
    already holds (read from this file when it was prepared) and are checked against it; Llama
    3.1's divisors of the rotary frequencies, which a llama file may carry."""
    if config.rope.type == "longrope":
        pairs = (config.rotated_dims // 2,)
        return {name: _Part(name, pairs) for name in (LONG_FACTORS, SHORT_FACTORS)}, {}
    if _layout(config).rope_freqs:
        return {}, {ROPE_FREQS: _Part(ROPE_FREQS, (config.head_dim // 2,))}
    return {}, {}


def _check(header: GGUFHeader, config: ModelConfig, targets: list[_Target]) -> dict[str, _Part]:
    """Every part's name, shape and type against the file, before a byte of data is read."""
    path = header.path
    arch = header.architecture
    experts = header.metadata.get(f"{arch}.expert_count", 0)
    family = family_of_gguf(arch, isinstance(experts, int) and experts > 0) if arch is not None else None
    # Families llama.cpp writes alike (Granite-MoE with and without a shared expert) share a layout.
    if family is None or family.gguf != _layout(config):
        raise ModelLoadError(f"{path} holds a {arch!r} model, the config a {config.architecture!r} one")
    parts = {part.name: part for target in targets for part in target.parts}
    required, optional = _rope_parts(config)
    parts |= required
    for name in header.tensors:
        if name not in parts and name not in optional:
            raise ModelLoadError(
                f"unexpected tensor '{name}' in {path.name}: the {config.architecture} config has no such parameter"
            )
    missing = [name for name in parts if name not in header.tensors]
    if missing:
        shown = ", ".join(f"'{n}'" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{path}: missing tensors {shown}{more}")
    parts.update({name: part for name, part in optional.items() if name in header.tensors})
    spans: list[tuple[int, int, str]] = []
    for name, part in parts.items():
        info = header.tensors[name]
        if info.shape != part.shape:
            raise ModelLoadError(
                f"tensor '{name}' in {path.name} has shape {list(info.shape)}, the config implies {list(part.shape)}"
            )
        spans.append((*check_tensor(header, name), name))
    check_no_overlaps(header, spans)
    return parts


Weight = QuantizedWeight | torch.Tensor


def _read(f: io.BufferedReader, header: GGUFHeader, part: _Part) -> Weight:
    """One tensor from the file, on the CPU: a QuantizedWeight for a quantized type, else a dense
    tensor of the file's own dtype; llama's q/k rows put back in Hugging Face order."""
    info = header.tensors[part.name]
    raw = read_tensor(f, header, part.name)
    weight = raw if info.type in DENSE_TYPES else decode_blocks(raw, info.type)
    if part.offset:  # in fp32, before any narrower run dtype: Gemma's 1 + w back to w
        weight = _dense(weight, torch.float32) - part.offset
    if part.rope_heads is not None:
        weight = _unpermute(weight, part.rope_heads)
    return _slice(weight, part, header)


def _slice(weight: Weight, part: _Part, header: GGUFHeader) -> Weight:
    """The rows or columns of `weight` this tensor-parallel rank keeps."""
    if part.rows is not None:
        start, count = part.rows
        weight = (
            weight.narrow(0, start, count).contiguous()
            if isinstance(weight, torch.Tensor)
            else weight.narrow_rows(start, count)
        )
    if part.cols is not None:
        start, count = part.cols
        if isinstance(weight, torch.Tensor):
            return weight.narrow(1, start, count).contiguous()
        if start % weight.group_size or count % weight.group_size:
            raise ModelLoadError(
                f"tensor '{part.name}' in {header.path.name}: this rank's columns {start}..{start + count} "
                f"split its groups of {weight.group_size}; choose a --tensor-parallel-size that keeps whole groups"
            )
        return weight.narrow_cols(start, count)
    return weight


def _unpermute(weight: Weight, heads: int) -> Weight:
    # llama.cpp stores each head's rows interleaved (pairs of the two rotary halves): row
    # h*d + 2j + s of the file is row h*d + s*d/2 + j of the Hugging Face weight.
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return weight[order]


def _dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    return weight.dequantize(dtype) if isinstance(weight, QuantizedWeight) else weight.to(dtype)


def _fuse(weights: list[Weight], dtype: torch.dtype, dequantize: bool) -> Weight:
    """Parts stacked by rows: quantized when every part is (in their common format, concat_rows;
    with `dequantize`, that stack dequantized: the same rows, one conversion), else dense."""
    if all(isinstance(w, QuantizedWeight) for w in weights):
        quantized = cast(list[QuantizedWeight], weights)
        stacked = quantized[0] if len(quantized) == 1 else concat_rows(quantized)
        return stacked.dequantize(dtype) if dequantize else stacked
    dense = [_dense(w, dtype) for w in weights]
    return dense[0] if len(dense) == 1 else torch.cat(dense)


def _interleaved(rows: int, experts: int) -> torch.Tensor:
    """The order taking each expert's `rows` rows (its gate rows, then its up rows) to gate 0,
    up 0, gate 1, up 1, ..."""
    half = rows // 2
    within = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)
    return (torch.arange(experts).unsqueeze(1) * rows + within).reshape(-1)


def _fuse_experts(
    weights: list[Weight], experts: int, dtype: torch.dtype, dequantize: bool, interleaved: bool = False
) -> Weight:
    """An Experts parameter from its parts ([experts, rows, in] each, as read: a quantized part's
    rows all experts' one after another; or a bias, [experts, rows]): each expert's rows of every
    part in turn (its gate rows, then its up rows), or with `interleaved` alternating. Quantized
    when every part is (concat_rows: gate and up of different types meet in a common format,
    exactly), as [experts * rows, in]; else dense [experts, rows, in] (a bias [experts, rows])."""
    if all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in weights):  # biases
        bias = torch.cat([_dense(w, dtype).reshape(experts, -1) for w in weights], dim=1)
        return bias.reshape(-1)[_interleaved(bias.shape[1], experts)].reshape(experts, -1) if interleaved else bias
    if all(isinstance(w, QuantizedWeight) for w in weights):
        quantized = cast(list[QuantizedWeight], weights)
        stacked = quantized[0]
        if len(quantized) > 1:
            rows = [w.out_features // experts for w in quantized]
            stacked = concat_rows(
                [w.narrow_rows(e * r, r) for e in range(experts) for w, r in zip(quantized, rows, strict=True)]
            )
        if interleaved:
            stacked = stacked[_interleaved(stacked.out_features // experts, experts)]
        if not dequantize:
            return stacked
        weights = [stacked]
    elif interleaved:
        dense_rows = torch.cat([_dense(w, dtype).reshape(experts, -1, w.shape[-1]) for w in weights], dim=1)
        return dense_rows[:, _interleaved(dense_rows.shape[1], 1)]
    dense = [_dense(w, dtype).reshape(experts, -1, w.shape[-1]) for w in weights]
    return dense[0] if len(dense) == 1 else torch.cat(dense, dim=1)


def _experts_module(
    module: str, halves: dict[str, Weight], config: ModelConfig, dtype: torch.dtype, activation: str
) -> QuantizedExperts | None:
    """A QuantizedExperts of Experts module `module`'s two halves (and its biases, where it has
    them) when both halves arrived quantized; else None, and `halves` made its dense parameters
    (a file with one half dense is rare)."""
    moe = config.moe
    assert moe is not None
    gate_up, down = halves[module + ".gate_up_proj"], halves[module + ".down_proj"]
    biases = [halves.get(f"{module}.{name}") for name in ("gate_up_bias", "down_bias")]
    if isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight):
        dense_biases = [None if b is None else _dense(b, dtype) for b in biases]
        return QuantizedExperts(gate_up, down, moe.num_experts, activation, *dense_biases)
    for name in (".gate_up_proj", ".down_proj"):
        weight = halves[module + name]
        halves[module + name] = _dense(weight, dtype).reshape(moe.num_experts, -1, weight.shape[-1])
    return None


def load_gguf_model(
    gguf_path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    dequantize: bool = False,
    shard: TPShard = NO_SHARD,
    layers: range | None = None,
) -> DecoderModel:
    """Build the model on the meta device and fill it from a GGUF file: quantized tensors stay
    quantized (QuantizedLinear, and QuantizedEmbedding for the embedding, which a tied
    head shares), F32/F16/BF16 become dense parameters of `dtype`. With `dequantize`, every
    weight is dense, dequantized exactly as QuantizedWeight.dequantize() does. Names, shapes, types
    and offsets are all checked before any tensor is read. With `shard`, this tensor-parallel
    rank's slices of the sharded products (the rest replicated); with `layers` (a pipeline
    stage's), only those decoder layers are read and held."""
    path = Path(gguf_path)
    check_shard(config, shard)
    if config.moe is not None and shard.size > 1:
        raise ModelConfigError(
            f"--tensor-parallel-size {shard.size}: a mixture of experts from a GGUF file runs on one rank (its "
            "experts are not split across ranks from a GGUF file yet; from a Hugging Face checkpoint they are)"
        )
    header = read_gguf_header(path)
    targets = _targets(config, shard, header.tensors)
    parts = _check(header, config, targets)
    with torch.device("meta"):
        model = build_model(config, shard)
    params: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    experts: dict[str, dict[str, Weight]] = {}
    with path.open("rb") as f:
        for target in targets:
            if not in_layers(target.param or target.module + ".weight", layers):
                continue
            read = [_read(f, header, part) for part in target.parts]
            if target.experts:
                assert config.moe is not None and target.param is not None
                fused = _fuse_experts(read, config.moe.num_experts, dtype, dequantize, target.interleaved)
                experts.setdefault(target.module, {})[target.param] = fused.to(device)
                continue
            weight = _fuse(read, dtype, dequantize)
            if target.param is not None:
                params[target.param] = _dense(weight, dtype).to(device)
            elif isinstance(weight, QuantizedWeight):
                quantized[target.module] = weight.to(device)
            else:
                params[target.module + ".weight"] = weight.to(device)
        rope_freqs = _read(f, header, parts[ROPE_FREQS]) if ROPE_FREQS in parts else None
        factors = {name: _dense(_read(f, header, parts[name]), torch.float32) for name in ROPE_FACTORS if name in parts}
    quantized_experts = {}
    for module, halves in experts.items():
        held = _experts_module(module, halves, config, dtype, cast(Experts, model.get_submodule(module)).activation)
        if held is None:
            params |= cast(dict[str, torch.Tensor], halves)
        else:
            quantized_experts[module] = held
    for module, weight in quantized.items():
        if module == "embed_tokens":
            install_embedding(model, weight)
        else:
            install_linear(model, module, weight, params.pop(module + ".bias", None))
    model.load_state_dict(params, strict=False, assign=True)
    for module, held in quantized_experts.items():
        install_experts(model, module, held)
    if config.tie_word_embeddings:
        if isinstance(model.embed_tokens, nn.Embedding):
            model.lm_head.weight = cast(nn.Parameter, model.embed_tokens.weight)  # one tensor, as in the file
        else:
            install_linear(model, "lm_head", model.embed_tokens.weight)  # the same quantized table
    if layers is not None:
        model.keep_layers(layers)
    _check_rope_factors(config, factors, path)
    rebuild_rotaries(model, device)
    if rope_freqs is not None:
        _apply_rope_freqs(model, config, rope_freqs, path)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"{path}: nothing was loaded into {', '.join(left[:5])}")
    return model.eval()


def _apply_rope_freqs(model: DecoderModel, config: ModelConfig, rope_freqs: Weight, path: Path) -> None:
    # Llama 3.1's rope scaling as llama.cpp stores it: one divisor per rotary frequency.
    if config.rope.type != "default":
        raise ModelLoadError(f"{path} has {ROPE_FREQS} and the config rope scaling {config.rope.type!r}: both scale")
    divisors = _dense(rope_freqs, torch.float32).to(model.rotary.inv_freq.device)
    model.rotary.inv_freq = model.rotary.inv_freq / divisors


def _check_rope_factors(config: ModelConfig, factors: dict[str, torch.Tensor], path: Path) -> None:
    # Phi-3's longrope factors reach the model through its config, which was read from this
    # file when it was prepared; a config from elsewhere must agree with them.
    for name, key in ((LONG_FACTORS, "long_factor"), (SHORT_FACTORS, "short_factor")):
        if name in factors and not torch.equal(factors[name], torch.tensor(getattr(config.rope, key))):
            raise ModelLoadError(f"{path}: {name} differs from the config's rope {key}; the config is another model's")
