"""GGUF files of the mixture-of-experts families (Qwen3-MoE, Qwen2-MoE with its gated shared
expert, OLMoE, Mixtral as llama.cpp's `llama` with experts), as llama.cpp's converter wrote them
(F16, Q8_0) and its quantizer quantized one (Q4_K_M), from tiny random models whose checkpoints
sit beside them (tests/fixtures/make_family_ggufs.py): the config read from the metadata is the
checkpoint's, every weight is gguf-py's dequantization of the file with the experts kept in
their file's types, and the engine gives the greedy ids and logits of transformers fp32 on those
weights. Then the layouts llama.cpp may also write (gate and up experts of different types, or
merged), and the refusals."""

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
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import ModelConfigError, ModelLoadError, ModelSourceError
from compiled_engine.executor.runner import Runner
from compiled_engine.linear.quantized import QuantizedEmbedding, QuantizedLinear
from compiled_engine.linear.quantized_experts import QuantizedExperts
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.moe import Experts
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.model.shard import TPShard
from compiled_engine.weights.gguf_dir import prepare_gguf_dir
from compiled_engine.weights.gguf_loader import load_gguf_model
from tests.test_gguf_families import as_stored, config_of, prompt, reference_greedy, rewrite

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
FILES = [(n, f) for n in ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe") for f in ("f16", "q8_0")]
FILES.append(("qwen3_moe_k", "q4_k_m"))
NEW_TOKENS = 8
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def gguf_path(name: str, fmt: str) -> Path:
    return FIXTURES / name / f"model-{fmt}.gguf"


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    # The inverse of the converter's llama q/k permutation (pairs of rotary halves interleaved).
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantized(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the file as gguf-py dequantizes it, fp32, by the Hugging Face name it came
    from (transformers' fused experts: gate rows then up rows per expert)."""
    reader = gguf.GGUFReader(path)
    raw = {t.name: torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()).float() for t in reader.tensors}
    llama = str(reader.fields["general.architecture"].contents()) == "llama"
    out = {"model.embed_tokens.weight": raw["token_embd.weight"], "model.norm.weight": raw["output_norm.weight"]}
    out["lm_head.weight"] = raw.get("output.weight", raw["token_embd.weight"])
    for i in range(config.num_layers):
        blk, hf = f"blk.{i}.", f"model.layers.{i}."
        names = {
            "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
            "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
            "ffn_down_exps.weight": "mlp.experts.down_proj", "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
            "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
            "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
            "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
        }  # fmt: skip
        for theirs, ours in names.items():
            if blk + theirs in raw:
                out[hf + ours] = raw[blk + theirs]
        for p, heads in (("q", config.num_heads), ("k", config.num_kv_heads), ("v", 0)):
            for kind in ("weight", "bias"):
                if f"{blk}attn_{p}.{kind}" in raw:
                    t = raw[f"{blk}attn_{p}.{kind}"]
                    out[f"{hf}self_attn.{p}_proj.{kind}"] = _unpermute(t, heads) if llama and heads else t
        if blk + "ffn_gate_up_exps.weight" in raw:
            out[hf + "mlp.experts.gate_up_proj"] = raw[blk + "ffn_gate_up_exps.weight"]
        else:
            out[hf + "mlp.experts.gate_up_proj"] = torch.cat(
                (raw[blk + "ffn_gate_exps.weight"], raw[blk + "ffn_up_exps.weight"]), 1
            )
    return out


@cache
def reference(name: str, fmt: str) -> Any:
    """transformers fp32: for F16 the checkpoint itself (the file holds exactly its weights),
    otherwise its architecture with gguf-py's dequantization of the file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if fmt == "f16":
        return AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(FIXTURES / name), dtype=torch.float32)
    model.load_state_dict(dequantized(gguf_path(name, fmt), config_of(gguf_path(name, fmt))), strict=True)
    return model.eval()


def as_ours(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers MoE state dict in our parameter names (q/k/v stacked, a shared expert's
    gate/up stacked; the fused experts are ours as they are)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        out[name.removeprefix("model.")] = t
    for i in range(config.num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp.shared_expert."
        for kind in ("weight", "bias"):
            if f"{attn}q_proj.{kind}" in out:
                parts = [out.pop(f"{attn}{p}_proj.{kind}") for p in "qkv"]
                out[f"{attn}qkv_proj.{kind}"] = torch.cat(parts)
        if f"{mlp}gate_proj.weight" in out:
            out[f"{mlp}gate_up_proj.weight"] = torch.cat([out.pop(f"{mlp}{p}_proj.weight") for p in ("gate", "up")])
    if config.tie_word_embeddings:
        out.pop("lm_head.weight")
    return out


def held_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A loaded model's weights in fp32 (dense as they are, quantized ones dequantized)."""
    out = {name: p.detach().float() for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            out[f"{name}.weight"] = module.weight.dequantize()
        elif isinstance(module, QuantizedExperts):
            out[f"{name}.gate_up_proj"], out[f"{name}.down_proj"] = module.dense()
    return out


def assert_weights_are_the_files(path: Path, want: dict[str, torch.Tensor]) -> list[torch.nn.Module]:
    """Loaded dense and kept quantized, every weight bit for bit gguf-py's dequantization; the
    experts stay quantized (QuantizedExperts) where the file's are. Returns the experts kept."""
    config = config_of(path)
    dense = held_weights(load_gguf_model(path, config, torch.float32, CPU, dequantize=True))
    kept_model = load_gguf_model(path, config, torch.float32, CPU)
    kept = held_weights(kept_model)
    if config.tie_word_embeddings:  # the quantized head is the embedding's table, listed again
        assert torch.equal(kept.pop("lm_head.weight"), kept["embed_tokens.weight"])
    assert set(dense) == set(kept) == set(want)
    for param, tensor in want.items():
        assert torch.equal(dense[param], tensor), param
        assert torch.equal(kept[param], tensor), param
    return [layer.mlp.experts for layer in kept_model.layers]


# --- the fixtures as llama.cpp wrote them ----------------------------------------------------------


@pytest.mark.parametrize(("name", "fmt"), FILES)
def test_config_from_the_metadata_is_the_checkpoints(name: str, fmt: str) -> None:
    """The experts, k, their width, renormalisation (not stored: llama.cpp's per architecture),
    the shared expert's width and gate, OLMoE's whole-width q/k norms, as float32 stores it."""
    ours = config_of(gguf_path(name, fmt))
    assert as_stored(ours) == as_stored(config_from_model_dir(FIXTURES / name))
    moe = ours.moe
    assert moe is not None and moe.num_experts == 4 and moe.top_k == 2 and moe.dense_layers == ()
    assert moe.renormalize == name.startswith(("qwen3_moe", "mixtral"))
    assert (moe.shared_intermediate_size, moe.shared_gate) == ((64, True) if name == "qwen2_moe" else (0, False))
    assert ours.qk_norm_whole == (name == "olmoe")


@pytest.mark.parametrize(("name", "fmt"), FILES)
def test_weights_are_the_files(name: str, fmt: str) -> None:
    """F16: dense Experts, the checkpoint's own weights; Q8_0 and Q4_K_M: every expert's rows in
    one QuantizedExperts per layer, in the file's types (Q4_K_M's gate/up Q4_K as int4, its down
    rows, too narrow for a k-quant, Q5_0 as int8)."""
    path = gguf_path(name, fmt)
    config = config_of(path)
    want = as_ours(dequantized(path, config), config)
    if fmt == "f16":
        checkpoint = as_ours(reference(name, "f16").state_dict(), config)
        assert all(torch.equal(checkpoint[k], t) for k, t in want.items())
    experts = assert_weights_are_the_files(path, want)
    if fmt == "f16":
        assert all(isinstance(e, Experts) for e in experts)
        return
    assert all(isinstance(e, QuantizedExperts) for e in experts)
    formats = {(e.gate_up.format, e.down.format) for e in experts if isinstance(e, QuantizedExperts)}
    assert formats == ({("int4", "int8")} if fmt == "q4_k_m" else {("int8", "int8")})


@pytest.mark.parametrize(("name", "fmt"), FILES)
def test_engine_on_the_prepared_gguf_matches_transformers(name: str, fmt: str, private_cache: Path) -> None:
    """The prepared directory run by the engine, the experts kept quantized (the grouped
    operator on their blocks): transformers' greedy ids and its logits after the prompt."""
    prepared = prepare_gguf_dir(gguf_path(name, fmt))
    assert as_stored(config_from_model_dir(prepared)) == as_stored(config_from_model_dir(FIXTURES / name))
    tokenizer = json.loads((prepared / "tokenizer.json").read_text())
    assert tokenizer == json.loads((FIXTURES / name / "tokenizer.json").read_text())
    runner = Runner(prepared, EngineConfig(model=str(prepared), page_size=4, num_pages=64, enforce_eager=True))
    quantized = fmt != "f16"
    assert any(isinstance(m, QuantizedExperts) for m in runner.model.modules()) == quantized
    ids = prompt(runner.model_config.vocab_size)
    [ours] = Generator(runner).generate([ids], NEW_TOKENS, record_logits=True)
    want_ids, want_logits = reference_greedy(reference(name, fmt), ids, NEW_TOKENS)
    assert ours.token_ids == want_ids
    assert ours.prefill_logits is not None
    torch.testing.assert_close(ours.prefill_logits, want_logits, atol=1e-4, rtol=1e-4)


# --- other layouts llama.cpp writes --------------------------------------------------------------


def _requantized(path: Path, target: Path, names: tuple[str, ...], kind: QT) -> Path:
    """A copy of a file with tensors `names` quantized again by gguf-py as `kind` (from their
    dequantized values)."""
    reader = gguf.GGUFReader(path)
    replaced = {
        t.name: gguf.quantize(gguf.dequantize(t.data, t.tensor_type).astype(np.float32), kind)
        for t in reader.tensors
        if t.name in names
    }
    return rewrite(path, target, tensors={n: (data, kind) for n, data in replaced.items()})


def test_gate_and_up_experts_of_different_types(tmp_path: Path) -> None:
    """llama.cpp's quantizer may give gate and up experts different types: they meet in one
    quantized weight (Q8_0 and Q4_0 as int8 groups of 32), each value as gguf-py reads it."""
    up = tuple(f"blk.{i}.ffn_up_exps.weight" for i in range(2))
    path = _requantized(gguf_path("qwen3_moe", "q8_0"), tmp_path / "mixed.gguf", up, QT.Q4_0)
    assert {t.tensor_type for t in gguf.GGUFReader(path).tensors if t.name in up} == {QT.Q4_0}
    config = config_of(path)
    experts = assert_weights_are_the_files(path, as_ours(dequantized(path, config), config))
    assert all(isinstance(e, QuantizedExperts) and e.gate_up.format == "int8" for e in experts)


def test_quantized_gate_up_with_dense_down_experts(tmp_path: Path) -> None:
    """Down experts kept F16 beside Q8_0 gate and up ones: the layer's experts are dense."""
    down = tuple(f"blk.{i}.ffn_down_exps.weight" for i in range(2))
    path = _requantized(gguf_path("qwen3_moe", "q8_0"), tmp_path / "dense-down.gguf", down, QT.F16)
    config = config_of(path)
    experts = assert_weights_are_the_files(path, as_ours(dequantized(path, config), config))
    assert all(isinstance(e, Experts) for e in experts)


def test_merged_gate_up_experts(tmp_path: Path) -> None:
    """The converter's option of one `ffn_gate_up_exps` per layer (each expert's gate rows, then
    its up rows): the same weights as the separate tensors."""
    source = gguf_path("qwen2_moe", "q8_0")
    reader = gguf.GGUFReader(source)
    data = {t.name: (np.array(t.data), QT(t.tensor_type)) for t in reader.tensors}
    merged = {}
    for i in range(2):
        (gate, kind), (up, _) = data[f"blk.{i}.ffn_gate_exps.weight"], data[f"blk.{i}.ffn_up_exps.weight"]
        merged[f"blk.{i}.ffn_gate_up_exps.weight"] = (np.concatenate((gate, up), axis=1), kind)
    drop = tuple(f"blk.{i}.ffn_{p}_exps.weight" for i in range(2) for p in ("gate", "up"))
    path = rewrite(source, tmp_path / "merged.gguf", drop_tensors=drop, tensors=merged)
    config = config_of(path)
    want = as_ours(dequantized(source, config), config)
    assert as_ours(dequantized(path, config), config).keys() == want.keys()
    experts = assert_weights_are_the_files(path, want)
    assert all(isinstance(e, QuantizedExperts) for e in experts)


def test_a_file_may_say_to_renormalise(tmp_path: Path) -> None:
    """`expert_weights_norm` overrides llama.cpp's choice for the architecture."""
    key = "qwen2moe.expert_weights_norm"
    path = rewrite(gguf_path("qwen2_moe", "f16"), tmp_path / "n.gguf", metadata={key: (True, VT.BOOL, None)})
    moe = config_of(path).moe
    assert moe is not None and moe.renormalize


# --- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "metadata", "message"),
    [
        (
            "qwen3_moe",
            {"qwen3moe.expert_gating_func": (2, VT.UINT32, None)},
            r"GGUF metadata 'qwen3moe.expert_gating_func' is 2: only 1 is supported for qwen3moe$",
        ),
        (
            "olmoe",
            {"olmoe.expert_weights_scale": (2.5, VT.FLOAT32, None)},
            r"GGUF metadata 'olmoe.expert_weights_scale' is 2.5: only 1.0 is supported for olmoe$",
        ),
        (
            "qwen2_moe",
            {"qwen2moe.leading_dense_block_count": (1, VT.UINT32, None)},
            r"'qwen2moe.leading_dense_block_count' is 1: only 0 is supported for qwen2moe$",
        ),
        (
            "mixtral",
            {"llama.expert_weights_norm": (False, VT.BOOL, None)},
            r"'llama.expert_weights_norm' is False, but a llama mixture always renormalises its routed weights$",
        ),
    ],
    ids=["sigmoid-router", "scaled-weights", "leading-dense", "mixtral-not-renormalised"],
)
def test_a_router_the_engine_does_not_run(tmp_path: Path, name: str, metadata: dict[str, Any], message: str) -> None:
    path = rewrite(gguf_path(name, "f16"), tmp_path / "r.gguf", metadata=metadata)
    with pytest.raises(ModelSourceError, match=message):
        config_of(path)


def test_experts_without_their_count(tmp_path: Path, private_cache: Path) -> None:
    path = rewrite(gguf_path("qwen3_moe", "f16"), tmp_path / "c.gguf", drop_metadata=("qwen3moe.expert_count",))
    with pytest.raises(ModelSourceError, match=r"GGUF metadata 'qwen3moe.expert_count' is missing$"):
        prepare_gguf_dir(path)


def test_a_mixture_architecture_outside_the_registry(tmp_path: Path) -> None:
    """An MoE architecture llama.cpp writes that the engine does not run is refused by name."""
    path = rewrite(gguf_path("qwen3_moe", "f16"), tmp_path / "d.gguf", arch="deepseek2")
    with pytest.raises(
        ModelSourceError, match=r"GGUF architecture 'deepseek2' is not supported \(supported: .*qwen3moe"
    ):
        config_of(path)


def test_expert_tensors_of_a_type_the_engine_lacks(tmp_path: Path) -> None:
    """Q8_1 experts (a type llama.cpp keeps for activations) are refused by name, before a byte of
    data is read."""
    name = "blk.1.ffn_down_exps.weight"
    blocks = np.zeros((4, 32, 40), dtype=np.uint8)  # 4 experts x 32 rows x one block of 32 weights
    path = rewrite(gguf_path("mixtral", "q8_0"), tmp_path / "m.gguf", tensors={name: (blocks, QT.Q8_1)})
    config = config_of(path)
    with pytest.raises(
        ModelLoadError, match=rf"tensor '{name}' in m.gguf has type Q8_1, which this engine does not load"
    ):
        load_gguf_model(path, config, torch.float32, CPU)


def test_a_missing_expert_tensor(tmp_path: Path) -> None:
    path = rewrite(gguf_path("olmoe", "f16"), tmp_path / "e.gguf", drop_tensors=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ModelLoadError, match=r"e.gguf: missing tensors 'blk.1.ffn_up_exps.weight'$"):
        load_gguf_model(path, config_of(path), torch.float32, CPU)


def test_expert_tensors_of_the_wrong_shape(tmp_path: Path) -> None:
    """Three experts' rows where the metadata counts four."""
    source = gguf_path("qwen3_moe", "f16")
    gate = next(t for t in gguf.GGUFReader(source).tensors if t.name == "blk.0.ffn_gate_exps.weight")
    path = rewrite(source, tmp_path / "s.gguf", tensors={gate.name: (np.array(gate.data)[:3], QT.F16)})
    with pytest.raises(
        ModelLoadError,
        match=r"'blk.0.ffn_gate_exps.weight' in s.gguf has shape \[3, 32, 32\], the config implies \[4, 32, 32\]",
    ):
        load_gguf_model(path, config_of(path), torch.float32, CPU)


def test_tensor_parallelism_is_refused_for_a_mixture_from_a_gguf_file() -> None:
    path = gguf_path("qwen3_moe", "q8_0")
    config = config_of(path)
    with pytest.raises(
        ModelConfigError, match="--tensor-parallel-size 2: a mixture of experts from a GGUF file runs on one rank"
    ):
        load_gguf_model(path, config, torch.float32, torch.device("cpu"), shard=TPShard(0, 2))


def test_a_mixture_serves_through_the_openai_api(tmp_path: Path, private_models: Path) -> None:
    """`serve` on a mixture's quantized GGUF file (its experts in one native call a layer): a
    completion and a streamed one through the OpenAI SDK, with the greedy text the engine gives
    offline."""
    from openai import OpenAI

    from compiled_engine.llm import LLM
    from tests.server_process import running_server

    path, prompt = gguf_path("qwen3_moe", "q8_0"), [5, 17, 42, 99]
    with running_server(tmp_path, "--model", str(path), "--kv-cache-memory-gib", "0.01", "--enforce-eager") as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        model = client.models.list().data[0].id
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt)
        pieces = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in pieces if chunk.choices)
    offline = LLM(model=str(path), enforce_eager=True, kv_cache_memory_gib=0.01)
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert expected.token_ids and whole.choices[0].text == streamed == expected.text
    assert whole.usage.completion_tokens == len(expected.token_ids)
