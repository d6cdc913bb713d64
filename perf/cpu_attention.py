"""Decode attention on the CPU: the cpu backend's native kernel against the torch backend's
gather + SDPA, per layer call, for a few batch shapes. Each layer has its own cache (as in the
engine), so the K/V come from memory rather than a warm cache unless they all fit in it.

    .venv/bin/python perf/cpu_attention.py
    .venv/bin/python perf/cpu_attention.py --heads 32 --kv-heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from compiled_engine.attention.backend import AttentionBackend
from compiled_engine.attention.cpu_backend import CpuAttentionBackend
from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.attention.native_decode import load_native_decode
from compiled_engine.attention.torch_backend import TorchAttentionBackend


def per_call_us(
    backend: AttentionBackend[Any],
    metadata: AttentionMetadata,
    caches: list[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rounds: int,
) -> float:
    """Per layer call, with the plan prepared once per forward (as the runner does) and counted."""
    scale = q.shape[-1] ** -0.5
    plan = backend.prepare(metadata, caches[0])
    for cache in caches:  # warm-up: first-touch
        backend.forward(q, k, v, cache, plan, scale)
    started = time.perf_counter()
    for _ in range(rounds):
        plan = backend.prepare(metadata, caches[0])
        for cache in caches:
            backend.forward(q, k, v, cache, plan, scale)
    return (time.perf_counter() - started) / (rounds * len(caches)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--shapes", default="1x512,1x2048,8x300,32x300,32x1000", help="sequences x context, comma-separated"
    )
    args = parser.parse_args()
    native = CpuAttentionBackend(load_native_decode(), args.heads)
    reference = TorchAttentionBackend()
    rng = random.Random(0)
    print(
        f"threads {torch.get_num_threads()}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, {args.layers} layers"
    )
    print(f"{'batch':>10} {'torch us':>10} {'cpu us':>10} {'speed-up':>9}")
    for shape in args.shapes.split(","):
        seqs, context = (int(x) for x in shape.split("x"))
        pages_per_seq = -(-context // args.page_size)
        num_pages = seqs * pages_per_seq + 1
        order = list(range(num_pages))
        rng.shuffle(order)
        tables = [order[i * pages_per_seq : (i + 1) * pages_per_seq] for i in range(seqs)]
        caches = [torch.randn(num_pages, 2, args.page_size, args.kv_heads, args.head_dim) for _ in range(args.layers)]
        q = torch.randn(seqs, args.heads, args.head_dim)
        k = torch.randn(seqs, args.kv_heads, args.head_dim)
        v = torch.randn(seqs, args.kv_heads, args.head_dim)
        times = []
        for backend in (reference, native):
            metadata = AttentionMetadata.build(
                [1] * seqs, [context] * seqs, tables, args.page_size, torch.device("cpu")
            )
            times.append(per_call_us(backend, metadata, caches, q, k, v, args.rounds))
        print(f"{shape:>10} {times[0]:>10.1f} {times[1]:>10.1f} {times[0] / times[1]:>8.2f}x")


if __name__ == "__main__":
    main()
