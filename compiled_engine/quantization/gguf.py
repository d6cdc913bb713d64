"""A GGUF file's weights in a model (Llama and Qwen3 as llama.cpp writes them), its quantized
tensors kept quantized: `load_gguf_model` checks every name, shape, type and offset against the
config before a byte of data is read, then fills the model: Q8_0 becomes an int8
QuantizedWeight in groups of 32, Q4_0 and Q4_1 int4 in groups of 32 whose nibble bytes are the
file's own, and F32, F16 and BF16 dense parameters; llama's q/k rows are put back in Hugging Face
order. The file format itself is read by model/gguf.py.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from compiled_engine.errors import ModelLoadError
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.families import build_model
from compiled_engine.model.gguf import (
    BLOCK,
    DENSE_TYPES,
    Q4_0,
    Q8_0,
    GGUFHeader,
    GGUFTensor,
    block_fields,
    check_no_overlaps,
    check_tensor,
    read_gguf_header,
    read_tensor,
)
from compiled_engine.model.layers import DecoderModel
from compiled_engine.model.loader import rebuild_rotaries
from compiled_engine.model.shard import NO_SHARD
from compiled_engine.quantization.apply import install_embedding, install_linear
from compiled_engine.quantization.weights import QuantizedWeight, concat_rows


@dataclass(frozen=True)
class _Part:
    """A GGUF tensor the config implies: its name, torch-order shape, and for llama's q/k the head
    count of the rope permutation llama.cpp applied to its rows."""

    name: str
    shape: tuple[int, ...]
    rope_heads: int | None = None


@dataclass(frozen=True)
class _Target:
    """Where parts land: module `module`'s weight (parts stacked by rows) or, with `param` set,
    that dense parameter."""

    module: str
    parts: tuple[_Part, ...]
    param: str | None = None


ROPE_FREQS = "rope_freqs.weight"


def _targets(config: ModelConfig) -> list[_Target]:
    h, hd, inter, vocab = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    permuted = config.architecture == "llama"  # llama.cpp reorders q/k rows for its rope; not Qwen's
    q_heads = config.num_heads if permuted else None
    kv_heads = config.num_kv_heads if permuted else None
    P, T = _Part, _Target
    targets = [
        T("embed_tokens", (P("token_embd.weight", (vocab, h)),)),
        T("", (P("output_norm.weight", (h,)),), "norm.weight"),
    ]
    if not config.tie_word_embeddings:
        targets.append(T("lm_head", (P("output.weight", (vocab, h)),)))
    for i in range(config.num_layers):
        blk, ours = f"blk.{i}.", f"layers.{i}."
        attn = ours + "self_attn."
        targets.append(
            T(
                attn + "qkv_proj",
                (
                    P(blk + "attn_q.weight", (q, h), q_heads),
                    P(blk + "attn_k.weight", (kv, h), kv_heads),
                    P(blk + "attn_v.weight", (kv, h)),
                ),
            )
        )
        targets.append(T(attn + "o_proj", (P(blk + "attn_output.weight", (h, q)),)))
        if config.qkv_bias:
            biases = (P(blk + "attn_q.bias", (q,), q_heads), P(blk + "attn_k.bias", (kv,), kv_heads))
            targets.append(T("", (*biases, P(blk + "attn_v.bias", (kv,))), attn + "qkv_proj.bias"))
        if config.o_bias:
            targets.append(T("", (P(blk + "attn_output.bias", (h,)),), attn + "o_proj.bias"))
        if config.qk_norm:
            targets.append(T("", (P(blk + "attn_q_norm.weight", (hd,)),), attn + "q_norm.weight"))
            targets.append(T("", (P(blk + "attn_k_norm.weight", (hd,)),), attn + "k_norm.weight"))
        gate_up = (P(blk + "ffn_gate.weight", (inter, h)), P(blk + "ffn_up.weight", (inter, h)))
        targets.append(T(ours + "mlp.gate_up_proj", gate_up))
        targets.append(T(ours + "mlp.down_proj", (P(blk + "ffn_down.weight", (h, inter)),)))
        targets.append(T("", (P(blk + "attn_norm.weight", (h,)),), ours + "input_layernorm.weight"))
        targets.append(T("", (P(blk + "ffn_norm.weight", (h,)),), ours + "post_attention_layernorm.weight"))
    return targets


def _check(header: GGUFHeader, config: ModelConfig, targets: list[_Target]) -> dict[str, _Part]:
    """Every part's name, shape and type against the file, before a byte of data is read."""
    path = header.path
    arch = header.architecture
    if arch != config.architecture:
        raise ModelLoadError(f"{path} holds a {arch!r} model, the config a {config.architecture!r} one")
    parts = {part.name: part for target in targets for part in target.parts}
    optional = {ROPE_FREQS: _Part(ROPE_FREQS, (config.head_dim // 2,))} if arch == "llama" else {}
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
    """One tensor from the file, on the CPU: a QuantizedWeight for Q8_0/Q4_0/Q4_1, else a dense
    tensor of the file's own dtype; llama's q/k rows put back in Hugging Face order."""
    info = header.tensors[part.name]
    raw = read_tensor(f, header, part.name)
    weight = raw if info.type in DENSE_TYPES else _quantized(raw, info)
    return weight if part.rope_heads is None else _unpermute(weight, part.rope_heads)


def _quantized(blocks: torch.Tensor, info: GGUFTensor) -> QuantizedWeight:
    """GGUF's blocks as the engine's formats: Q8_0 is int8 in groups of 32; Q4_1 int4 in groups
    of 32 with d and m the scale and offset; Q4_0 `d * (q - 8)`, that is offset `-8 d`."""
    data, d, m = block_fields(blocks, info.type)
    width = info.shape[1]
    if info.type == Q8_0:
        return QuantizedWeight("int8", data, d, None, BLOCK, width)
    if info.type == Q4_0:
        return QuantizedWeight("int4", data, d, -8 * d, BLOCK, width)
    return QuantizedWeight("int4", data, d, m, BLOCK, width)  # Q4_1


def _unpermute(weight: Weight, heads: int) -> Weight:
    # llama.cpp stores each head's rows interleaved (pairs of the two rotary halves): row
    # h*d + 2j + s of the file is row h*d + s*d/2 + j of the Hugging Face weight.
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(weight, torch.Tensor):
        return weight[order]
    offsets = None if weight.offsets is None else weight.offsets[order]
    return QuantizedWeight(
        weight.format, weight.data[order], weight.scales[order], offsets, weight.group_size, weight.in_features
    )


def _dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    return weight.dequantize(dtype) if isinstance(weight, QuantizedWeight) else weight.to(dtype)


def _fuse(weights: list[Weight], dtype: torch.dtype, dequantize: bool) -> Weight:
    """Parts stacked by rows: quantized when every part is of one format and group (with
    `dequantize`, that stack dequantized: the same rows, one conversion), else dense."""
    if all(isinstance(w, QuantizedWeight) for w in weights):
        quantized = cast(list[QuantizedWeight], weights)
        first = quantized[0]
        if all((w.format, w.group_size) == (first.format, first.group_size) for w in quantized):
            stacked = first if len(quantized) == 1 else concat_rows(quantized)
            return stacked.dequantize(dtype) if dequantize else stacked
    dense = [_dense(w, dtype) for w in weights]
    return dense[0] if len(dense) == 1 else torch.cat(dense)


def load_gguf_model(
    gguf_path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    dequantize: bool = False,
) -> DecoderModel:
    """Build the model on the meta device and fill it from a GGUF file: Q8_0, Q4_0 and Q4_1
    tensors stay quantized (QuantizedLinear, and QuantizedEmbedding for the embedding, which a tied
    head shares), F32/F16/BF16 become dense parameters of `dtype`. With `dequantize`, every
    weight is dense, dequantized exactly as QuantizedWeight.dequantize() does. Names, shapes, types
    and offsets are all checked before any tensor is read."""
    path = Path(gguf_path)
    header = read_gguf_header(path)
    targets = _targets(config)
    parts = _check(header, config, targets)
    with torch.device("meta"):
        model = build_model(config, NO_SHARD)
    params: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    with path.open("rb") as f:
        for target in targets:
            weight = _fuse([_read(f, header, part) for part in target.parts], dtype, dequantize)
            if target.param is not None:
                params[target.param] = _dense(weight, dtype).to(device)
            elif isinstance(weight, QuantizedWeight):
                quantized[target.module] = weight.to(device)
            else:
                params[target.module + ".weight"] = weight.to(device)
        rope_freqs = _read(f, header, parts[ROPE_FREQS]) if ROPE_FREQS in parts else None
    for module, weight in quantized.items():
        if module == "embed_tokens":
            install_embedding(model, weight)
        else:
            install_linear(model, module, weight, params.pop(module + ".bias", None))
    model.load_state_dict(params, strict=False, assign=True)
    if config.tie_word_embeddings:
        if isinstance(model.embed_tokens, nn.Embedding):
            model.lm_head.weight = cast(nn.Parameter, model.embed_tokens.weight)  # one tensor, as in the file
        else:
            install_linear(model, "lm_head", model.embed_tokens.weight)  # the same quantized table
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
