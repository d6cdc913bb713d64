"""gpt-oss as a tiny random-weight model written by transformers: eight experts, k = 4, biases
everywhere (q/k/v/o, router, experts), attention sinks, a sliding window of 8 tokens on alternate
layers that the prompts cross, YaRN rope, and the clamped SwiGLU with its clamps reached. Greedy
ids and logits against transformers fp32, batched with chunked prefill and alone, on the CPU and
torch attention backends, eager and compiled; quantized experts against their dequantized twin;
MXFP4 experts read as int8 exactly; the refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import Generator
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import ModelConfigError
from compiled_engine.executor.compilation import CompiledForward
from compiled_engine.executor.runner import Runner
from compiled_engine.experts.op import SWIGLU_OAI
from compiled_engine.linear.quantized_experts import QuantizedExperts
from compiled_engine.llm import LLM
from compiled_engine.model.registry import check_shard, config_from_dict, config_from_model_dir
from compiled_engine.model.shard import TPShard
from compiled_engine.weights.mxfp4 import mxfp4_as_int8
from reference_oracle import ReferenceOracle
from tests.conftest import TINY_LLAMA
from tests.test_moe_families import _dense_twin

WINDOW = 8
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 64,
}  # fmt: skip
CONFIG: dict[str, Any] = dict(
    TINY_LLAMA, pad_token_id=0, num_hidden_layers=3, head_dim=16, num_local_experts=8, num_experts_per_tok=4,
    intermediate_size=32, sliding_window=WINDOW, rope_parameters=YARN,
)  # fmt: skip
PROMPT_LENGTHS = (9, 33, 47)
NEW_TOKENS = 20


def _write(path: Path) -> Path:
    """The model as transformers saves it, every weight random: the matrices and expert tensors
    wide enough that the SwiGLU's clamps are reached, and the biases and sinks away from zero
    (transformers starts the expert biases at zero and the sinks near it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_oss", **CONFIG)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.5)
            elif "norm" not in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> ReferenceOracle:
    return ReferenceOracle(model_dir)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def golden(oracle: ReferenceOracle) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): oracle.greedy(p, NEW_TOKENS).token_ids for p in _prompts(1)}


def test_config_reads_the_family(model_dir: Path) -> None:
    config = config_from_model_dir(model_dir)
    assert config.architecture == "gpt_oss" and config.attention_sinks
    assert config.layer_windows == (WINDOW, 0, WINDOW)  # transformers' alternation: even layers slide
    assert config.qkv_bias and config.o_bias
    assert (config.rope.type, config.rope.factor, config.rope.truncate) == ("yarn", 4.0, False)
    assert config.rope.attention_factor > 1.0
    moe = config.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 4, 32)
    assert moe.softmax_after_topk and moe.router_bias and moe.expert_bias and not moe.renormalize
    assert moe.expert_activation == SWIGLU_OAI


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_batched_chunked_greedy_matches_transformers(
    model_dir: Path, golden: dict[tuple[int, ...], list[int]], backend: str
) -> None:
    """Three prompts at once with prefill in chunks of 16 tokens (chunks after a cached prefix
    that the window slides over), then one alone; eager."""
    llm = LLM(
        model=str(model_dir), page_size=4, num_pages=128, max_num_batched_tokens=16, enforce_eager=True,
        attention_backend=backend,
    )  # fmt: skip
    assert llm.engine.runner.backend.name == backend
    prompts = [list(p) for p in golden]
    outputs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == golden[tuple(prompt)]
    alone = llm.generate([prompts[2]], _greedy(), use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == golden[tuple(prompts[2])]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
@torch.inference_mode()
def test_logits_match_transformers(model_dir: Path, oracle: ReferenceOracle, eager: bool) -> None:
    runner = Runner(model_dir, EngineConfig(model=str(model_dir), page_size=4, num_pages=64, enforce_eager=eager))
    assert isinstance(runner.forward, CompiledForward) != eager
    prompt = _prompts(2)[1]
    [ours] = Generator(runner).generate([prompt], 8, record_logits=True)
    golden = oracle.greedy(prompt, 8)
    assert ours.token_ids == golden.token_ids
    assert ours.prefill_logits is not None
    torch.testing.assert_close(ours.prefill_logits, golden.prefill_logits, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_quantized_experts_run_as_their_dequantized_twin(model_dir: Path) -> None:
    config = EngineConfig(model=str(model_dir), page_size=4, num_pages=64, enforce_eager=True, quantization="int8")
    runner = Runner(model_dir, config)
    experts = [layer.mlp.experts for layer in runner.model.layers]
    assert all(isinstance(e, QuantizedExperts) and e.gate_up_bias is not None for e in experts)
    prompt = _prompts(4)[1]
    [quantized] = Generator(runner).generate([prompt], 4, record_logits=True)
    for layer in runner.model.layers:
        layer.mlp.experts = _dense_twin(layer.mlp.experts)
    [twin] = Generator(runner).generate([prompt], 4, record_logits=True)
    assert quantized.token_ids == twin.token_ids
    assert quantized.prefill_logits is not None and twin.prefill_logits is not None
    torch.testing.assert_close(quantized.prefill_logits, twin.prefill_logits, atol=1e-4, rtol=1e-4)


def test_tensor_parallelism_is_refused_with_the_reason(model_dir: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"--tensor-parallel-size 2: not supported for gpt_oss: its experts'"):
        check_shard(config_from_model_dir(model_dir), TPShard(0, 2))


def _raw(**change: Any) -> dict[str, Any]:
    return {**CONFIG, "model_type": "gpt_oss", "num_local_experts": 8, **change}


def test_another_quantization_method_is_refused_by_name() -> None:
    with pytest.raises(ModelConfigError, match=r"quant_method 'fp8' is not supported for gpt-oss \(only 'mxfp4'"):
        config_from_dict(_raw(quantization_config={"quant_method": "fp8"}))


@pytest.mark.parametrize(("key", "value"), [("swiglu_limit", 10.0), ("swiglu_alpha", 1.0)])
def test_other_swiglu_constants_are_refused(key: str, value: float) -> None:
    with pytest.raises(ModelConfigError, match=rf"field '{key}' is {value}; gpt-oss's experts run with {key}"):
        config_from_dict(_raw(**{key: value}))


def test_a_config_without_layer_types_alternates_as_transformers_does() -> None:
    raw = _raw(num_hidden_layers=4)
    raw.pop("layer_types", None)
    assert config_from_dict(raw).layer_windows == (WINDOW, 0, WINDOW, 0)


# ---------------------------------------------------------------------------------------------
# MXFP4 experts (the published checkpoints): loaded as int8 groups of 32, exactly

FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mxfp4_encode(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., rows, in] floats to the published layout: blocks uint8 [..., rows, in / 32, 16] (weight
    2j of a block in byte j's low nibble, 2j + 1 in its high nibble; code = sign * 8 + index of
    the magnitude) and scales uint8 [..., rows, in / 32] (e8m0: 2^(s - 127)), each block scaled
    so that its largest magnitude fits 6."""
    *lead, rows, width = weight.shape
    values = weight.reshape(-1, width // 32, 32)
    largest = np.abs(values).max(axis=-1, keepdims=True)
    exponents = np.ceil(np.log2(np.maximum(largest, 1e-30) / 6.0)).clip(-127, 128)
    scaled = values / np.exp2(exponents)
    index = np.abs(np.abs(scaled)[..., None] - FP4_MAGNITUDES).argmin(axis=-1)
    codes = (index + 8 * (scaled < 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return (
        blocks.reshape(*lead, rows, width // 32, 16),
        (exponents[..., 0] + 127).astype(np.uint8).reshape(*lead, rows, width // 32),
    )


def _mxfp4_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The published layout's meaning, written from its description: fp4 e2m1 values times
    2^(scale - 127)."""
    table = np.concatenate([FP4_MAGNITUDES, -FP4_MAGNITUDES])
    values = np.stack([table[blocks & 0x0F], table[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = values * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def test_mxfp4_blocks_read_as_int8_exactly() -> None:
    g = np.random.default_rng(0)
    weight = g.normal(size=(3, 8, 96)) * np.exp2(g.integers(-6, 6, size=(3, 8, 1)))
    blocks, scales = _mxfp4_encode(weight)
    scales[0, 0, 0], scales[1, 2, 1] = 0, 200  # a subnormal scale (2^-128), a huge one (2^72)
    int8 = mxfp4_as_int8(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert (int8.format, int8.group_size, int8.shape) == ("int8", 32, (24, 96))
    assert int8.data.abs().max() <= 12
    expected = torch.from_numpy(_mxfp4_decode(blocks, scales).reshape(24, 96))
    assert torch.equal(int8.dequantize().double(), expected)
    # and transformers' own reading of the layout, [experts, in, rows]
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    assert torch.equal(theirs.transpose(1, 2).reshape(24, 96), int8.dequantize())
    assert (expected - torch.from_numpy(weight.reshape(24, 96))).abs().max() > 0  # fp4 does round


@pytest.mark.parametrize(
    ("blocks", "scales", "message"),
    [
        (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.int8), "are uint8"),
        (torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), r"groups, 16\] and scales"),
        (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), "disagree"),
    ],
)
def test_mxfp4_refuses_bad_tensors(blocks: torch.Tensor, scales: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mxfp4_as_int8(blocks, scales)


@pytest.fixture(scope="module")
def mxfp4_dirs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model as an MXFP4 checkpoint (experts as blocks and scales, quantization_config
    as the published ones say it), and as floats holding exactly what those blocks mean (the
    oracle's)."""
    packed, floats = tmp_path_factory.mktemp("gpt_oss_mxfp4"), tmp_path_factory.mktemp("gpt_oss_mxfp4_floats")
    tensors = load_file(model_dir / "model.safetensors")
    packed_tensors, float_tensors = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        ours = tensors[name].transpose(1, 2).double().numpy()  # [experts, out, in]
        blocks, scales = _mxfp4_encode(ours)
        del packed_tensors[name]
        packed_tensors[f"{name}_blocks"], packed_tensors[f"{name}_scales"] = map(torch.from_numpy, (blocks, scales))
        float_tensors[name] = torch.from_numpy(_mxfp4_decode(blocks, scales)).float().transpose(1, 2).contiguous()
    config = json.loads((model_dir / "config.json").read_text())
    save_file(float_tensors, floats / "model.safetensors", metadata={"format": "pt"})
    (floats / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }  # fmt: skip
    save_file(packed_tensors, packed / "model.safetensors", metadata={"format": "pt"})
    (packed / "config.json").write_text(json.dumps(config))
    return packed, floats


@torch.inference_mode()
def test_an_mxfp4_checkpoint_matches_transformers_on_its_meaning(mxfp4_dirs: tuple[Path, Path]) -> None:
    packed, floats = mxfp4_dirs
    assert config_from_model_dir(packed).moe.packed_experts == "mxfp4"  # type: ignore[union-attr]
    runner = Runner(packed, EngineConfig(model=str(packed), page_size=4, num_pages=64, enforce_eager=True))
    for layer in runner.model.layers:
        experts = layer.mlp.experts
        assert isinstance(experts, QuantizedExperts) and experts.gate_up_group == experts.down_group == 32
        assert experts.gate_up_data.dtype == torch.int8 and experts.down_bias is not None
    prompt = _prompts(2)[1]
    [ours] = Generator(runner).generate([prompt], 8, record_logits=True)
    golden = ReferenceOracle(floats).greedy(prompt, 8)
    assert ours.token_ids == golden.token_ids
    assert ours.prefill_logits is not None
    torch.testing.assert_close(ours.prefill_logits, golden.prefill_logits, atol=1e-4, rtol=1e-4)
