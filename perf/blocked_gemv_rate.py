"""Time the native product over blocked fp32 weights (linear/kernels/blocked_gemv.c) on one decode
step's layer products of the default model (30 x qkv, o, gate_up, down), from memory.

    python perf/blocked_gemv_rate.py [--rows 1] [--width 64] [--library PATH_TO_AN_OPERATOR.so]

Without --library it times this checkout's build; with it, another build of the operator (say,
an older commit's, from the kernel cache), so that two versions are compared in separate runs.
Prints the median and the fastest of 20 steps, and the bandwidth the median reaches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--width", type=int, default=64, help="block width of the blocked weights")
    parser.add_argument("--library", default=None, help="an operator library to load instead of this build")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if args.library:
        torch.ops.load_library(args.library)
    else:
        from compiled_engine.linear.packed_cpu import blocked_gemv_operator

        if blocked_gemv_operator() is None:
            raise SystemExit("the native kernel cannot be built here")
    op = torch.ops.compiled_engine.blocked_gemv_f32.default
    torch.set_num_threads(args.threads)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    weights = [
        torch.randn(out, inp).view(out // args.width, args.width, inp).transpose(1, 2).contiguous()
        for out, inp in shapes
    ]
    xs = {inp: torch.randn(args.rows, inp) for inp in (576, 1536)}

    def step() -> None:
        for weight in weights:
            op(xs[weight.shape[1]], weight, None)

    for _ in range(3):
        step()
    times = []
    for _ in range(20):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    nbytes = sum(w.numel() * 4 for w in weights)
    print(
        f"rows {args.rows}, width {args.width}: median {median * 1e3:.2f} ms, fastest {min(times) * 1e3:.2f} ms "
        f"({nbytes / median / 1e9:.1f} GB/s over {nbytes / 2**20:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
