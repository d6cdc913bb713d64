"""GGUF files of Granite-MoE (with and without its shared expert) and gpt-oss as llama.cpp's
converter wrote them (F16, Q8_0) and its quantizer quantized gpt-oss's experts (MXFP4_MOE), from
tiny random models whose checkpoints sit beside them (tests/fixtures/make_family_ggufs.py): the
config read from the metadata is the checkpoint's (Granite's four multipliers, gpt-oss's window,
YaRN and biases), every weight is gguf-py's dequantization of the file (gpt-oss's gate and up
experts, stored apart, interleaved again; its MXFP4 blocks as int8 exactly), and the engine gives
transformers' greedy ids and logits. Then the refusals."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import Generator
from compiled_engine.errors import ModelSourceError
from compiled_engine.executor.runner import Runner
from compiled_engine.linear.quantized_experts import QuantizedExperts
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.moe import Experts
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.weights.gguf_blocks import decode_blocks
from compiled_engine.weights.gguf_dir import prepare_gguf_dir
from compiled_engine.weights.gguf_loader import load_gguf_model
from tests.test_gguf_families import as_stored, config_of, prompt, reference_greedy, rewrite
from tests.test_gguf_moe import held_weights

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
FILES = [(n, f) for n in ("granitemoe", "granitemoeshared", "gpt_oss") for f in ("f16", "q8_0")]
FILES.append(("gpt_oss", "mxfp4_moe"))
NEW_TOKENS = 8
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def gguf_path(name: str, fmt: str) -> Path:
    return FIXTURES / name / f"model-{fmt}.gguf"


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    # The inverse of the converter's llama q/k permutation (pairs of rotary halves interleaved).
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _alternate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's fused features from llama.cpp's two tensors: gate 0, up 0, gate 1, ... along dim 1."""
    return torch.stack((gate, up), dim=2).reshape(gate.shape[0], -1, *gate.shape[2:])


def hf_state(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the file as gguf-py dequantizes it, fp32, by the transformers name it came
    from (Granite's fused experts: gate rows then up rows; gpt-oss's stored [in, out], its gate and
    up features alternating)."""
    reader = gguf.GGUFReader(path)
    raw = {t.name: torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()).float() for t in reader.tensors}
    granite = str(reader.fields["general.architecture"].contents()) == "granitemoe"
    out = {"model.embed_tokens.weight": raw["token_embd.weight"], "model.norm.weight": raw["output_norm.weight"]}
    out["lm_head.weight"] = raw["output.weight"]
    for i in range(config.num_layers):
        b, hf = f"blk.{i}.", f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = raw[b + "attn_norm.weight"]
        out[hf + "self_attn.o_proj.weight"] = raw[b + "attn_output.weight"]
        for p, heads in (("q", config.num_heads), ("k", config.num_kv_heads), ("v", 0)):
            for kind in ("weight", "bias"):
                if f"{b}attn_{p}.{kind}" in raw:
                    t = raw[f"{b}attn_{p}.{kind}"]
                    out[f"{hf}self_attn.{p}_proj.{kind}"] = _unpermute(t, heads) if granite and heads else t
        gate, up, down = (raw[f"{b}ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
        if granite:
            out[hf + "post_attention_layernorm.weight"] = raw[b + "ffn_norm.weight"]
            out[hf + "block_sparse_moe.router.weight"] = raw[b + "ffn_gate_inp.weight"]
            out[hf + "block_sparse_moe.experts.gate_up_proj"] = torch.cat((gate, up), dim=1)
            out[hf + "block_sparse_moe.experts.down_proj"] = down
            if b + "ffn_up_shexp.weight" in raw:
                shared = (raw[b + "ffn_gate_shexp.weight"], raw[b + "ffn_up_shexp.weight"])
                out[hf + "shared_mlp.input_linear.weight"] = torch.cat(shared)
                out[hf + "shared_mlp.output_linear.weight"] = raw[b + "ffn_down_shexp.weight"]
            continue
        out[hf + "post_attention_layernorm.weight"] = raw[b + "post_attention_norm.weight"]
        out[hf + "self_attn.o_proj.bias"] = raw[b + "attn_output.bias"]
        out[hf + "self_attn.sinks"] = raw[b + "attn_sinks.weight"]
        out[hf + "mlp.router.weight"] = raw[b + "ffn_gate_inp.weight"]
        out[hf + "mlp.router.bias"] = raw[b + "ffn_gate_inp.bias"]
        out[hf + "mlp.experts.gate_up_proj"] = _alternate(gate, up).transpose(1, 2)
        out[hf + "mlp.experts.gate_up_proj_bias"] = _alternate(
            raw[b + "ffn_gate_exps.bias"], raw[b + "ffn_up_exps.bias"]
        )
        out[hf + "mlp.experts.down_proj"] = down.transpose(1, 2)
        out[hf + "mlp.experts.down_proj_bias"] = raw[b + "ffn_down_exps.bias"]
    return out


# transformers' names in memory (after `model.layers.N.`) of these families, in ours (after `layers.N.`),
# and whether the tensor is stored [in, out].
_OURS = {
    "block_sparse_moe.router.weight": ("mlp.gate.weight", False),
    "block_sparse_moe.experts.gate_up_proj": ("mlp.experts.gate_up_proj", False),
    "block_sparse_moe.experts.down_proj": ("mlp.experts.down_proj", False),
    "shared_mlp.input_linear.weight": ("mlp.shared_expert.gate_up_proj.weight", False),
    "shared_mlp.output_linear.weight": ("mlp.shared_expert.down_proj.weight", False),
    "mlp.router.weight": ("mlp.gate.weight", False),
    "mlp.router.bias": ("mlp.gate.bias", False),
    "mlp.experts.gate_up_proj": ("mlp.experts.gate_up_proj", True),
    "mlp.experts.gate_up_proj_bias": ("mlp.experts.gate_up_bias", False),
    "mlp.experts.down_proj": ("mlp.experts.down_proj", True),
    "mlp.experts.down_proj_bias": ("mlp.experts.down_bias", False),
}


def as_ours(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers state dict of these families in our parameter names (q/k/v stacked)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        name = name.removeprefix("model.")
        _, _, rest = name.partition(".") if name.startswith("layers.") else ("", "", "")
        if rest:
            index, _, rest = rest.partition(".")
            ours, transposed = _OURS.get(rest, (rest, False))
            out[f"layers.{index}.{ours}"] = t.transpose(-1, -2) if transposed else t
        else:
            out[name] = t
    for i in range(config.num_layers):
        attn = f"layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            if f"{attn}q_proj.{kind}" in out:
                out[f"{attn}qkv_proj.{kind}"] = torch.cat([out.pop(f"{attn}{p}_proj.{kind}") for p in "qkv"])
    return out


@cache
def reference(name: str, fmt: str) -> Any:
    """transformers fp32: for F16 the checkpoint itself (the file holds exactly its weights),
    otherwise its architecture with gguf-py's dequantization of the file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if fmt == "f16":
        return AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(FIXTURES / name), dtype=torch.float32)
    model.load_state_dict(hf_state(gguf_path(name, fmt), config_of(gguf_path(name, fmt))), strict=True)
    return model.eval()


def loaded_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """held_weights, with a QuantizedExperts' biases (buffers) too."""
    out = held_weights(model)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedExperts):
            for bias in ("gate_up_bias", "down_bias"):
                if getattr(module, bias) is not None:
                    out[f"{name}.{bias}"] = getattr(module, bias).float()
    return out


# --- the fixtures as llama.cpp wrote them ----------------------------------------------------------


@pytest.mark.parametrize(("name", "fmt"), FILES)
def test_config_from_the_metadata_is_the_checkpoints(name: str, fmt: str) -> None:
    ours = config_of(gguf_path(name, fmt))
    assert as_stored(ours) == as_stored(config_from_model_dir(FIXTURES / name))
    moe = ours.moe
    assert moe is not None and moe.num_experts == 4 and moe.top_k == 2 and moe.softmax_after_topk
    if name.startswith("granitemoe"):
        assert (ours.embedding_multiplier, ours.residual_multiplier) == (4.0, 0.5)
        assert (ours.attention_multiplier, ours.logits_scaling) == (0.5, 2.0)
        assert moe.shared_intermediate_size == (64 if name == "granitemoeshared" else 0)
    else:
        assert ours.attention_sinks and moe.router_bias and moe.expert_bias
        assert ours.rope.type == "yarn" and not ours.rope.truncate and ours.rope.factor == 4.0
        assert ours.layer_windows == (16, 0)


@pytest.mark.parametrize(("name", "fmt"), FILES)
def test_weights_are_the_files(name: str, fmt: str) -> None:
    """Loaded dense and kept quantized, every weight bit for bit gguf-py's dequantization (for
    F16 the checkpoint's own weights); the experts one QuantizedExperts a layer in the file's
    types (Q8_0 and MXFP4 both int8 groups of 32), biases beside them."""
    path = gguf_path(name, fmt)
    config = config_of(path)
    want = as_ours(hf_state(path, config), config)
    if fmt == "f16":
        checkpoint = as_ours(reference(name, "f16").state_dict(), config)
        assert checkpoint.keys() == want.keys()
        assert all(torch.equal(checkpoint[k], t) for k, t in want.items())
    dense = loaded_weights(load_gguf_model(path, config, torch.float32, CPU, dequantize=True))
    kept_model = load_gguf_model(path, config, torch.float32, CPU)
    kept = loaded_weights(kept_model)
    assert set(dense) == set(kept) == set(want)
    for param, tensor in want.items():
        assert torch.equal(dense[param], tensor), param
        assert torch.equal(kept[param], tensor), param
    experts = [layer.mlp.experts for layer in kept_model.layers]
    if fmt == "f16":
        assert all(isinstance(e, Experts) for e in experts)
        return
    assert all(isinstance(e, QuantizedExperts) and (e.gate_up.format, e.down.format) == ("int8",) * 2 for e in experts)


def test_mxfp4_blocks_are_gguf_pys_values() -> None:
    """Every code and every finite exponent (255 means NaN; the two smallest, whose halves gguf-py
    builds as subnormal fp32, included) as gguf-py dequantizes them."""
    exponents = np.arange(255, dtype=np.uint8).reshape(255, 1)
    codes = np.random.default_rng(0).integers(0, 256, (255, 16), dtype=np.uint8)
    codes[0] = np.arange(0, 256, 16)  # every nibble, low and high
    blocks = np.concatenate((exponents, codes), axis=1).reshape(15, 17, 17)
    with np.errstate(over="ignore"):  # 12 * 2^126 is past fp32: inf in both
        want = torch.from_numpy(gguf.dequantize(blocks.reshape(15, -1), QT.MXFP4).copy())
    weight = decode_blocks(torch.from_numpy(blocks), gguf.GGMLQuantizationType.MXFP4.value)
    assert weight.format == "int8" and weight.group_size == 32
    assert torch.equal(weight.dequantize(), want)


@pytest.mark.parametrize(("name", "fmt"), FILES)
def test_engine_on_the_prepared_gguf_matches_transformers(name: str, fmt: str, private_cache: Path) -> None:
    """The prepared directory run by the engine, the experts kept quantized: transformers' greedy
    ids and its logits after the prompt (a prompt past gpt-oss's window and YaRN's original
    context)."""
    prepared = prepare_gguf_dir(gguf_path(name, fmt))
    assert as_stored(config_from_model_dir(prepared)) == as_stored(config_from_model_dir(FIXTURES / name))
    tokenizer = json.loads((prepared / "tokenizer.json").read_text())
    assert tokenizer == json.loads((FIXTURES / name / "tokenizer.json").read_text())
    runner = Runner(prepared, EngineConfig(model=str(prepared), page_size=4, num_pages=64, enforce_eager=True))
    assert any(isinstance(m, QuantizedExperts) for m in runner.model.modules()) == (fmt != "f16")
    ids = prompt(runner.model_config.vocab_size)
    [ours] = Generator(runner).generate([ids], NEW_TOKENS, record_logits=True)
    want_ids, want_logits = reference_greedy(reference(name, fmt), ids, NEW_TOKENS)
    assert ours.token_ids == want_ids
    assert ours.prefill_logits is not None
    torch.testing.assert_close(ours.prefill_logits, want_logits, atol=1e-4, rtol=1e-4)


# --- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (
            {"gpt-oss.rope.scaling.yarn_attn_factor": (1.5, VT.FLOAT32, None)},
            r"GGUF metadata 'gpt-oss.rope.scaling.yarn_attn_factor' is not supported$",
        ),
        (
            {"gpt-oss.rope.scaling.type": ("longrope", VT.STRING, None)},
            r"rope scaling type 'longrope' is not supported for gpt-oss",
        ),
    ],
    ids=["yarn-attention-factor", "other-rope-scaling"],
)
def test_gpt_oss_metadata_the_engine_does_not_run(tmp_path: Path, metadata: dict[str, Any], message: str) -> None:
    path = rewrite(gguf_path("gpt_oss", "f16"), tmp_path / "r.gguf", metadata=metadata)
    with pytest.raises(ModelSourceError, match=message):
        config_of(path)


def test_gpt_oss_without_its_window(tmp_path: Path) -> None:
    key = "gpt-oss.attention.sliding_window"
    path = rewrite(gguf_path("gpt_oss", "f16"), tmp_path / "w.gguf", drop_metadata=(key,))
    with pytest.raises(ModelSourceError, match=rf"GGUF metadata '{key}' is missing$"):
        config_of(path)


def test_a_missing_expert_bias(tmp_path: Path) -> None:
    from compiled_engine.errors import ModelLoadError

    name = "blk.1.ffn_up_exps.bias"
    path = rewrite(gguf_path("gpt_oss", "mxfp4_moe"), tmp_path / "b.gguf", drop_tensors=(name,))
    with pytest.raises(ModelLoadError, match=rf"b.gguf: missing tensors '{name}'$"):
        load_gguf_model(path, config_of(path), torch.float32, CPU)
