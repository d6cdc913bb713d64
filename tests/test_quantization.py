"""Quantized weights: the formats and quantizers, the CPU kernels against the reference path
(dequantize in torch, then F.linear), the operator eager and compiled, the kernels' build
fallback, and whole models quantized at load against the same model with the dequantized
weights put back."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from compiled_engine.bench.runs import model_weight_bytes
from compiled_engine.config import EngineConfig
from compiled_engine.executor.runner import Runner
from compiled_engine.executor.step import StepInputs
from compiled_engine.linear import quantized_cpu_kernels as cpu_kernels
from compiled_engine.linear import quantized_op as ops
from compiled_engine.linear.quantize import QuantizationScheme, quantize, quantize_int4, quantize_int8, quantize_model
from compiled_engine.linear.quantized import (
    INT8_DIRECT_MAX_ROWS,
    Int8ActivationsLinear,
    QuantizedEmbedding,
    QuantizedLinear,
)
from compiled_engine.linear.quantized_weight import (
    QuantizationError,
    QuantizedWeight,
    concat_rows,
    dequantize_rows,
    pack_int4,
    unpack_int4,
)
from compiled_engine.model.layers import Linear
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.native_build import KernelBuildError

# (format, group size) pairs: per-channel int8, GGUF's Q8_0 and Q4_1 layouts, wider int4 groups.
FORMATS = [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128)]


def _weight(out: int, width: int, fmt: str, group: int | None, seed: int = 0) -> QuantizedWeight:
    torch.manual_seed(seed)
    return quantize(torch.randn(out, width), fmt, group)


@pytest.fixture(scope="module")
def kernels() -> cpu_kernels.QuantKernels:
    return cpu_kernels.load_quant_kernels()


# ---------------------------------------------------------------------------------------------
# formats and quantizers


def test_int4_packing_is_ggufs_block_layout() -> None:
    values = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    packed = pack_int4(values)
    assert packed.shape == (1, 32)
    # byte j of a block: weight j in the low nibble, weight j + 16 in the high one
    assert int(packed[0, 3]) == int(values[0, 3]) | (int(values[0, 19]) << 4)
    assert int(packed[0, 16 + 5]) == int(values[0, 32 + 5]) | (int(values[0, 48 + 5]) << 4)
    assert torch.equal(unpack_int4(packed), values)


@pytest.mark.parametrize(("fmt", "group"), FORMATS)
def test_quantization_error_is_at_most_half_a_step(fmt: str, group: int | None) -> None:
    dense = torch.randn(24, 256)
    weight = quantize(dense, fmt, group)
    g = group or 256
    steps = weight.scales.repeat_interleave(g, dim=1)
    error = (weight.dequantize() - dense).abs()
    assert (error <= steps / 2 + 1e-6).all()
    assert error.max() > 0  # really quantized


def test_int4_keeps_each_groups_extremes_exact() -> None:
    dense = torch.randn(8, 64)
    back = quantize_int4(dense, 32).dequantize().reshape(8, 2, 32)
    groups = dense.reshape(8, 2, 32)
    torch.testing.assert_close(back.amin(-1), groups.amin(-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(back.amax(-1), groups.amax(-1), rtol=0, atol=1e-6)


def test_a_constant_group_quantizes_without_dividing_by_zero() -> None:
    dense = torch.zeros(2, 64)
    dense[1] = 0.5
    for weight in (quantize_int4(dense, 32), quantize_int8(dense), quantize_int8(dense, 32)):
        assert torch.equal(weight.dequantize(), dense)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: quantize_int4(torch.randn(4, 48), 32), "multiple of 32 that divides the row width 48"),
        (lambda: quantize_int4(torch.randn(4, 64), 48), "multiple of 32"),
        (lambda: quantize_int8(torch.randn(4, 60), 32), "does not divide the row width 60"),
        (lambda: quantize_int8(torch.randn(4, 4, 4)), "only 2-D floating-point weights"),
        (lambda: quantize(torch.randn(4, 64), "int3", None), "unknown quantization format 'int3'"),
    ],
)
def test_shapes_that_do_not_fit_the_group_are_refused(call: Callable[[], object], message: str) -> None:
    with pytest.raises(QuantizationError, match=message):
        call()


def test_inconsistent_tensors_are_not_a_weight() -> None:
    good = quantize_int4(torch.randn(4, 64), 32)
    with pytest.raises(QuantizationError, match="data must be uint8"):
        QuantizedWeight("int4", good.data.to(torch.int8), good.scales, good.offsets, 32, 64)
    with pytest.raises(QuantizationError, match="need offsets"):
        QuantizedWeight("int4", good.data, good.scales, None, 32, 64)
    with pytest.raises(QuantizationError, match="scales must be float32"):
        QuantizedWeight("int4", good.data, good.scales.half(), good.offsets, 32, 64)
    with pytest.raises(QuantizationError, match="format must be one of"):
        QuantizedWeight("int2", good.data, good.scales, good.offsets, 32, 64)


def test_rows_narrow_and_concat_agree_with_the_dense_matrix() -> None:
    a, b = _weight(8, 64, "int4", 32, seed=1), _weight(4, 64, "int4", 32, seed=2)
    both = concat_rows([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert torch.equal(both.narrow_rows(8, 4).dequantize(), b.dequantize())
    index = torch.tensor([[3, 9], [0, 0]])
    assert torch.equal(both.rows(index), both.dequantize()[index])
    mixed = concat_rows([a, _weight(4, 64, "int8", 32, seed=3)])  # int4 rows join as int8, exactly
    assert mixed.format == "int8"
    assert torch.equal(mixed.narrow_rows(0, 8).dequantize(), a.dequantize())
    with pytest.raises(QuantizationError, match="cannot stack a weight of width 32"):
        concat_rows([a, _weight(4, 32, "int4", 32)])


# ---------------------------------------------------------------------------------------------
# kernels against the reference


@pytest.mark.parametrize(("fmt", "group"), FORMATS)
def test_the_dequantize_kernel_equals_the_reference_exactly(
    kernels: cpu_kernels.QuantKernels, fmt: str, group: int | None
) -> None:
    weight = _weight(37, 256, fmt, group)
    assert torch.equal(kernels.dequantize(weight), dequantize_rows(weight, None))


@pytest.mark.parametrize(("fmt", "group"), FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
def test_the_product_kernel_matches_dequantize_then_matmul(
    kernels: cpu_kernels.QuantKernels, fmt: str, group: int | None, rows: int
) -> None:
    weight = _weight(53, 384, fmt, group, seed=rows)  # 53 rows: not a whole number of strips
    x = torch.randn(rows, 384)
    bias = torch.randn(53)
    expected = F.linear(x, weight.dequantize(), bias)
    torch.testing.assert_close(kernels.matmul(x, weight, bias), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.matmul(x, weight, None), expected - bias, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_kernels_give_the_same_result_on_any_thread_count(kernels: cpu_kernels.QuantKernels, threads: int) -> None:
    weight = _weight(100, 128, "int4", 32)
    x = torch.randn(6, 128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.matmul(x, weight, None)
        torch.set_num_threads(threads)
        assert torch.equal(kernels.matmul(x, weight, None), one)  # each output sums in one thread
        assert torch.equal(kernels.dequantize(weight), weight.dequantize())
    finally:
        torch.set_num_threads(before)


def test_the_kernels_refuse_bad_input(kernels: cpu_kernels.QuantKernels) -> None:
    weight = _weight(8, 64, "int4", 32)
    with pytest.raises(ValueError, match=r"x must be float32 \[rows, 64\]"):
        kernels.matmul(torch.randn(2, 32), weight, None)
    with pytest.raises(ValueError, match="x must be float32"):
        kernels.matmul(torch.randn(2, 64, dtype=torch.float64), weight, None)
    with pytest.raises(ValueError, match=r"bias must be float32 \[8\]"):
        kernels.matmul(torch.randn(2, 64), weight, torch.randn(7))
    odd = QuantizedWeight("int8", torch.zeros(4, 12, dtype=torch.int8), torch.ones(4, 3), None, 4, 12)
    with pytest.raises(ValueError, match="not whole vectors of 8"):
        kernels.matmul(torch.randn(1, 12), odd, None)


# ---------------------------------------------------------------------------------------------
# the operator


@pytest.mark.parametrize("rows", [1, 16, 17, 40])
@pytest.mark.parametrize(("fmt", "group"), [("int8", None), ("int4", 32)])
def test_the_operator_takes_the_kernel_or_the_gemm_and_matches_the_reference(
    rows: int, fmt: str, group: int | None
) -> None:
    weight = _weight(48, 128, fmt, group)
    module = QuantizedLinear(weight, torch.randn(48))
    x = torch.randn(rows, 128)
    expected = ops.reference_linear(x, weight, module.bias)
    torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(module(x[None]), expected[None], rtol=1e-5, atol=1e-4)  # leading dims
    compiled = torch.compile(module.forward, fullgraph=True)
    torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize(("fmt", "group"), [("int8", None), ("int8", 32), ("int4", 32), ("int4", 128)])
def test_the_native_operator_equals_the_python_one(rows: int, fmt: str, group: int | None) -> None:
    weight = _weight(48, 256, fmt, group, seed=rows)
    native = ops.native_operator()
    assert native is not None
    x, bias = torch.randn(rows, 256), torch.randn(48)
    args = (x, weight.data, weight.scales, weight.offsets, bias, weight.group_size)
    through_python = ops.run_quantized_linear(*args)
    assert torch.equal(ops.quantized_linear(x, weight, bias, native=native), through_python)  # the same kernels
    module = QuantizedLinear(weight, bias)
    assert module.native is native
    torch.testing.assert_close(module(x), ops.reference_linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[rows, 256\]"):
        native(torch.randn(rows, 128), *args[1:], 4, 64)


def test_the_operator_runs_the_reference_for_other_dtypes() -> None:
    weight = _weight(16, 64, "int4", 32)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    out = QuantizedLinear(weight)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x, weight.dequantize(torch.bfloat16)))


def test_without_a_compiler_the_reference_path_runs_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("COMPILED_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    caches = (cpu_kernels.load_quant_kernels, ops.cpu_kernels, ops.native_operator)
    for cached in caches:
        cached.cache_clear()
    try:
        with pytest.raises(KernelBuildError, match="'no-such-compiler' is not on PATH"):
            cpu_kernels.load_quant_kernels()
        weight = _weight(16, 64, "int4", 32)
        x = torch.randn(2, 64)
        with caplog.at_level(logging.WARNING):
            module = QuantizedLinear(weight)
            first = module(x)
            QuantizedLinear(weight)(x)
        assert module.native is None
        warnings = [r for r in caplog.records if "torch reference path" in r.getMessage()]
        assert len(warnings) == 1 and "no C compiler" in warnings[0].getMessage()
        assert sum("call their kernels from Python" in r.getMessage() for r in caplog.records) == 1
        assert torch.equal(first, F.linear(x, weight.dequantize()))
    finally:
        for cached in caches:
            cached.cache_clear()


# ---------------------------------------------------------------------------------------------
# whole models


def _dense_twin(model: torch.nn.Module) -> None:
    """Put each quantized weight back as a dense Linear holding its dequantized values."""
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            parent, _, child = name.rpartition(".")
            dense = Linear(module.in_features, module.out_features, bias=module.bias is not None)
            dense.weight = torch.nn.Parameter(module.weight.dequantize(), requires_grad=False)
            if module.bias is not None:
                dense.bias = torch.nn.Parameter(module.bias.detach().clone(), requires_grad=False)
            setattr(model.get_submodule(parent) if parent else model, child, dense)
        elif isinstance(module, QuantizedEmbedding):
            model.embed_tokens = torch.nn.Embedding.from_pretrained(module.weight.dequantize())


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize(("fmt", "group", "head"), [("int8", None, True), ("int4", 32, True), ("int4", 64, False)])
def test_a_model_quantized_at_load_equals_its_dequantized_twin(
    tiny_model_factory: Callable[..., Path], model_type: str, fmt: str, group: int | None, head: bool
) -> None:
    model_dir = tiny_model_factory(model_type, max_position_embeddings=64)
    config = EngineConfig(
        model=str(model_dir),
        quantization=fmt,
        quantization_group_size=group,
        quantize_head=head,
        enforce_eager=True,
        kv_cache_memory_gib=0.01,
    )
    runner = Runner(model_dir, config)
    model = runner.model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * model.config.num_layers + (1 if head else 0)
    assert all(m.format == fmt for m in linears if m is not model.lm_head)
    assert isinstance(model.embed_tokens, QuantizedEmbedding) == head
    inputs = StepInputs(list(range(3, 14)), list(range(11)), [11], [11], [[0]])
    with torch.inference_mode():
        quantized = runner.forward.logits(runner.hidden_states(inputs))
        _dense_twin(model)
        twin = runner.forward.logits(runner.hidden_states(inputs))
        dense = Runner(model_dir, EngineConfig(model=str(model_dir), enforce_eager=True, kv_cache_memory_gib=0.01))
        original = dense.forward.logits(dense.hidden_states(inputs))
    torch.testing.assert_close(quantized, twin, rtol=1e-4, atol=1e-4)
    assert (quantized - original).abs().max() > 1e-4  # the quantization really changed the weights


def test_quantize_model_refuses_a_width_the_group_does_not_divide_and_changes_nothing(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model_dir = tiny_model_factory("llama", max_position_embeddings=64)
    runner = Runner(model_dir, EngineConfig(model=str(model_dir), enforce_eager=True, kv_cache_memory_gib=0.01))
    with pytest.raises(
        QuantizationError, match=r"layers\.0\.self_attn\.qkv_proj: int4 group size 128 .*divides the row width 64"
    ):
        quantize_model(runner.model, QuantizationScheme("int4", 128))
    assert not any(isinstance(m, QuantizedLinear) for m in runner.model.modules())
    with pytest.raises(QuantizationError, match="group size must be one of"):
        QuantizationScheme("int4", 48)
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4"):
        EngineConfig(quantization="fp4")
    with pytest.raises(ValueError, match="quantization_group_size needs quantization int8 or int4"):
        EngineConfig(quantization_group_size=32)


def test_int4_weights_take_under_a_third_of_the_fp32_bytes(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("llama", max_position_embeddings=64, hidden_size=128, intermediate_size=256)

    def resident(**options: object) -> int:
        config = EngineConfig(model=str(model_dir), enforce_eager=True, kv_cache_memory_gib=0.01, **options)  # type: ignore[arg-type]
        return model_weight_bytes(Runner(model_dir, config).model)

    dense, int4 = resident(), resident(quantization="int4")
    assert int4 < dense / 3


def test_tensor_parallelism_shards_the_gguf_or_refuses_quantizing_at_load(
    default_model_dir: Path, tiny_model_factory: Callable[..., Path]
) -> None:
    from compiled_engine.model.shard import TPShard
    from compiled_engine.weights.load import load_weights

    config = config_from_model_dir(default_model_dir)
    cpu = torch.device("cpu")
    loaded = load_weights(default_model_dir, config, EngineConfig(), torch.float32, cpu, TPShard(1, 3))
    assert loaded.description.startswith("GGUF")  # the file's quantized tensors, this rank's slices
    down = loaded.model.get_submodule("layers.0.mlp.down_proj")
    assert isinstance(down, QuantizedLinear) and down.weight.shape == (576, 512)
    qkv = loaded.model.get_submodule("layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, QuantizedLinear) and qkv.weight.shape == (3 * 64 + 2 * 64, 576)
    dense = load_weights(
        default_model_dir, config, EngineConfig(quantization="none"), torch.float32, cpu, TPShard(0, 3)
    )
    assert dense.description.startswith("dense")
    assert not any(isinstance(m, QuantizedLinear) for m in dense.model.modules())
    tiny = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="--quantization int4 does not run with tensor parallelism"):
        load_weights(
            tiny, config_from_model_dir(tiny), EngineConfig(quantization="int4"), torch.float32, cpu, TPShard(0, 2)
        )


# ---------------------------------------------------------------------------------------------
# int8 activations (--cpu-activations int8: lossy, opt-in)

# (format, group size, offsets): Q4_1/Q4_K's int4, Q4_K-like wider int4 groups, Q8_0's int8, and
# int8 with offsets (Q5_1's form).
Q8X_FORMATS = [("int4", 32, True), ("int4", 64, True), ("int8", 32, False), ("int8", 32, True)]


def _q8x_weight(out: int, width: int, fmt: str, group: int, offsets: bool, seed: int) -> QuantizedWeight:
    weight = _weight(out, width, fmt, group, seed)
    if fmt == "int8" and offsets:
        weight = QuantizedWeight(
            "int8", weight.data, weight.scales, torch.randn_like(weight.scales) * 0.01, group, width
        )
    return weight


@pytest.mark.parametrize(("fmt", "group", "offsets"), Q8X_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 32])
def test_int8_activation_products_match_their_torch_twin(fmt: str, group: int, offsets: bool, rows: int) -> None:
    weight = _q8x_weight(53, 384, fmt, group, offsets, seed=rows)  # 53 outputs, 12 blocks a row
    x = torch.randn(rows, 384)
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by zero
    bias = torch.randn(53)
    module = Int8ActivationsLinear(weight, bias)
    args = (x, weight, module.bias)
    expected = ops.int8_activations_reference(*args)
    torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-4)
    # lossy against the exact product, and by as much as 8-bit activations lose
    exact = ops.reference_linear(*args)
    error = ((module(x) - exact).norm() / exact.norm()).item()
    assert 1e-4 < error < 3e-2


def test_int8_activation_products_run_longer_prompts_exactly() -> None:
    weight = _weight(48, 256, "int4", 32)
    module = Int8ActivationsLinear(weight)
    x = torch.randn(INT8_DIRECT_MAX_ROWS + 1, 256)
    args = (x, weight, None)
    torch.testing.assert_close(module(x), ops.reference_linear(*args), rtol=1e-5, atol=1e-4)
    compiled = torch.compile(module.forward, fullgraph=True)
    one = x[:1]
    torch.testing.assert_close(compiled(one), ops.int8_activations_reference(one, *args[1:]), rtol=1e-5, atol=1e-4)


def test_weights_in_groups_of_16_keep_exact_activations() -> None:
    held = QuantizedLinear(_weight(16, 64, "int8", 16))
    assert type(Int8ActivationsLinear.from_held(held)) is QuantizedLinear
    with pytest.raises(ValueError, match="groups of whole blocks of 32, not 16"):
        Int8ActivationsLinear(held.weight)
    assert type(Int8ActivationsLinear.from_held(QuantizedLinear(_weight(16, 64, "int4", 32)))) is Int8ActivationsLinear


def test_int8_activations_are_refused_off_the_cpu_and_by_name() -> None:
    with pytest.raises(ValueError, match="cpu_activations must be one of fp32, int8, got 'int16'"):
        EngineConfig(cpu_activations="int16")


def test_the_int8_activation_operator_refuses_bad_input_by_its_own_name() -> None:
    weight = _weight(16, 64, "int4", 32)
    op = ops.int8_activations_operator()
    assert op is not None
    args = (weight.data, weight.scales, weight.offsets, None, weight.group_size, 4, 64)
    with pytest.raises(RuntimeError, match=r"quantized_linear_q8x_f32: x must be float32 \[rows, 64\]"):
        op(torch.randn(2, 32), *args)
    with pytest.raises(RuntimeError, match="quantized_linear_q8x_f32: groups must be whole blocks of 32, not 16"):
        op(torch.randn(2, 64), *args[:3], None, 16, 4, 64)


def test_int8_activations_without_the_native_operator_fail_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "native_operator", lambda: None)
    with pytest.raises(ValueError, match="int8 activations need the native quantized operator"):
        Int8ActivationsLinear(_weight(16, 64, "int4", 32))
