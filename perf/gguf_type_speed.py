"""The speed of each GGUF block type's product on the CPU: one decoder product's shape (default
SmolLM2's down_proj, [576, 1536]) filled with random blocks of each type, decoded as the loader
decodes them (weights/gguf_blocks.py), and timed through the native operator for 1 and 4
rows of x, beside the dense fp32 product of the same shape in the same run.

    python perf/gguf_type_speed.py [--out 576] [--in 1536] [--calls 400]

Prints, per type: the bytes per weight in the file and in memory, the format it runs as, and
the median microseconds per product with the weight bytes read per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from compiled_engine.linear.quantized import QuantizedLinear
from compiled_engine.weights.gguf import BLOCK_TYPES, TYPE_NAMES
from compiled_engine.weights.gguf_blocks import decode_blocks

# Byte offsets of each type's fp16 fields (set to moderate numbers; random bytes there would be
# NaN now and then).
HALVES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 20: (0,), 10: (80, 82), 11: (108,), 12: (0, 2)}
HALVES |= {13: (0, 2), 14: (208,), 23: (0,)}


def random_blocks(ggml_type: int, rows: int, width: int) -> torch.Tensor:
    weights, nbytes = BLOCK_TYPES[ggml_type]
    rng = np.random.default_rng(ggml_type)
    raw = rng.integers(0, 256, size=(rows, width // weights, nbytes), dtype=np.uint8)
    for start in HALVES[ggml_type]:
        halves = (rng.normal(size=raw.shape[:2]) * 0.01).astype(np.float16)
        raw[..., start : start + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(raw)


def median_us(fn: object, x: torch.Tensor, calls: int) -> float:
    assert callable(fn)
    for _ in range(20):
        fn(x)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=int, default=576)
    parser.add_argument("--in", dest="width", type=int, default=1536)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"[{args.out}, {args.width}] products, {torch.get_num_threads()} threads, median of {args.calls} calls")
    print(f"{'type':8} {'file B/w':>8} {'mem B/w':>8} {'format':>16} {'1 row us':>9} {'GB/s':>6} {'4 rows us':>10}")
    dense = torch.randn(args.out, args.width)
    one, four = (median_us(lambda v: F.linear(v, dense), torch.randn(r, args.width), args.calls) for r in (1, 4))
    print(f"{'F32':8} {4.0:8.3f} {4.0:8.3f} {'dense':>16} {one:9.1f} {dense.numel() * 4 / one / 1e3:6.1f} {four:10.1f}")
    for ggml_type, (weights, nbytes) in BLOCK_TYPES.items():
        weight = decode_blocks(random_blocks(ggml_type, args.out, args.width), ggml_type)
        product = QuantizedLinear(weight)
        kind = f"{weight.format} g{weight.group_size}{' +off' if weight.offsets is not None else ''}"
        one = median_us(product, torch.randn(1, args.width), args.calls)
        four = median_us(product, torch.randn(4, args.width), args.calls)
        memory = weight.nbytes / (args.out * args.width)
        print(
            f"{TYPE_NAMES[ggml_type]:8} {nbytes / weights:8.3f} {memory:8.3f} {kind:>16} {one:9.1f} "
            f"{weight.nbytes / one / 1e3:6.1f} {four:10.1f}"
        )


if __name__ == "__main__":
    main()
