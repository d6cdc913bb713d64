"""Batch-1 decode of the default model, compiled, with the frame-stack arena cache
(compiled_engine/executor/frame_arena.py) on and off, at chosen extra Python stack depths: whether
a step maps and unmaps the interpreter's 16 KiB frame-stack chunks depends on the depth it runs
at.

    .venv/bin/python perf/frame_arena.py --sweep               # chunks a step, depth by depth
    .venv/bin/python perf/frame_arena.py --depths 0,124,136    # ms a step, cache on and off

One process, one request (a 512-token prompt, then decode). The sweep counts the frame-stack
chunks a step takes from the arena allocator at each extra depth: without the cache each is an
mmap and a munmap. The timed mode alternates blocks of `--steps` decode steps with the cache on
and off at each depth, `--rounds` times, and prints the median step of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def at_depth(depth: int, call: Callable[[], T]) -> T:
    """`call()` from `depth` extra Python frames down."""
    return call() if depth == 0 else at_depth(depth - 1, call)


def decoding_engine() -> Any:
    from compiled_engine.config import EngineConfig
    from compiled_engine.engine.llm_engine import LLMEngine
    from compiled_engine.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(enable_prefix_caching=False, max_num_seqs=1))
    engine.add_request(list(range(10, 522)), SamplingParams(temperature=0, max_tokens=7_000, ignore_eos=True))
    for _ in range(8):  # the prompt, and the first decode steps (compile)
        engine.step()
    return engine


def chunks_a_step(engine: Any, steps: int) -> float:
    from compiled_engine.executor.frame_arena import frame_arena_counts

    before = frame_arena_counts()
    for _ in range(steps):
        engine.step()
    after = frame_arena_counts()
    assert before is not None and after is not None, "the cache is not installed"
    return (after.reused + after.passed - before.reused - before.passed) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="count frame-stack chunks a step at each depth")
    parser.add_argument("--last-depth", type=int, default=560)
    parser.add_argument("--stride", type=int, default=4)
    parser.add_argument("--depths", default="0", help="extra stack depths to time, comma-separated")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per block")
    parser.add_argument("--rounds", type=int, default=6, help="blocks per setting and depth, alternated")
    args = parser.parse_args()
    from compiled_engine.executor.frame_arena import set_frame_arena_enabled

    sys.setrecursionlimit(10_000)
    engine = decoding_engine()
    if args.sweep:
        counts = {d: at_depth(d, lambda: chunks_a_step(engine, 2)) for d in range(0, args.last_depth + 1, args.stride)}
        print(" ".join(f"{depth}:{count:.0f}" for depth, count in counts.items()))
        busy = sum(1 for count in counts.values() if count > 2)
        print(f"{busy} of {len(counts)} depths take more than 2 chunks a step; most: {max(counts.values()):.0f}")
        return

    def timed_block() -> float:
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        return (time.perf_counter() - started) / args.steps * 1000

    for depth in (int(d) for d in args.depths.split(",")):
        chunks = at_depth(depth, lambda: chunks_a_step(engine, 2))
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for enabled in (True, False):
                set_frame_arena_enabled(enabled)
                times[enabled].append(at_depth(depth, timed_block))
        set_frame_arena_enabled(True)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(
            f"depth {depth:>4}: {chunks:4.0f} chunks a step; cache on {on:.2f} ms a step, off {off:.2f} "
            f"({off - on:+.2f} ms without it)"
        )


if __name__ == "__main__":
    main()
