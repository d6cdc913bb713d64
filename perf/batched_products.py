"""Batched decode's layer products against the multiply-add roof: a step's products (the default
model's 30 layers of qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536], or the
shapes given) in one GGUF block type, for 1-64 rows, by each of the three CPU ways and by the way
the measured crossover picks.

    python perf/batched_products.py [--type Q4_1] [--rows 1,2,4,8,16,32,64] [--shapes 960x576,...]

The roof is what the machine's own fp32 GEMM reaches (oneDNN, a 2048-cube product, same threads);
the weight bytes of one pass set the memory side. Prints, per row count, milliseconds a step for
direct / many-row (gemm) / dequantize-then-oneDNN / picked, the picked way's GFLOP/s and share of
the roof, the roof's own milliseconds, and the picked time as a multiple of one row's; then each
shape's measured crossover.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf_type_speed import random_blocks

from compiled_engine.linear.crossover import measure_crossover
from compiled_engine.linear.quantized import QuantizedLinear
from compiled_engine.linear.quantized_cpu_kernels import load_quant_kernels
from compiled_engine.linear.quantized_weight import QuantizedWeight
from compiled_engine.weights.gguf import TYPE_NAMES
from compiled_engine.weights.gguf_blocks import decode_blocks

DEFAULT_SHAPES = "960x576,576x576,3072x576,576x1536"  # (out x in) of qkv, o, gate_up, down


def gemm_roof_flops(seconds: float = 1.0) -> float:
    """FLOP/s of a large fp32 GEMM at the current thread count: the practical multiply-add roof."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(a, b)
        calls += 1
    return 2 * 2048**3 * calls / (time.perf_counter() - started)


def step_ms(run: Callable[[torch.Tensor, QuantizedLinear], torch.Tensor], products: list[QuantizedLinear],
            rows: int, steps: int) -> float:  # fmt: skip
    inputs = {p.in_features: torch.randn(rows, p.in_features) for p in products}
    times = []
    for step in range(steps + 2):
        started = time.perf_counter()
        for product in products:
            run(inputs[product.in_features], product)
        if step >= 2:  # warm-up
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--type", default="Q4_1", choices=sorted(TYPE_NAMES.values()))
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated OUTxIN of one layer's products")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    args = parser.parse_args()
    ggml_type = next(number for number, name in TYPE_NAMES.items() if name == args.type)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    kernels = load_quant_kernels()
    layer: list[QuantizedWeight] = [
        decode_blocks(random_blocks(ggml_type, out, width), ggml_type) for out, width in shapes
    ]
    crossovers = {weight.shape: measure_crossover(weight, kernels) for weight in layer}
    products = []
    for _ in range(args.layers):  # each layer its own copy: a step reads every layer's weights from memory
        for weight in layer:
            product = QuantizedLinear(QuantizedWeight.of_tensors(weight.data.clone(), weight.scales.clone(),
                                      None if weight.offsets is None else weight.offsets.clone(), weight.group_size))  # fmt: skip
            product.crossover = crossovers[weight.shape]
            products.append(product)
    roof = gemm_roof_flops()
    weight_bytes = sum(p.weight.nbytes for p in products)
    multiply_adds = args.layers * sum(out * width for out, width in shapes)
    first = layer[0]
    print(
        f"{args.type} as {first.format} g{first.group_size}{' +offsets' if first.offsets is not None else ''}, "
        f"{len(products)} products, {weight_bytes / 1e6:.1f} MB, {torch.get_num_threads()} threads, "
        f"median of {args.steps} steps; roof: fp32 GEMM at {roof / 1e9:.1f} GFLOP/s"
    )
    ways: dict[str, Callable[[torch.Tensor, QuantizedLinear], torch.Tensor]] = {
        "direct": lambda x, p: kernels.matmul_unchecked(x, p.weight, None),
        "gemm": lambda x, p: kernels.gemm_unchecked(x, p.weight, None),
        "deq+oneDNN": lambda x, p: F.linear(x, kernels.dequantize_unchecked(p.weight)),
        "picked": lambda x, p: p(x),
    }
    print(f"{'rows':>4} " + " ".join(f"{name:>10}" for name in ways) + f" {'GFLOP/s':>8} {'of roof':>7} "
          f"{'roof ms':>7} {'x 1 row':>7}")  # fmt: skip
    one_row = None
    for rows in (int(r) for r in args.rows.split(",")):
        times = {name: step_ms(run, products, rows, args.steps) for name, run in ways.items()}
        picked = times["picked"]
        one_row = one_row or picked
        flops = 2 * rows * multiply_adds
        print(
            f"{rows:4d} " + " ".join(f"{times[name]:10.2f}" for name in ways)
            + f" {flops / picked / 1e6:8.1f} {flops / (picked / 1e3) / roof:7.0%} {flops / roof * 1e3:7.2f} {picked / one_row:7.2f}"
        )  # fmt: skip
    for (out, width), crossover in crossovers.items():
        print(
            f"[{out}, {width}]: direct up to {crossover.direct_max_rows} rows, many-row kernel up to "
            f"{crossover.gemm_max_rows}, dequantize-then-oneDNN past it"
        )


if __name__ == "__main__":
    main()
