"""The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) as tiny random-weight
models written by transformers: several experts, k > 1, a dense layer among the sparse ones
(Qwen3-MoE), a gated shared expert (Qwen2-MoE), a sliding window (Mixtral), whole-width q/k norms
and clamping (OLMoE). Greedy ids token for token and logits against transformers fp32, batched
with chunked prefill and alone, after a prefix-cache hit, compiled (Qwen3-MoE), with speculation,
quantized experts, attention-only LoRA against PEFT, and the refusals."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from compiled_engine import LoRARequest
from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import Generator
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import ModelConfigError
from compiled_engine.executor.runner import Runner
from compiled_engine.linear.quantized_experts import QuantizedExperts
from compiled_engine.llm import LLM
from compiled_engine.lora.adapter import LoRAError, load_adapter
from compiled_engine.model.moe import Experts
from compiled_engine.model.registry import check_shard, config_from_dict, config_from_model_dir
from compiled_engine.model.shard import TPShard
from reference_oracle import ReferenceOracle
from tests.conftest import TINY_LLAMA

WINDOW = 16
SMALL: dict[str, Any] = dict(TINY_LLAMA, pad_token_id=0, num_hidden_layers=3)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            SMALL, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[1],
        ),
    ),
    "qwen2_moe": (
        "qwen2_moe",
        dict(SMALL, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    "mixtral": ("mixtral", dict(SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=WINDOW)),
    "olmoe": ("olmoe", dict(SMALL, num_experts=4, num_experts_per_tok=2, clip_qkv=3.0, intermediate_size=64)),
}  # fmt: skip
PROMPT_LENGTHS = (9, 33, 47)
NEW_TOKENS = 20
COMPILED = ("qwen3_moe",)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> tuple[str, Path]:
    model_type, overrides = VARIANTS[request.param]
    return request.param, tiny_model_factory(model_type, seed=len(request.param), **overrides)


@pytest.fixture(scope="module")
def oracle(variant: tuple[str, Path]) -> ReferenceOracle:
    return ReferenceOracle(variant[1])


@pytest.fixture(scope="module")
def golden(oracle: ReferenceOracle) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): oracle.greedy(p, NEW_TOKENS).token_ids for p in _prompts(1)}


@pytest.fixture(scope="module")
def engine(variant: tuple[str, Path]) -> LLM:
    compiled = variant[0] in COMPILED
    llm = LLM(model=str(variant[1]), page_size=4, num_pages=128, max_num_batched_tokens=16, enforce_eager=not compiled)
    assert llm.engine.runner.forward.compiled == compiled
    return llm


def test_config_reads_the_mixture(variant: tuple[str, Path]) -> None:
    name, model_dir = variant
    config = config_from_model_dir(model_dir)
    assert config.architecture == name and config.moe is not None
    overrides = VARIANTS[name][1]
    assert config.moe.num_experts == overrides.get("num_experts", overrides.get("num_local_experts"))
    assert config.moe.top_k == overrides["num_experts_per_tok"]
    assert config.moe.dense_layers == ((1,) if name == "qwen3_moe" else ())
    assert config.moe.renormalize == (name in ("qwen3_moe", "mixtral"))
    assert (config.moe.shared_intermediate_size, config.moe.shared_gate) == (
        (64, True) if name == "qwen2_moe" else (0, False)
    )


def test_batched_chunked_greedy_matches_transformers(engine: LLM, golden: dict[tuple[int, ...], list[int]]) -> None:
    prompts = [list(p) for p in golden]
    outputs = engine.generate(prompts, _greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == golden[tuple(prompt)]


def test_alone_and_after_a_prefix_cache_hit(engine: LLM, golden: dict[tuple[int, ...], list[int]]) -> None:
    prompt = list(next(reversed(golden)))
    first = engine.generate([prompt], _greedy(), use_tqdm=False)[0]
    again = engine.generate([prompt], _greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens > WINDOW
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == golden[tuple(prompt)]


@torch.inference_mode()
def test_eager_logits_at_every_step_match_transformers(variant: tuple[str, Path], oracle: ReferenceOracle) -> None:
    runner = Runner(variant[1], EngineConfig(model=str(variant[1]), page_size=4, num_pages=64, enforce_eager=True))
    prompt = _prompts(2)[1]
    [ours] = Generator(runner).generate([prompt], 8, record_logits=True)
    golden = oracle.greedy(prompt, 8)
    assert ours.token_ids == golden.token_ids
    assert ours.prefill_logits is not None
    torch.testing.assert_close(ours.prefill_logits, golden.prefill_logits, atol=1e-4, rtol=1e-4)


def _family(name: str) -> list[Any]:
    """The families, `name` in the quick tier and the others in the full tier."""
    return [f if f == name else pytest.param(f, marks=pytest.mark.full) for f in sorted(VARIANTS)]


def _model(name: str, tiny_model_factory: Callable[..., Path]) -> Path:
    model_type, overrides = VARIANTS[name]
    return tiny_model_factory(model_type, seed=len(name), **overrides)


@pytest.mark.parametrize("name", _family("qwen3_moe"))
def test_speculative_decoding_keeps_greedy_output(name: str, tiny_model_factory: Callable[..., Path]) -> None:
    variant = (name, _model(name, tiny_model_factory))
    oracle = ReferenceOracle(variant[1])
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(model=str(variant[1]), page_size=4, num_pages=64, enforce_eager=True, speculative_config=speculative)
    prompt = torch.randperm(317, generator=torch.Generator().manual_seed(3))[:200].add(3).tolist()
    out = llm.generate([prompt], _greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == oracle.greedy(prompt, NEW_TOKENS).token_ids
    stats = llm.engine.speculative_stats
    assert stats is not None and stats.draft_tokens > 0


@pytest.mark.parametrize("name", _family("qwen2_moe"))
@torch.inference_mode()
def test_quantized_experts_run_as_their_dequantized_twin(name: str, tiny_model_factory: Callable[..., Path]) -> None:
    """--quantization int8: the experts stay quantized (QuantizedExperts, grouped kernels); the
    same weights dequantized into the model's own Experts give the same logits."""
    model_dir = _model(name, tiny_model_factory)
    config = EngineConfig(model=str(model_dir), page_size=4, num_pages=64, enforce_eager=True, quantization="int8")
    runner = Runner(model_dir, config)
    experts = [m for m in runner.model.modules() if isinstance(m, QuantizedExperts)]
    moe = config_from_model_dir(model_dir).moe
    assert moe is not None and len(experts) == sum(moe.sparse(i) for i in range(len(runner.model.layers)))
    prompt = _prompts(4)[1]
    [quantized] = Generator(runner).generate([prompt], 4, record_logits=True)
    for layer in runner.model.layers:
        held = getattr(layer.mlp, "experts", None)
        if isinstance(held, QuantizedExperts):
            layer.mlp.experts = _dense_twin(held)
    [twin] = Generator(runner).generate([prompt], 4, record_logits=True)
    assert quantized.token_ids == twin.token_ids
    assert quantized.prefill_logits is not None and twin.prefill_logits is not None
    torch.testing.assert_close(quantized.prefill_logits, twin.prefill_logits, atol=1e-4, rtol=1e-4)


def _dense_twin(quantized: QuantizedExperts) -> torch.nn.Module:
    from compiled_engine.experts.op import reference_expert_mlps

    gate_up, down = quantized.dense()

    class Twin(torch.nn.Module):
        def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return reference_expert_mlps(
                x, weights, ids, gate_up, down, quantized.activation, quantized.gate_up_bias, quantized.down_bias
            )

    return Twin()


def test_tensor_parallel_sizes_that_split_no_expert_evenly_are_refused(variant: tuple[str, Path]) -> None:
    config = config_from_model_dir(variant[1])
    if variant[0] == "olmoe":
        with pytest.raises(ModelConfigError, match=r"--tensor-parallel-size 2: not supported for olmoe: its q/k norms"):
            check_shard(config, TPShard(0, 2))
        return
    check_shard(config, TPShard(0, 2))
    with pytest.raises(ModelConfigError, match=r"--tensor-parallel-size 3 must divide .*the expert intermediate size"):
        check_shard(config, TPShard(0, 3))


def test_attention_lora_matches_peft_and_expert_lora_is_refused(variant: tuple[str, Path], tmp_path: Path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    name, model_dir = variant
    if name != "qwen3_moe":
        pytest.skip("one family carries the LoRA checks")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(5)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for param_name, param in peft.named_parameters():
            if "lora_" in param_name:
                param.normal_(0.0, 0.2)
    peft.save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tmp_path / "adapter"
    ).eval()
    prompt = _prompts(4)[0]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        generated = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    expected = generated[0, len(prompt) :].tolist()
    llm = LLM(model=str(model_dir), enable_lora=True, enforce_eager=True, page_size=4, num_pages=64)
    lora = LoRARequest("attention", str(tmp_path / "adapter"))
    [with_lora, without] = llm.generate([prompt, prompt], _greedy(12), use_tqdm=False, lora_request=[lora, None])
    assert with_lora.outputs[0].token_ids == expected
    assert without.outputs[0].token_ids != expected

    config = config_from_model_dir(model_dir)
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    for key in ("layers.0.mlp.experts.3.gate_proj", "layers.2.mlp.gate_proj"):  # an expert; a sparse layer's MLP
        prefix = f"base_model.model.model.{key}"
        save_file(
            {f"{prefix}.lora_A.weight": torch.zeros(4, 64), f"{prefix}.lora_B.weight": torch.zeros(32, 4)},
            tmp_path / "adapter" / "adapter_model.safetensors",
        )
        with pytest.raises(LoRAError, match="LoRA on a mixture of experts is not supported"):
            load_adapter(tmp_path / "adapter", config, 8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is more than the 8 experts"),
        ({"num_experts": 0}, "'num_experts' must be a positive integer"),
        ({"moe_intermediate_size": None}, "'moe_intermediate_size' must be a positive integer"),
        ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be a positive integer"),
        ({"mlp_only_layers": "1"}, "'mlp_only_layers' must be a list"),
        ({"norm_topk_prob": "yes"}, "'norm_topk_prob' must be true or false"),
    ],
)
def test_bad_mixture_configs_are_refused_by_name(change: dict[str, Any], message: str) -> None:
    raw = {
        **TINY_LLAMA, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, **change,
    }  # fmt: skip
    with pytest.raises(ModelConfigError, match=message):
        config_from_dict(raw)


@pytest.mark.parametrize(
    ("name", "parallel"),
    [
        ("qwen2_moe", {"tensor_parallel_size": 2}),
        pytest.param("mixtral", {"tensor_parallel_size": 2}, marks=pytest.mark.full),
        ("qwen3_moe", {"pipeline_parallel_size": 2}),  # a stage holds the dense layer, the other sparse ones
    ],
)
def test_parallel_experts_match_a_single_process(
    name: str, parallel: dict[str, int], tiny_model_factory: Callable[..., Path]
) -> None:
    """TP = 2: every expert's intermediate features (and the shared expert's) split across the
    ranks, the router replicated; PP = 2: each stage its layers' mixtures. The single process's
    greedy ids and logprobs."""
    from tests.test_tensor_parallel import PROMPTS, _assert_same, _fields, _generate, _in_child

    model_type, overrides = VARIANTS[name]
    model_dir = str(tiny_model_factory(model_type, seed=len(name), **overrides))
    base = EngineConfig(model=model_dir, kv_cache_memory_gib=0.01, enforce_eager=True, max_num_batched_tokens=8)
    single = _generate(base, PROMPTS, 6)
    _assert_same(_in_child(EngineConfig(**{**_fields(base), **parallel}), PROMPTS, 6), single)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_step_reads_the_chosen_experts_bytes(
    quantization: str | None, tiny_model_factory: Callable[..., Path]
) -> None:
    """The bench's weight bytes a token reads: of each mixture's experts, k / experts of their
    bytes (the active parameters); everything else whole, as for a dense model."""
    from compiled_engine.bench.runs import model_weight_bytes

    model_dir = _model("qwen3_moe", tiny_model_factory)
    config = EngineConfig(
        model=str(model_dir), page_size=4, num_pages=64, enforce_eager=True, quantization=quantization
    )
    model = Runner(model_dir, config).model
    moe = model.config.moe
    assert moe is not None
    experts = [m for m in model.modules() if isinstance(m, Experts | QuantizedExperts)]
    expert_bytes = sum(t.numel() * t.element_size() for m in experts for t in [*m.parameters(), *m.buffers()])
    everything = model_weight_bytes(model)
    # the same model said to choose every expert: its experts' weights counted whole
    model.config = msgspec.structs.replace(model.config, moe=msgspec.structs.replace(moe, top_k=moe.num_experts))
    assert model_weight_bytes(model) - everything == round(expert_bytes * (1 - moe.top_k / moe.num_experts))
