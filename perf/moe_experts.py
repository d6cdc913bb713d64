"""The grouped experts operator on one layer of a real MoE shape: time a call at 1-64 tokens,
the bytes of the experts it reads (the chosen ones only), and the GB/s that makes, beside the
dense twin's loop and one quantized product of the same bytes as a floor.

    python perf/moe_experts.py --experts 32 --top-k 8 --hidden 1024 --inter 512 --format int4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from compiled_engine.linear.quantize import quantize
from compiled_engine.linear.quantized_experts import QuantizedExperts


def _time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--format", default="int4", choices=["int4", "int8"])
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument(
        "--layers", type=int, default=8, help="distinct layers cycled through, so weights come from memory"
    )
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    e, h, inter, k = args.experts, args.hidden, args.inter, args.top_k
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        gate_up = torch.randn(e * 2 * inter, h, generator=g) * 0.05
        down = torch.randn(e * h, inter, generator=g) * 0.05
        layers.append(
            QuantizedExperts(
                quantize(gate_up, args.format, args.group), quantize(down, args.format, args.group), e, "silu"
            )
        )
    per_expert = (layers[0].gate_up.nbytes + layers[0].down.nbytes) / e
    print(
        f"{e} experts, top {k}, hidden {h}, expert width {inter}, {args.format} g{args.group}: {per_expert / 1e6:.2f} MB an expert"
    )
    print(f"{'tokens':>6} {'experts read':>12} {'ms a layer':>10} {'MB read':>8} {'GB/s':>6}")
    for tokens in (1, 2, 4, 8, 16, 32, 64):
        x = torch.randn(tokens, h, generator=g)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k, generator=g)
        read = len(ids.unique())
        turn = iter(range(10**9))
        seconds = _time(lambda t=turn, x=x, w=weights, i=ids: layers[next(t) % len(layers)](x, w, i), args.repeats)
        mb = read * per_expert / 1e6
        print(f"{tokens:>6} {read:>12} {seconds * 1e3:>10.3f} {mb:>8.2f} {mb / 1e3 / seconds:>6.1f}")


if __name__ == "__main__":
    main()
