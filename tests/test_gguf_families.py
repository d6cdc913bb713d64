"""GGUF files of every family llama.cpp converts (Qwen2, Mistral as llama, Gemma 2, Gemma 3,
Phi-3), as its own converter wrote them (tests/fixtures/gguf, made by
tests/fixtures/make_family_ggufs.py from tiny random models whose checkpoints sit beside them):
the config read from the metadata is the checkpoint's, the weights are the checkpoint's (F16) or
transformers' dequantization of the file (Q8_0), and the engine on the prepared directory gives
transformers' greedy ids and logits. Then llama.cpp's conventions one by one on rewritten files:
sliding patterns, defaults where a file says nothing, Gemma's query scale, longrope's factors,
and the ways a file is refused."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import msgspec
import numpy as np
import pytest
import torch
from gguf import GGUFValueType as VT

from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import Generator
from compiled_engine.errors import ModelLoadError, ModelSourceError
from compiled_engine.executor.runner import Runner
from compiled_engine.linear.quantized import QuantizedEmbedding, QuantizedLinear
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.registry import config_from_dict, config_from_model_dir, family_of
from compiled_engine.model.shard import NO_SHARD
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.weights.gguf import read_gguf_header
from compiled_engine.weights.gguf_dir import gguf_config_dict, prepare_gguf_dir
from compiled_engine.weights.gguf_loader import load_gguf_model

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
NAMES = ("gemma2", "gemma3", "mistral", "phi3", "qwen2")
FORMATS = ("f16", "q8_0")
WINDOW = 16
# Past the window, and past Phi-3's longrope pretraining length of 32 (transformers then takes the
# long factors for the whole sequence, as the engine does for its context of 256).
PROMPT_LENGTH = 40
NEW_TOKENS = 8
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


def gguf_path(name: str, fmt: str) -> Path:
    return FIXTURES / name / f"model-{fmt}.gguf"


def checkpoint_config(name: str) -> ModelConfig:
    """The config of the checkpoint a fixture was converted from; llama.cpp writes Mistral as a
    llama model, which is the same network."""
    config = config_from_model_dir(FIXTURES / name)
    return msgspec.structs.replace(config, architecture="llama") if name == "mistral" else config


def as_stored(config: ModelConfig) -> dict[str, Any]:
    """A config's fields with every float as the float32 a GGUF stores (eps, rope factors)."""

    def f32(value: Any) -> Any:
        if isinstance(value, float):
            return float(np.float32(value))
        if isinstance(value, tuple | list):
            return tuple(f32(v) for v in value)
        if isinstance(value, dict):
            return {k: f32(v) for k, v in value.items()}
        return value

    return f32(msgspec.to_builtins(config))


def config_of(path: Path) -> ModelConfig:
    return config_from_dict(gguf_config_dict(read_gguf_header(path, ModelSourceError)))


@cache
def reference(name: str, fmt: str) -> Any:
    """transformers' model of a fixture, fp32: for F16 the checkpoint itself (the file holds
    exactly its weights); for Q8_0 the checkpoint's architecture with the file's weights as
    transformers dequantizes them (for Mistral by the llama names llama.cpp wrote them under)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = FIXTURES / name
    if fmt == "f16":
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(directory)
    if name == "mistral":
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        config = AutoConfig.for_model("llama", **fields)
    return AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=f"model-{fmt}.gguf", config=config, dtype=torch.float32
    ).eval()


def in_our_names(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers state dict as our parameters (q/k/v and gate/up rows stacked)."""
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for hf_name, where in family_of(config).checkpoint_layout(config, NO_SHARD).items():
        if hf_name in state:  # a tied head is not in the state dict's own entries
            parts.setdefault(where.param, []).append((where.start, state[hf_name]))
    return {name: torch.cat([t for _, t in sorted(p, key=lambda x: x[0])]) for name, p in parts.items()}


def dense_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {name: p.detach().float() for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            out[f"{name}.weight"] = module.weight.dequantize()
    return out


def prompt(vocab: int) -> list[int]:
    return torch.randint(3, vocab, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(7)).tolist()


@torch.inference_mode()
def reference_greedy(model: Any, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (the whole sequence run at every step, so longrope sees
    its length) and its logits after the prompt."""
    out: list[int] = []
    first = None
    for _ in range(steps):
        logits = model(torch.tensor([ids + out])).logits[0, -1]
        first = logits if first is None else first
        out.append(int(logits.argmax()))
    assert first is not None
    return out, first


# --- the fixtures as llama.cpp wrote them ----------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", NAMES)
def test_config_from_the_metadata_is_the_checkpoints(name: str, fmt: str) -> None:
    """Every field (windows and which layers slide, soft caps, both Gemma 3 ropes, Gemma's query
    scale, partial rotary and longrope, biases, tied heads, head sizes), as float32 stores it."""
    ours = config_of(gguf_path(name, fmt))
    assert as_stored(ours) == as_stored(checkpoint_config(name))


# What each fixture exercises, so a remade fixture cannot quietly lose it.
FEATURES = {
    "qwen2": lambda c: c.tie_word_embeddings and c.qkv_bias and not c.o_bias and c.rope.theta == 1e6,
    "mistral": lambda c: c.head_dim * c.num_heads != c.hidden_size and not c.tie_word_embeddings,
    "gemma2": lambda c: (
        c.layer_windows == (WINDOW, 0) and (c.attn_soft_cap, c.final_soft_cap) == (5.0, 3.0) and c.tie_word_embeddings
    ),
    "gemma3": lambda c: (
        c.layer_windows == (WINDOW,) * 5 + (0,)
        and (c.rope.type, c.rope.factor, c.rope.theta) == ("linear", 2.0, 1e6)
        and c.rope_local is not None
        and c.rope_local.theta == 1e4
        and c.qk_norm
    ),
    "phi3": lambda c: c.rotary_dim == c.head_dim // 2 and c.rope.type == "longrope" and not c.tie_word_embeddings,
}


@pytest.mark.parametrize("name", NAMES)
def test_each_fixture_exercises_its_familys_features(name: str) -> None:
    assert FEATURES[name](config_of(gguf_path(name, "f16")))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", NAMES)
def test_weights_are_the_checkpoints(name: str, fmt: str) -> None:
    """Dense and kept quantized, every weight bit for bit as transformers holds it: the F16 file's
    are the checkpoint's own (Gemma's norms with llama.cpp's 1 taken off, llama's q/k rows put
    back in order, Phi-3's fused tensors as they are), the Q8_0 file's as transformers
    dequantizes them."""
    path = gguf_path(name, fmt)
    config = config_of(path)
    want = in_our_names(reference(name, fmt).state_dict(), config)
    dense_model = load_gguf_model(path, config, torch.float32, CPU, dequantize=True)
    dense = dict(dense_model.named_parameters())  # a tied head is the embedding, listed once
    assert set(dense) == set(want)
    assert (dense_model.lm_head.weight is dense_model.embed_tokens.weight) == config.tie_word_embeddings
    quantized = load_gguf_model(path, config, torch.float32, CPU)
    kept = dense_weights(quantized)
    for param, tensor in want.items():
        assert torch.equal(dense[param].detach(), tensor), param
        assert torch.equal(kept[param], tensor), param
    if fmt == "q8_0":  # every matrix's rows are whole Q8_0 blocks: all stay quantized
        for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            assert isinstance(quantized.get_submodule(f"layers.0.{module}"), QuantizedLinear), module


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", NAMES)
def test_engine_on_the_prepared_gguf_matches_transformers(name: str, fmt: str, private_cache: Path) -> None:
    """The prepared directory (config from the metadata, the tokenizer beside the file) run by
    the engine, the Q8_0 tensors kept quantized: transformers' greedy ids, and its logits after a
    prompt past the window (and past longrope's pretraining length)."""
    prepared = prepare_gguf_dir(gguf_path(name, fmt))
    assert as_stored(config_from_model_dir(prepared)) == as_stored(checkpoint_config(name))
    tokenizer = json.loads((prepared / "tokenizer.json").read_text())
    assert tokenizer == json.loads((FIXTURES / name / "tokenizer.json").read_text())
    config = EngineConfig(model=str(prepared), page_size=4, num_pages=64, enforce_eager=True)
    runner = Runner(prepared, config)
    ids = prompt(runner.model_config.vocab_size)
    [ours] = Generator(runner).generate([ids], NEW_TOKENS, record_logits=True)
    want_ids, want_logits = reference_greedy(reference(name, fmt), ids, NEW_TOKENS)
    assert ours.token_ids == want_ids
    assert ours.prefill_logits is not None
    torch.testing.assert_close(ours.prefill_logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_a_gguf_alone_gets_its_tokenizer_from_the_metadata(name: str, tmp_path: Path, private_cache: Path) -> None:
    """Without the tokenizer files beside it, the prepared directory's tokenizer (built from the
    file's vocabulary) encodes as the checkpoint's: the converter wrote each family's kind."""
    from transformers import AutoTokenizer

    alone = tmp_path / "model.gguf"
    shutil.copyfile(gguf_path(name, "f16"), alone)
    ours = Tokenizer(prepare_gguf_dir(alone))
    theirs = AutoTokenizer.from_pretrained(FIXTURES / name)
    for text in ("hello world, the quick brown fox", "tiny tests of soft caps"):
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text


# --- llama.cpp's conventions on rewritten files ----------------------------------------------------


def rewrite(
    source: Path,
    target: Path,
    *,
    arch: str | None = None,
    metadata: dict[str, tuple[Any, VT, VT | None]] | None = None,
    drop_metadata: tuple[str, ...] = (),
    drop_tensors: tuple[str, ...] = (),
    tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
) -> Path:
    """A copy of a GGUF file with metadata set ((value, type, item type) by key) or dropped, and
    tensors dropped, or set ((data as stored, type) by name: a quantized type's data is its
    blocks' bytes), everything else as it was."""
    reader = gguf.GGUFReader(source)
    old_arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(target), arch or old_arch)
    changes = metadata or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_metadata or key in changes:
            continue
        item = field.types[-1] if field.types[0] == VT.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=item)
    for key, (value, kind, item) in changes.items():
        writer.add_key_value(key, value, kind, sub_type=item)
    stored = {t.name: (t.data, t.tensor_type) for t in reader.tensors if t.name not in drop_tensors}
    for name, (data, kind) in (stored | (tensors or {})).items():
        # The data as stored: quantized tensors as their blocks' bytes, shaped so.
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_a_rewritten_file_reads_as_the_original(tmp_path: Path) -> None:
    """The rewriting itself changes nothing it is not asked to."""
    copy = rewrite(gguf_path("gemma3", "q8_0"), tmp_path / "copy.gguf")
    assert config_of(copy) == config_of(gguf_path("gemma3", "q8_0"))
    config = config_of(copy)
    original = dense_weights(load_gguf_model(gguf_path("gemma3", "q8_0"), config, torch.float32, CPU))
    for name, tensor in dense_weights(load_gguf_model(copy, config, torch.float32, CPU)).items():
        assert torch.equal(tensor, original[name]), name


@pytest.mark.parametrize(
    ("pattern", "kind", "item", "slides"),
    [
        (2, VT.UINT32, None, (1, 0, 1, 0, 1, 0)),
        (0, VT.UINT32, None, (1, 1, 1, 1, 1, 1)),
        (1, VT.UINT32, None, (0, 0, 0, 0, 0, 0)),
        ([True, False, False, True, True, False], VT.ARRAY, VT.BOOL, (1, 0, 0, 1, 1, 0)),
    ],
    ids=["period-2", "period-0-all", "period-1-none", "flags"],
)
def test_gemma3_sliding_pattern_from_the_file(
    tmp_path: Path, pattern: Any, kind: VT, item: VT | None, slides: tuple[int, ...]
) -> None:
    """A file's `sliding_window_pattern` (a period n, layer i sliding unless i % n == n - 1, or
    one flag per layer) decides which layers slide, as in llama.cpp; without one, five in six."""
    key = "gemma3.attention.sliding_window_pattern"
    path = rewrite(gguf_path("gemma3", "f16"), tmp_path / "p.gguf", metadata={key: (pattern, kind, item)})
    config = config_of(path)
    assert tuple(config.window(i) for i in range(6)) == tuple(WINDOW * s for s in slides)


def test_gemma3_without_a_window_or_local_base(tmp_path: Path) -> None:
    """No `sliding_window`: no layer slides. No `rope.freq_base_swa`: llama.cpp's local base of
    10000 (not the global one)."""
    path = rewrite(
        gguf_path("gemma3", "f16"),
        tmp_path / "g.gguf",
        drop_metadata=("gemma3.attention.sliding_window", "gemma3.rope.freq_base_swa"),
        metadata={"gemma3.rope.freq_base": (500_000.0, VT.FLOAT32, None)},
    )
    config = config_of(path)
    assert not config.sliding
    assert config.rope.theta == 500_000.0 and config.rope_local is not None and config.rope_local.theta == 10000.0


def test_gemma2_defaults_where_the_file_is_silent(tmp_path: Path) -> None:
    """llama.cpp's Gemma 2 defaults: a window of 4096 on every other layer, attention logits
    capped at 50, final ones at 30."""
    keys = ("attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping")
    path = rewrite(gguf_path("gemma2", "f16"), tmp_path / "g.gguf", drop_metadata=tuple(f"gemma2.{k}" for k in keys))
    config = config_of(path)
    assert config.layer_windows == (4096, 0)
    assert (config.attn_soft_cap, config.final_soft_cap) == (50.0, 30.0)


@pytest.mark.parametrize(("name", "big", "other"), [("gemma2", 46, 42), ("gemma3", 62, 48)])
def test_gemma_query_scale_is_llama_cpps(tmp_path: Path, name: str, big: int, other: int) -> None:
    """Not stored: llama.cpp scales queries by 1/sqrt(head size), and the 27B models (known by
    their layer count) by 1/sqrt(hidden / heads). Heads of 8 here, so the two differ (hidden 32
    over 2 heads is 16); the config is read from the header alone."""
    for layers, want in ((big, 16), (other, 8)):
        metadata = {f"{name}.block_count": (layers, VT.UINT32, None)}
        metadata |= {f"{name}.attention.{k}_length": (8, VT.UINT32, None) for k in ("key", "value")}
        path = rewrite(gguf_path(name, "f16"), tmp_path / f"{layers}.gguf", metadata=metadata)
        config = config_of(path)
        assert (config.head_dim, config.query_pre_attn_scalar) == (8, want)


def test_gemma_norms_lose_llama_cpps_one() -> None:
    """The file stores Gemma's norms (q/k norms too) as 1 + w; the model holds w."""
    path = gguf_path("gemma3", "f16")
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    stored = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors if t.name.endswith("norm.weight")}
    assert {n.split(".")[-2] for n in stored if n.startswith("blk.0.")} == {
        "attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "attn_q_norm", "attn_k_norm",
    }  # fmt: skip
    assert header.tensors["blk.0.attn_q_norm.weight"].type == 0  # F32, as the converter keeps norms
    model = dict(load_gguf_model(path, config_of(path), torch.float32, CPU).named_parameters())
    ours = {
        "output_norm.weight": "norm.weight",
        "blk.0.attn_norm.weight": "layers.0.input_layernorm.weight",
        "blk.0.post_attention_norm.weight": "layers.0.post_attention_layernorm.weight",
        "blk.0.ffn_norm.weight": "layers.0.pre_feedforward_layernorm.weight",
        "blk.0.post_ffw_norm.weight": "layers.0.post_feedforward_layernorm.weight",
        "blk.0.attn_q_norm.weight": "layers.0.self_attn.q_norm.weight",
        "blk.0.attn_k_norm.weight": "layers.0.self_attn.k_norm.weight",
    }
    for theirs, mine in ours.items():
        assert torch.equal(model[mine].detach() + 1, stored[theirs]), theirs


def test_partial_rotary_is_phi3s_alone(tmp_path: Path) -> None:
    path = rewrite(
        gguf_path("qwen2", "f16"), tmp_path / "q.gguf", metadata={"qwen2.rope.dimension_count": (8, VT.UINT32, None)}
    )
    with pytest.raises(ModelSourceError, match=r"rotary embedding over 8 of 16 dims is not supported for qwen2$"):
        config_of(path)


def test_phi3_window_is_kept(tmp_path: Path) -> None:
    """llama.cpp currently runs Phi-3 without its window; transformers slides every layer, and so
    do we, so the converted model is the model it came from. 0 means none (Phi-4-mini)."""
    path = rewrite(
        gguf_path("phi3", "f16"), tmp_path / "w.gguf", metadata={"phi3.attention.sliding_window": (24, VT.UINT32, None)}
    )
    assert config_of(path).layer_windows == (24, 24)
    assert not config_of(gguf_path("phi3", "f16")).sliding


FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def test_phi3_without_its_rope_factors(tmp_path: Path, private_cache: Path) -> None:
    """A file that declares longrope but lacks the factors is refused, by prepare and by the
    loader given a longrope config; one without either is a plain rope."""
    stripped = rewrite(gguf_path("phi3", "f16"), tmp_path / "phi3.gguf", drop_tensors=FACTORS)
    with pytest.raises(
        ModelSourceError,
        match=r"phi3.gguf: it declares longrope \(phi3.rope.scaling.attn_factor\) but has neither "
        r"rope_factors_long.weight nor rope_factors_short.weight: the rope's factors are missing$",
    ):
        prepare_gguf_dir(stripped)
    built = private_cache / "models" / "gguf"
    assert not built.exists() or not any(built.iterdir())  # nothing half-built left behind
    with pytest.raises(
        ModelLoadError, match=r"missing tensors 'rope_factors_long.weight', 'rope_factors_short.weight'$"
    ):
        load_gguf_model(stripped, checkpoint_config("phi3"), torch.float32, CPU)
    plain = rewrite(stripped, tmp_path / "plain.gguf", drop_metadata=("phi3.rope.scaling.attn_factor",))
    assert config_of(plain).rope.type == "default"


def test_phi3_with_one_rope_factor_tensor(tmp_path: Path) -> None:
    path = rewrite(gguf_path("phi3", "f16"), tmp_path / "one.gguf", drop_tensors=(FACTORS[1],))
    with pytest.raises(
        ModelSourceError,
        match=r"it has rope_factors_long.weight but not rope_factors_short.weight: longrope needs both",
    ):
        config_of(path)


def test_phi3_factors_must_be_the_configs() -> None:
    config = checkpoint_config("phi3")
    other = msgspec.structs.replace(config.rope, long_factor=tuple(2 * f for f in config.rope.long_factor))
    with pytest.raises(ModelLoadError, match=r"rope_factors_long.weight differs from the config's rope long_factor"):
        load_gguf_model(gguf_path("phi3", "f16"), msgspec.structs.replace(config, rope=other), torch.float32, CPU)


def test_phi3_without_longrope_reads_no_factors(tmp_path: Path) -> None:
    """A plain-rope config refuses a file that carries factors: they would change the model."""
    config = checkpoint_config("phi3")
    plain = msgspec.structs.replace(config, rope=msgspec.structs.replace(config.rope, type="default"))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'rope_factors_long.weight'"):
        load_gguf_model(gguf_path("phi3", "f16"), plain, torch.float32, CPU)


@pytest.mark.parametrize("arch", ["gemma", "mistral", "phi2"])
def test_an_architecture_outside_the_registry(tmp_path: Path, private_cache: Path, arch: str) -> None:
    """One clear error, listing what is supported (Mistral included: llama.cpp writes it as llama)."""
    path = rewrite(gguf_path("gemma2", "f16"), tmp_path / "x.gguf", arch=arch)
    with pytest.raises(
        ModelSourceError,
        match=rf"GGUF architecture '{arch}' is not supported \(supported: llama, qwen2, qwen3, gemma2, gemma3, phi3, "
        r"qwen3moe, qwen2moe, olmoe, granitemoe, gpt-oss\)$",
    ):
        prepare_gguf_dir(path)
    with pytest.raises(ModelLoadError, match=rf"holds a '{arch}' model, the config a 'gemma2' one"):
        load_gguf_model(path, checkpoint_config("gemma2"), torch.float32, CPU)


def test_an_unsupported_rope_scaling(tmp_path: Path) -> None:
    path = rewrite(
        gguf_path("qwen2", "f16"),
        tmp_path / "y.gguf",
        metadata={
            "qwen2.rope.scaling.type": ("yarn", VT.STRING, None),
            "qwen2.rope.scaling.factor": (4.0, VT.FLOAT32, None),
        },
    )
    with pytest.raises(ModelSourceError, match=r"rope scaling type 'yarn' is not supported for qwen2 \(only linear\)"):
        config_of(path)


def test_serve_runs_a_new_familys_gguf(private_models: Path, tmp_path: Path) -> None:
    """`serve --model file.gguf` on Gemma 3 (windows, two ropes, q/k norms, quantized): a
    completion over token ids gives transformers' greedy ids; the models route names the file."""
    import httpx

    from tests.server_process import running_server

    path = gguf_path("gemma3", "q8_0")
    args = ("--model", str(path), "--enforce-eager", "--num-pages", "64", "--page-size", "4")
    with running_server(tmp_path, *args) as server:
        ids = prompt(checkpoint_config("gemma3").vocab_size)
        body = {"model": str(path), "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        [choice] = reply.json()["choices"]
        want_ids, _ = reference_greedy(reference("gemma3", "q8_0"), ids, NEW_TOKENS)
        assert choice["text"] == Tokenizer(FIXTURES / "gemma3").decode(want_ids)
        assert reply.json()["usage"]["completion_tokens"] == NEW_TOKENS
