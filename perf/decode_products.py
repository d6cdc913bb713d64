"""The layer products of one decode step of the default model (30 layers of qkv [960, 576],
o [576, 576], gate_up [3072, 576] and down [576, 1536]) in one GGUF block type's engine format,
through the native operator, for 1, 2, 4 and 8 rows of x: the cost of a step and of verifying a
speculative draft of 1-7 tokens. Random blocks, as perf/gguf_type_speed.py makes them.

    python perf/decode_products.py [--type Q4_1] [--steps 30] [--activations int8]

Prints, per row count, the median milliseconds a step's products take, the weight bytes read per
second, the multiply-adds per second, and the time as a multiple of one row's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gguf_type_speed import random_blocks

from compiled_engine.linear.quantized import Int8ActivationsLinear, QuantizedLinear
from compiled_engine.weights.gguf import TYPE_NAMES
from compiled_engine.weights.gguf_blocks import decode_blocks

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of qkv, o, gate_up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--type", default="Q4_1", choices=sorted(TYPE_NAMES.values()))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--activations", default="fp32", choices=("fp32", "int8"), help="as --cpu-activations")
    args = parser.parse_args()
    ggml_type = next(number for number, name in TYPE_NAMES.items() if name == args.type)
    kind = Int8ActivationsLinear.from_held if args.activations == "int8" else (lambda held: held)
    products = [
        kind(QuantizedLinear(decode_blocks(random_blocks(ggml_type, out, width), ggml_type)))
        for _ in range(args.layers)
        for out, width in LAYER_SHAPES
    ]
    first = products[0].weight
    weight_bytes = sum(p.weight.nbytes for p in products)
    multiply_adds = args.layers * sum(out * width for out, width in LAYER_SHAPES)
    print(
        f"{args.type} as {first.format} g{first.group_size}{' +offsets' if first.offsets is not None else ''}, "
        f"{args.activations} activations ({type(products[0]).__name__}): "
        f"{len(products)} products, {weight_bytes / 1e6:.1f} MB, {torch.get_num_threads()} threads, "
        f"median of {args.steps} steps"
    )
    print(f"{'rows':>4} {'ms/step':>8} {'GB/s':>6} {'GFLOP/s':>8} {'x one row':>9}")
    one_row = None
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 1536)
        inputs = {width: x[:, :width].contiguous() for _, width in LAYER_SHAPES}
        times = []
        for step in range(args.steps + 3):
            started = time.perf_counter()
            for product, (_, width) in zip(products, LAYER_SHAPES * args.layers, strict=True):
                product(inputs[width])
            if step >= 3:  # warm-up
                times.append(time.perf_counter() - started)
        median = statistics.median(times)
        one_row = one_row or median
        print(
            f"{rows:4d} {median * 1e3:8.3f} {weight_bytes / median / 1e9:6.1f} "
            f"{2 * rows * multiply_adds / median / 1e9:8.1f} {median / one_row:9.2f}"
        )


if __name__ == "__main__":
    main()
