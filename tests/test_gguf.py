"""GGUF import: the default model's Q4_1/Q8_0 file against transformers' own dequantization of
it, tiny Llama and Qwen3 GGUFs written here with gguf-py (every supported tensor type) against
transformers and against gguf-py's dequantization, the prepared directory's config and
tokenizer, and every way of breaking a file."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from torch import nn

from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.attention.op import attention_forward
from compiled_engine.attention.torch_backend import TorchAttentionBackend
from compiled_engine.errors import ModelLoadError, ModelSourceError
from compiled_engine.linear.quantized import QuantizedEmbedding, QuantizedLinear
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.layers import rope_inverse_frequencies
from compiled_engine.model.llama import Linear, Transformer, checkpoint_layout
from compiled_engine.model.registry import config_from_dict, config_from_model_dir
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.weights import gguf_dir as gguf_module
from compiled_engine.weights.default_model import GGUF_NAME, default_model_dir
from compiled_engine.weights.gguf import gguf_file, read_gguf_header
from compiled_engine.weights.gguf_dir import prepare_gguf_dir
from compiled_engine.weights.gguf_loader import load_gguf_model
from compiled_engine.weights.source import resolve_model_dir
from reference_oracle import ReferenceOracle

CPU = torch.device("cpu")
DEFAULT_DIR = default_model_dir()
DEFAULT_GGUF = DEFAULT_DIR / GGUF_NAME
needs_default = pytest.mark.skipif(not DEFAULT_GGUF.is_file(), reason="the default model's GGUF is not prepared")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cache(private_cache: Path) -> Path:
    """A private engine cache, so prepared directories land in the test's own folder."""
    return private_cache


# --- running our model, and reading its weights back --------------------------------------------


@torch.inference_mode()
def our_logits(model: Transformer, ids: list[int], page_size: int = 4) -> torch.Tensor:
    """Logits at every position of one prompt, through the reference attention backend."""
    config = model.config
    pages = -(-len(ids) // page_size)
    kv = torch.zeros(config.num_layers, pages, 2, page_size, config.num_kv_heads, config.head_dim)
    metadata = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(pages))], page_size, CPU)
    backend = TorchAttentionBackend()
    with attention_forward(backend, backend.prepare(metadata, kv)):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv)
    return model.compute_logits(hidden)


def dense_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """Every weight of the model as a dense fp32 tensor, by parameter name (a quantized module's
    weight dequantized under `<module>.weight`)."""
    out = {name: p.detach().float() for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            out[f"{name}.weight"] = module.weight.dequantize()
    return out


def fused(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict in our names, q/k/v and gate/up rows stacked."""
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for hf_name, where in checkpoint_layout(config).items():
        parts.setdefault(where.param, []).append((where.start, hf_state[hf_name]))
    return {name: torch.cat([t for _, t in sorted(p, key=lambda x: x[0])]) for name, p in parts.items()}


# --- the default model's GGUF ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_config() -> ModelConfig:
    return config_from_model_dir(DEFAULT_DIR)


@pytest.fixture(scope="module")
def transformers_weights(default_config: ModelConfig, default_oracle: ReferenceOracle) -> dict[str, torch.Tensor]:
    """transformers' dequantization of the default GGUF, in our names: the session's oracle,
    which loads the file under the fp32 conversion's config.json, so that the file's metadata is
    not parsed a second time."""
    assert default_oracle.model_dir == DEFAULT_DIR
    return fused(default_oracle.model.state_dict(), default_config)


@pytest.fixture(scope="module")
def default_quantized(default_config: ModelConfig) -> Transformer:
    return load_gguf_model(DEFAULT_GGUF, default_config, torch.float32, CPU)


@needs_default
def test_default_gguf_weights_equal_transformers_dequantization(
    default_quantized: Transformer, default_config: ModelConfig, transformers_weights: dict[str, torch.Tensor]
) -> None:
    """Every weight, dequantized, bit for bit as transformers dequantizes the same file (which
    also proves q/k are put back in Hugging Face row order), and the dense twin likewise."""
    ours = dense_weights(default_quantized)
    assert set(ours) == set(transformers_weights) | {"lm_head.weight"}  # tied: the head is the embedding
    for name, want in transformers_weights.items():
        assert torch.equal(ours[name], want), name
    assert torch.equal(ours["lm_head.weight"], transformers_weights["embed_tokens.weight"])
    dense = load_gguf_model(DEFAULT_GGUF, default_config, torch.float32, CPU, dequantize=True)
    assert not any(isinstance(m, QuantizedLinear | QuantizedEmbedding) for m in dense.modules())
    params = dict(dense.named_parameters())
    assert set(params) == set(transformers_weights)
    for name, want in transformers_weights.items():
        assert params[name].dtype == torch.float32
        assert torch.equal(params[name], want), name
    assert dense.lm_head.weight is dense.embed_tokens.weight


@needs_default
def test_default_gguf_keeps_its_quantized_tensors(default_quantized: Transformer) -> None:
    """Q4_1 layer weights are int4 group 32 QuantizedLinear; the Q8_0 embedding is an int8 group 32
    QuantizedEmbedding whose tensors the tied head shares (one table in memory)."""
    model = default_quantized
    for i in range(model.config.num_layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            module = model.get_submodule(f"layers.{i}.{name}")
            assert isinstance(module, QuantizedLinear)
            assert (module.format, module.group_size) == ("int4", 32)
            assert module.offsets is not None
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear)
    for module in (model.embed_tokens, model.lm_head):
        assert (module.format, module.group_size, module.data.dtype) == ("int8", 32, torch.int8)
    assert model.lm_head.data.data_ptr() == model.embed_tokens.data.data_ptr()
    assert model.lm_head.scales.data_ptr() == model.embed_tokens.scales.data_ptr()


@needs_default
def test_default_gguf_int4_bytes_are_the_files_own(default_quantized: Transformer) -> None:
    """Q4_1's 16 nibble bytes per block are the int4 data as they are (v: rows not permuted), its
    fp16 d and m the scales and offsets."""
    header = read_gguf_header(DEFAULT_GGUF)
    info = header.tensors["blk.3.attn_v.weight"]
    rows, width = info.shape
    with DEFAULT_GGUF.open("rb") as f:
        f.seek(info.offset)
        raw = np.frombuffer(f.read(rows * width // 32 * 20), dtype=np.uint8).reshape(rows, width // 32, 20)
    qkv = default_quantized.get_submodule("layers.3.self_attn.qkv_proj")
    assert isinstance(qkv, QuantizedLinear) and qkv.offsets is not None
    config = default_quantized.config
    v = slice(config.q_size + config.kv_size, config.q_size + 2 * config.kv_size)
    assert np.array_equal(qkv.data[v].numpy(), raw[..., 4:].reshape(rows, width // 2))
    assert np.array_equal(qkv.scales[v].numpy(), raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    assert np.array_equal(qkv.offsets[v].numpy(), raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))


@needs_default
def test_prepare_gguf_dir_on_the_default_file(cache: Path, default_config: ModelConfig) -> None:
    """The config from the GGUF metadata is the fp32 conversion's; the tokenizer files beside
    the GGUF are used; a second call reuses the directory without reading the file again."""
    prepared = prepare_gguf_dir(DEFAULT_GGUF)
    assert prepared.parent == cache / "models" / "gguf"
    assert config_from_model_dir(prepared) == default_config
    assert gguf_file(prepared) == prepared / GGUF_NAME
    assert (prepared / GGUF_NAME).resolve() == DEFAULT_GGUF.resolve()
    assert (prepared / "tokenizer.json").read_bytes() == (DEFAULT_DIR / "tokenizer.json").read_bytes()
    tokenizer = Tokenizer(prepared)
    assert tokenizer.chat_template_source == read_gguf_header(DEFAULT_GGUF).metadata["tokenizer.chat_template"]
    assert tokenizer.eos_token_ids == {2}
    stamp = (prepared / "config.json").stat().st_mtime_ns
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_module, "read_gguf_header", _must_not_be_called)
        assert prepare_gguf_dir(DEFAULT_GGUF) == prepared
    assert (prepared / "config.json").stat().st_mtime_ns == stamp


def _must_not_be_called(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the prepared directory should have been reused")


TEXTS = ["Hello, world! How are you today?", "naïve café — 日本語のテキスト 🙂", "  spaces\tand\nnewlines  "]


@needs_default
def test_prepare_gguf_dir_builds_the_tokenizer_from_the_gguf(tmp_path: Path, cache: Path) -> None:
    """With no tokenizer.json beside it, the tokenizer is built from the GGUF's vocabulary and
    merges. It encodes plain text, non-ASCII text and chat prompts exactly as transformers'
    tokenizer from this GGUF does: the default directory's, which prepare saved from it."""
    from transformers import AutoTokenizer

    alone = tmp_path / "alone" / "smollm2.gguf"
    alone.parent.mkdir()
    shutil.copyfile(DEFAULT_GGUF, alone)
    prepared = prepare_gguf_dir(alone)
    assert not (prepared / "tokenizer.json").samefile(DEFAULT_DIR / "tokenizer.json")
    ours = Tokenizer(prepared)
    reference = AutoTokenizer.from_pretrained(str(DEFAULT_DIR))
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "user", "content": TEXTS[1]}]
    want = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.encode_chat(messages) == list(want)
    assert ours.eos_token_ids == {2}


# --- tiny GGUFs written here -----------------------------------------------------------------------


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte, the alphabet of a byte-level BPE vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


EPS = float(np.float32(1e-6))  # as the file stores it
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
TOKENS = SPECIALS + _byte_chars() + [m.replace(" ", "") for m in MERGES]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY = {
    "llama": dict(hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16, tied=False),
    # transformers reads no head size from a qwen3 GGUF and takes Qwen3's default of 128.
    "qwen3": dict(hidden=64, inter=128, heads=2, kv_heads=1, head_dim=128, tied=True),
}
# Every supported type, and fused weights whose parts agree (stay quantized) or do not (dense).
TYPES = {
    "blk.0.attn_q.weight": QT.Q8_0,
    "blk.0.attn_k.weight": QT.Q8_0,
    "blk.0.attn_v.weight": QT.Q8_0,
    "blk.0.attn_output.weight": QT.Q4_0,
    "blk.0.ffn_gate.weight": QT.Q4_0,
    "blk.0.ffn_up.weight": QT.Q4_1,
    "blk.0.ffn_down.weight": QT.F16,
    "blk.1.attn_q.weight": QT.Q4_1,
    "blk.1.attn_k.weight": QT.F16,
    "blk.1.attn_v.weight": QT.Q4_0,
    "blk.1.attn_output.weight": QT.Q8_0,
    "blk.1.ffn_gate.weight": QT.BF16,
    "blk.1.ffn_up.weight": QT.F32,
    "blk.1.ffn_down.weight": QT.Q4_1,
    "output.weight": QT.Q8_0,
}
EMBEDDING_TYPE = {"llama": QT.F16, "qwen3": QT.Q8_0}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives Llama's q and k weights."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class TinyGGUF:
    path: Path
    arch: str
    types: dict[str, QT]
    stored: dict[str, np.ndarray]  # what the file holds, per tensor (quantized bytes or floats)

    def dequantized(self, name: str) -> torch.Tensor:
        """gguf-py's dequantization of a tensor, q/k rows back in Hugging Face order."""
        w = gguf.quants.dequantize(self.stored[name], self.types[name]).astype(np.float32)
        spec = TINY[self.arch]
        if self.arch == "llama" and ".attn_q." in name:
            w = llama_cpp_unpermute(w, spec["heads"])
        elif self.arch == "llama" and ".attn_k." in name:
            w = llama_cpp_unpermute(w, spec["kv_heads"])
        return torch.from_numpy(np.ascontiguousarray(w))


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    types: dict[str, QT] | None = None,
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    metadata: dict[str, Any] | None = None,
    drop_metadata: tuple[str, ...] = (),
    file_arch: str | None = None,
    seed: int = 0,
) -> TinyGGUF:
    """A two-layer model as llama.cpp lays it out, random weights (q/k permuted for Llama)."""
    spec = TINY[arch]
    h, inter, hd = spec["hidden"], spec["inter"], spec["head_dim"]
    q, kv = spec["heads"] * hd, spec["kv_heads"] * hd
    vocab = len(TOKENS)
    shape_of = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    if not spec["tied"]:
        shape_of["output.weight"] = (vocab, h)
    for i in range(2):
        b = f"blk.{i}."
        shape_of |= {
            b + "attn_norm.weight": (h,),
            b + "attn_q.weight": (q, h),
            b + "attn_k.weight": (kv, h),
            b + "attn_v.weight": (kv, h),
            b + "attn_output.weight": (h, q),
            b + "ffn_norm.weight": (h,),
            b + "ffn_gate.weight": (inter, h),
            b + "ffn_up.weight": (inter, h),
            b + "ffn_down.weight": (h, inter),
        }
        if arch == "qwen3":
            shape_of |= {b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}
    shape_of |= shapes or {}
    chosen = {**TYPES, "token_embd.weight": EMBEDDING_TYPE[arch], **(types or {})}
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), file_arch or arch)
    meta: dict[str, Any] = {
        f"{arch}.block_count": 2,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": h,
        f"{arch}.feed_forward_length": inter,
        f"{arch}.attention.head_count": spec["heads"],
        f"{arch}.attention.head_count_kv": spec["kv_heads"],
        f"{arch}.attention.key_length": hd,
        f"{arch}.attention.value_length": hd,
        f"{arch}.rope.dimension_count": hd,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": EPS,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.chat_template": CHAT_TEMPLATE,
        **(metadata or {}),
    }
    for key, value in meta.items():
        if key in drop_metadata:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    stored: dict[str, np.ndarray] = {}
    for name, shape in shape_of.items():
        if name in drop:
            continue
        if len(shape) == 1:
            w = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            w = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        if arch == "llama" and ".attn_q." in name:
            w = llama_cpp_permute(w, spec["heads"])
        elif arch == "llama" and ".attn_k." in name:
            w = llama_cpp_permute(w, spec["kv_heads"])
        qtype = chosen.get(name, QT.F32)
        stored[name] = gguf.quants.quantize(w, qtype)
        raw_dtype = None if qtype in (QT.F32, QT.F16) else qtype
        writer.add_tensor(name, stored[name], raw_dtype=raw_dtype)
    for name, array in (extra or {}).items():
        stored[name] = array
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, arch, {**{n: QT.F32 for n in stored}, **chosen}, stored)


def tiny_config(arch: str) -> ModelConfig:
    spec = TINY[arch]
    return config_from_dict(
        {
            "model_type": arch,
            "vocab_size": len(TOKENS),
            "hidden_size": spec["hidden"],
            "intermediate_size": spec["inter"],
            "num_hidden_layers": 2,
            "num_attention_heads": spec["heads"],
            "num_key_value_heads": spec["kv_heads"],
            "head_dim": spec["head_dim"],
            "rms_norm_eps": EPS,
            "rope_theta": 10000.0,
            "max_position_embeddings": 256,
            "tie_word_embeddings": spec["tied"],
        }
    )


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyGGUF:
    return write_tiny_gguf(tmp_path_factory.mktemp(request.param) / "tiny.gguf", request.param)


def test_tiny_gguf_weights_equal_gguf_py_dequantization(tiny: TinyGGUF) -> None:
    """Each tensor type decoded bit for bit as gguf-py dequantizes it, in the quantized model and
    in the dense twin; fused parts of one format stay quantized, mixed ones become dense."""
    config = tiny_config(tiny.arch)
    quantized = load_gguf_model(tiny.path, config, torch.float32, CPU)
    dense = load_gguf_model(tiny.path, config, torch.float32, CPU, dequantize=True)
    want: dict[str, torch.Tensor] = {
        "embed_tokens.weight": tiny.dequantized("token_embd.weight"),
        "norm.weight": tiny.dequantized("output_norm.weight"),
    }
    if not config.tie_word_embeddings:
        want["lm_head.weight"] = tiny.dequantized("output.weight")
    for i in range(2):
        b, ours = f"blk.{i}.", f"layers.{i}."
        want[ours + "self_attn.qkv_proj.weight"] = torch.cat([tiny.dequantized(b + f"attn_{x}.weight") for x in "qkv"])
        want[ours + "self_attn.o_proj.weight"] = tiny.dequantized(b + "attn_output.weight")
        want[ours + "mlp.gate_up_proj.weight"] = torch.cat(
            [tiny.dequantized(b + f"ffn_{x}.weight") for x in ("gate", "up")]
        )
        want[ours + "mlp.down_proj.weight"] = tiny.dequantized(b + "ffn_down.weight")
        want[ours + "input_layernorm.weight"] = tiny.dequantized(b + "attn_norm.weight")
        want[ours + "post_attention_layernorm.weight"] = tiny.dequantized(b + "ffn_norm.weight")
        if config.qk_norm:
            want[ours + "self_attn.q_norm.weight"] = tiny.dequantized(b + "attn_q_norm.weight")
            want[ours + "self_attn.k_norm.weight"] = tiny.dequantized(b + "attn_k_norm.weight")
    got_quantized, got_dense = dense_weights(quantized), dict(dense.named_parameters())
    for name, tensor in want.items():
        assert torch.equal(got_quantized[name], tensor), name
        assert torch.equal(got_dense[name], tensor), name
    assert set(got_dense) == set(want)

    expected: dict[str, tuple[str, int] | None] = {
        "layers.0.self_attn.qkv_proj": ("int8", 32),  # Q8_0 x3
        "layers.0.self_attn.o_proj": ("int4", 32),  # Q4_0
        "layers.0.mlp.gate_up_proj": ("int4", 32),  # Q4_0 + Q4_1: both int4 group 32, stacked as they are
        "layers.0.mlp.down_proj": None,  # F16
        "layers.1.self_attn.qkv_proj": None,  # Q4_1 + F16 + Q4_0: mixed, dense
        "layers.1.self_attn.o_proj": ("int8", 32),
        "layers.1.mlp.gate_up_proj": None,  # BF16 + F32
        "layers.1.mlp.down_proj": ("int4", 32),
        "lm_head": ("int8", 32),
    }
    for name, kind in expected.items():
        module = quantized.get_submodule(name)
        if kind is None:
            assert type(module) is Linear and module.weight.dtype == torch.float32
        else:
            assert isinstance(module, QuantizedLinear) and (module.format, module.group_size) == kind
    if tiny.arch == "qwen3":  # Q8_0 tied embedding: one table for both
        assert isinstance(quantized.embed_tokens, QuantizedEmbedding) and isinstance(quantized.lm_head, QuantizedLinear)
        assert quantized.lm_head.data is quantized.embed_tokens.data
    else:
        assert type(quantized.embed_tokens) is nn.Embedding
    assert not any(isinstance(m, QuantizedLinear | QuantizedEmbedding) for m in dense.modules())


def test_tiny_gguf_logits_match_transformers(tiny: TinyGGUF) -> None:
    """Our model from the GGUF, quantized and dense, gives transformers' logits for the same file."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        str(tiny.path.parent), gguf_file=tiny.path.name, dtype=torch.float32
    )
    ids = [1, 40, 99, 7, 150, 3, 261, 200, 45, 12, 88]
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0]
    config = tiny_config(tiny.arch)
    # The quantized products may run the native kernels (another summation order); the dense
    # twin runs the very weights transformers dequantized.
    for dequantize, tolerance in ((False, 1e-4), (True, 1e-5)):
        model = load_gguf_model(tiny.path, config, torch.float32, CPU, dequantize=dequantize)
        torch.testing.assert_close(our_logits(model, ids), want, atol=tolerance, rtol=tolerance)


def test_tiny_gguf_in_bfloat16(tiny: TinyGGUF) -> None:
    """Dense parameters take the run dtype; quantized tensors keep their own (fp32 scales)."""
    model = load_gguf_model(tiny.path, tiny_config(tiny.arch), torch.bfloat16, CPU)
    assert model.get_parameter("layers.0.mlp.down_proj.weight").dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.bfloat16
    qkv = model.get_submodule("layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, QuantizedLinear) and qkv.scales.dtype == torch.float32


def test_llama_rope_freqs_scale_the_rotary_frequencies(tmp_path: Path) -> None:
    """Llama 3.1's rope scaling as llama.cpp writes it (a `rope_freqs` tensor of divisors) gives the
    frequencies the llama3 rope config would."""
    config = tiny_config("llama")
    llama3 = config_from_dict(
        {
            **_as_hf(config),
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        }
    ).rope
    plain = rope_inverse_frequencies(config.rope, config.head_dim)
    divisors = (plain / rope_inverse_frequencies(llama3, config.head_dim)).numpy().astype(np.float32)
    tiny = write_tiny_gguf(tmp_path / "rope.gguf", extra={"rope_freqs.weight": divisors})
    model = load_gguf_model(tiny.path, config, torch.float32, CPU)
    torch.testing.assert_close(model.rotary.inv_freq, rope_inverse_frequencies(llama3, config.head_dim))


def _as_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope.theta,
        "tie_word_embeddings": config.tie_word_embeddings,
    }


def test_prepare_gguf_dir_on_a_tiny_qwen3(tmp_path: Path, cache: Path) -> None:
    """The config comes from the metadata (head size from key_length, tied head without
    output.weight); the tokenizer is built from the GGUF's own vocabulary and merges; `--model
    file.gguf` resolves to the same directory; a changed file gets a new one."""
    path = write_tiny_gguf(tmp_path / "qwen.gguf", "qwen3", drop_metadata=("qwen3.rope.dimension_count",)).path
    prepared = prepare_gguf_dir(path)
    config = config_from_model_dir(prepared)
    assert config == config_from_dict({**_as_hf(tiny_config("qwen3")), "eos_token_id": 2, "bos_token_id": 1})
    assert config.qk_norm and config.tie_word_embeddings and config.head_dim == 128
    assert json.loads((prepared / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    tokenizer = Tokenizer(prepared)
    hello, world = TOKENS.index("hello"), TOKENS.index("Ġworld")
    assert tokenizer.encode("hello world") == [hello, world]
    assert tokenizer.decode([hello, world]) == "hello world"
    assert tokenizer.encode_chat([{"role": "user", "content": "hello"}]) == tokenizer.encode(
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert tokenizer.eos_token_ids == {2}
    assert resolve_model_dir(str(path)) == prepared
    found = gguf_file(prepared)
    assert found is not None and found.resolve() == path.resolve()
    assert gguf_file(tmp_path) is None
    model = load_gguf_model(found, config, torch.float32, CPU)
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert prepare_gguf_dir(path) != prepared


def test_prepare_takes_the_tokenizer_beside_a_link(tmp_path: Path, cache: Path) -> None:
    """A Hub snapshot's `model.gguf` is a link into a folder of blobs: the tokenizer files beside
    the link are the model's, and they are used as they are."""
    blob = write_tiny_gguf(tmp_path / "blobs" / "0123abcd", "qwen3").path
    built = prepare_gguf_dir(write_tiny_gguf(tmp_path / "other" / "tiny.gguf", "qwen3").path)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.gguf").symlink_to(blob)
    shutil.copyfile(built / "tokenizer.json", snapshot / "tokenizer.json")
    marked = {**json.loads((built / "tokenizer_config.json").read_text()), "model_max_length": 1234}
    (snapshot / "tokenizer_config.json").write_text(json.dumps(marked))
    prepared = prepare_gguf_dir(snapshot / "model.gguf")
    assert prepared != built
    assert (prepared / "tokenizer.json").read_bytes() == (built / "tokenizer.json").read_bytes()
    assert json.loads((prepared / "tokenizer_config.json").read_text()) == marked
    assert (prepared / GGUF_NAME).resolve() == blob.resolve()


def test_prepare_needs_neither_transformers_nor_gguf_py(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer of a GGUF alone is built from its metadata by the engine itself."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf").path
    for name in ("transformers", "gguf"):
        monkeypatch.setitem(sys.modules, name, None)  # `import transformers` now fails
    tokenizer = Tokenizer(prepare_gguf_dir(path))
    hello, world = TOKENS.index("hello"), TOKENS.index("Ġworld")
    assert tokenizer.encode("hello world") == [hello, world]
    assert tokenizer.encode("<|im_start|>hello", add_special_tokens=False) == [1, hello]


def test_prepare_refuses_a_tokenizer_of_another_model(tmp_path: Path, cache: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf").path
    if not (DEFAULT_DIR / "tokenizer.json").is_file():
        pytest.skip("the default model is not prepared")
    shutil.copyfile(DEFAULT_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ModelSourceError, match=r"tokenizer.json has 49152 tokens but tiny.gguf a vocabulary of \d+"):
        prepare_gguf_dir(path)


# --- broken files ----------------------------------------------------------------------------------


def load_error(path: Path, match: str, arch: str = "llama") -> str:
    with pytest.raises(ModelLoadError, match=match) as info:
        load_gguf_model(path, tiny_config(arch), torch.float32, CPU)
    return str(info.value)


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "good.gguf").path


def test_wrong_magic(good: Path) -> None:
    data = bytearray(good.read_bytes())
    data[:4] = b"GGML"
    good.write_bytes(bytes(data))
    message = load_error(good, "is not a GGUF file")
    assert str(good) in message and "b'GGML'" in message
    with pytest.raises(ModelSourceError, match="is not a GGUF file"):
        prepare_gguf_dir(good)


@pytest.mark.parametrize(
    ("keep", "where"),
    [
        (10, "less than a header"),
        (200, "it ends inside a metadata key"),
        (3000, "it ends inside metadata 'tokenizer.ggml.tokens'"),
        (6000, "it ends inside tensor 'blk.1.ffn_gate.weight'"),
        (-100, "tensor 'blk.1.ffn_down.weight' in .* ends at byte"),
    ],
    ids=["header", "metadata", "vocabulary", "tensor-directory", "data"],
)
def test_truncated_file(good: Path, keep: int, where: str) -> None:
    good.write_bytes(good.read_bytes()[:keep])
    message = load_error(good, rf"{where}.*(\(truncated\?\)|the file is truncated)")
    assert str(good) in message


def _patch_offset(path: Path, name: str, offset: int) -> None:
    """Rewrite one tensor's data offset in the tensor directory."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    (n_dims,) = struct.unpack_from("<I", data, at)
    at += 4 + 8 * n_dims + 4
    struct.pack_into("<Q", data, at, offset)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("offset", "match"),
    [
        (1 << 40, r"tensor 'blk.0.ffn_up.weight' starts at byte \d+, past the end"),
        (33, r"tensor 'blk.0.ffn_up.weight' has offset 33, not a multiple of the alignment 32"),
        (0, r"tensors 'blk.0.ffn_up.weight' and 'token_embd.weight' in .* overlap: its offsets are wrong"),
    ],
    ids=["past-the-end", "misaligned", "overlapping"],
)
def test_wrong_offsets(good: Path, offset: int, match: str) -> None:
    _patch_offset(good, "blk.0.ffn_up.weight", offset)
    load_error(good, match)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    """F64 here; a block type the engine lacks (Q8_1) in tests/test_gguf_moe.py."""
    name = "blk.0.attn_norm.weight"
    path = write_tiny_gguf(tmp_path / "t.gguf", drop=(name,), extra={name: np.ones(64, dtype=np.float64)}).path
    load_error(path, rf"tensor '{re.escape(name)}' in t.gguf has type F64, which this engine does not load")


def test_missing_tensor(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", drop=("blk.1.ffn_up.weight",)).path
    load_error(path, r"missing tensors 'blk.1.ffn_up.weight'$")


def test_unexpected_tensor(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", extra={"blk.0.attn_gate.weight": np.ones(64, dtype=np.float32)}).path
    load_error(path, r"unexpected tensor 'blk.0.attn_gate.weight' in t.gguf: the llama config has no such parameter")


def test_wrong_shape(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", shapes={"blk.1.ffn_down.weight": (64, 96)}).path
    load_error(path, r"tensor 'blk.1.ffn_down.weight' in t.gguf has shape \[64, 96\], the config implies \[64, 128\]")


def test_config_of_another_architecture(good: Path) -> None:
    load_error(good, r"holds a 'llama' model, the config a 'qwen3' one", arch="qwen3")


def test_unsupported_architecture(tmp_path: Path, cache: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", file_arch="gpt2").path
    with pytest.raises(
        ModelSourceError,
        match=r"GGUF architecture 'gpt2' is not supported \(supported: llama, qwen2, qwen3, gemma2, gemma3, phi3, "
        r"qwen3moe, qwen2moe, olmoe, granitemoe, gpt-oss\)$",
    ):
        prepare_gguf_dir(path)
    assert not (cache / "models" / "gguf").exists() or not any((cache / "models" / "gguf").iterdir())


@pytest.mark.parametrize("model", ["rwkv", "bert"])
def test_unsupported_tokenizer_model(tmp_path: Path, cache: Path, model: str) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", metadata={"tokenizer.ggml.model": model}).path
    with pytest.raises(ModelSourceError, match=rf"{path}: its tokenizer model '{model}' \(tokenizer.ggml.model\)"):
        prepare_gguf_dir(path)
    assert not any((cache / "models" / "gguf").iterdir())  # nothing half-built left behind


def test_missing_metadata(tmp_path: Path, cache: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", drop_metadata=("llama.embedding_length",)).path
    with pytest.raises(ModelSourceError, match=r"GGUF metadata 'llama.embedding_length' is missing"):
        prepare_gguf_dir(path)


def test_resolve_model_dir_still_refuses_other_files(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 64)
    with pytest.raises(ModelSourceError, match=re.escape("is a file; pass the model directory or a .gguf file")):
        resolve_model_dir(str(other))
