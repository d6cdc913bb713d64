"""The many-row quantized product (quant_matmul.c's `quant_gemm_f32`) against its slow twin,
dequantize-then-`F.linear`, and the measured row crossovers that choose among the three CPU
ways (linear/crossover.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from compiled_engine.linear import crossover as crossovers
from compiled_engine.linear import quantized_cpu_kernels as cpu_kernels
from compiled_engine.linear import quantized_op as ops
from compiled_engine.linear.crossover import RowCrossover
from compiled_engine.linear.install import install_kernels
from compiled_engine.linear.quantize import quantize
from compiled_engine.linear.quantized import INT8_DIRECT_MAX_ROWS, Int8ActivationsLinear, QuantizedLinear
from compiled_engine.linear.quantized_weight import QuantizedWeight
from compiled_engine.weights.gguf_blocks import decode_blocks
from tests.test_gguf_kquants import QT, random_blocks


@pytest.fixture(scope="module")
def kernels() -> cpu_kernels.QuantKernels:
    return cpu_kernels.load_quant_kernels()


def _weight(out: int, width: int, fmt: str, group: int | None, seed: int = 0) -> QuantizedWeight:
    torch.manual_seed(seed)
    return quantize(torch.randn(out, width), fmt, group)


def _gguf_weight(type_name: str, out: int, width: int) -> QuantizedWeight:
    qtype = QT[type_name]
    return decode_blocks(torch.from_numpy(random_blocks(qtype, out, width, seed=qtype.value)), qtype.value)


def assert_product_close(
    got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> None:
    """Within fp32 rounding of the dequantize-then-`F.linear` product: a few units of the last
    place of the sum of the products' magnitudes (the kernels sum in another order, and
    dequantize with one multiply-add where the reference rounds twice)."""
    expected = ops.reference_linear(x, weight, bias)
    magnitude = x.abs() @ weight.dequantize(torch.float32).abs().T + (0 if bias is None else bias.abs())
    error = (got - expected).abs()
    assert (error <= 1e-5 * magnitude + 1e-6).all(), (
        f"worst error {(error / magnitude).max().item():.2e} of the magnitude"
    )


ROWS = [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 33, 64]

# (format, group): int8 per channel, in groups of 8 (a tail of 8 on 16-float vectors) and 32; int4
# in groups of 32 and 128. Widths: a multiple of 8 but not of 16, and one past the kernel's input
# block of 1024 columns (two blocks summed).
SHAPES = [
    ("int8", None, 37, 264),
    ("int8", 8, 40, 264),
    ("int8", 32, 48, 2304),
    ("int4", 32, 37, 2304),
    ("int4", 128, 50, 1280),
]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("fmt", "group", "out", "width"), SHAPES)
def test_the_many_row_kernel_equals_dequantize_then_linear(
    kernels: cpu_kernels.QuantKernels, rows: int, fmt: str, group: int | None, out: int, width: int
) -> None:
    weight = _weight(out, width, fmt, group, seed=rows)
    x, bias = torch.randn(rows, width), torch.randn(out)
    assert_product_close(kernels.gemm_unchecked(x, weight, bias), x, weight, bias)
    assert_product_close(kernels.gemm_unchecked(x, weight, None), x, weight, None)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_the_many_row_kernel_takes_every_gguf_block_type(kernels: cpu_kernels.QuantKernels, type_name: str) -> None:
    weight = _gguf_weight(type_name, 45, 512)
    for rows in (6, 16, 40):
        x = torch.randn(rows, 512)
        assert_product_close(kernels.gemm_unchecked(x, weight, None), x, weight, None)


def test_the_many_row_kernel_refuses_shapes_it_does_not_take(kernels: cpu_kernels.QuantKernels) -> None:
    weight = _weight(16, 64, "int4", 32)
    bad = QuantizedWeight.of_tensors(weight.data, weight.scales, weight.offsets, 48)  # 64 is not whole groups of 48
    with pytest.raises(ValueError, match=r"quantized gemm: the kernel refused \[16, 64\]"):
        kernels.gemm_unchecked(torch.randn(4, 64), bad, None)


@pytest.mark.parametrize(("fmt", "group"), [("int8", None), ("int4", 32)])
def test_the_native_operator_takes_each_way_at_its_crossover(
    kernels: cpu_kernels.QuantKernels, fmt: str, group: int | None
) -> None:
    weight = _weight(40, 256, fmt, group)
    native = ops.native_operator()
    assert native is not None
    crossover = RowCrossover(direct_max_rows=3, gemm_max_rows=9)
    for rows, way in ((1, "direct"), (3, "direct"), (4, "gemm"), (9, "gemm"), (10, "dequantize")):
        assert crossover.way(rows) == way
        x, bias = torch.randn(rows, 256), torch.randn(40)
        got = ops.quantized_linear(x, weight, bias, native, crossover)
        if way == "direct":
            assert torch.equal(got, kernels.matmul_unchecked(x, weight, bias))
        elif way == "gemm":
            assert torch.equal(got, kernels.gemm_unchecked(x, weight, bias))
        assert_product_close(got, x, weight, bias)
    # no direct rows at all: one row runs the many-row kernel
    x = torch.randn(1, 256)
    got = ops.quantized_linear(x, weight, None, native, RowCrossover(0, 8))
    assert torch.equal(got, kernels.gemm_unchecked(x, weight, None))


def test_a_measured_crossover_is_ordered_and_cached_on_disk(
    kernels: cpu_kernels.QuantKernels, private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    crossovers._known.cache_clear()
    weights = [_weight(64, 128, "int4", 32), _weight(64, 128, "int4", 32, seed=1), _weight(32, 64, "int8", None)]
    measured: list[str] = []
    measure = crossovers.measure_crossover

    def counted(weight: QuantizedWeight, kernels: cpu_kernels.QuantKernels) -> RowCrossover:
        measured.append(crossovers.shape_key(weight, torch.get_num_threads()))
        return measure(weight, kernels)

    monkeypatch.setattr(crossovers, "measure_crossover", counted)
    first = crossovers.crossovers_for(weights, kernels)
    assert len(measured) == 2  # one per shape: the first two weights share theirs
    assert first[0] == first[1]
    for found in first:
        assert 0 <= found.direct_max_rows <= found.gemm_max_rows <= crossovers.GEMM_ROWS[-1]
        assert found.gemm_max_rows >= 1
    stored = json.loads(crossovers._store_path().read_text())
    assert sorted(stored) == sorted(set(measured))
    # a new process (an empty memory) reads the file and measures nothing
    crossovers._known.cache_clear()
    assert crossovers.crossovers_for(weights, kernels) == first
    assert len(measured) == 2
    crossovers._known.cache_clear()


def test_an_unreadable_crossover_file_is_measured_again_with_a_warning(
    kernels: cpu_kernels.QuantKernels, private_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    crossovers._known.cache_clear()
    path = crossovers._store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=crossovers.__name__):
        (found,) = crossovers.crossovers_for([_weight(32, 64, "int4", 32)], kernels)
    assert "unreadable" in caplog.text
    assert json.loads(path.read_text()) == {
        crossovers.shape_key(_weight(32, 64, "int4", 32), torch.get_num_threads()): {
            "direct_max_rows": found.direct_max_rows,
            "gemm_max_rows": found.gemm_max_rows,
        }
    }
    crossovers._known.cache_clear()


def test_installing_kernels_gives_each_native_product_its_shapes_crossover(
    private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    crossovers._known.cache_clear()
    by_width = {64: RowCrossover(2, 16), 128: RowCrossover(5, 32)}
    monkeypatch.setattr(crossovers, "measure_crossover", lambda weight, kernels: by_width[weight.in_features])
    model = torch.nn.Module()
    model.first = QuantizedLinear(_weight(128, 64, "int4", 32))
    model.second = QuantizedLinear(_weight(64, 128, "int4", 32))
    model.lossy = Int8ActivationsLinear(_weight(64, 128, "int4", 32))

    class Head(torch.nn.Module):  # install_kernels asks whether the head is tied
        weight = torch.zeros(1)

    model.lm_head, model.embed_tokens = Head(), Head()
    monkeypatch.setattr("compiled_engine.linear.install.Product.of", lambda module, compiled, activations: None)
    install_kernels(model, compiled=False)  # type: ignore[arg-type]
    assert model.first.crossover == RowCrossover(2, 16)
    assert model.second.crossover == RowCrossover(5, 32)
    # the int8-activation product keeps its direct range, which is its numerics
    assert model.lossy.crossover == RowCrossover(INT8_DIRECT_MAX_ROWS, 32)
    crossovers._known.cache_clear()
