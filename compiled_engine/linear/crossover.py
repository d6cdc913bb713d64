"""Which of the three CPU ways a quantized product takes for a number of rows, measured per
shape on this machine.

- the direct kernel converts each weight in registers for a tile of four rows: the fastest for
  one row or a few, where reading the weight is the cost;
- the many-row kernel dequantizes a strip of the weight once for every row, then runs a
  register-blocked fp32 product: a GEMM from a few rows up (batched decode, verification);
- dequantize-then-oneDNN writes the whole weight once and hands it to the library's GEMM: the
  hundreds of rows of a prompt.

Where one overtakes the next depends on the shape, the CPU, its caches and the thread count, so
it is timed once per shape, machine and thread count, when a model's kernels are installed, and
kept on disk beside the built kernels (a second load reads it). Until a shape is measured
(modules built by hand) it runs `UNMEASURED`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from compiled_engine.cache_paths import kernels_dir
from compiled_engine.linear.quantized_cpu_kernels import QuantKernels
from compiled_engine.linear.quantized_weight import QuantizedWeight
from compiled_engine.native_build import cpu_identity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowCrossover:
    """Up to `direct_max_rows` rows (0: none) the direct kernel; up to `gemm_max_rows` the
    many-row kernel; past it, dequantize-then-oneDNN."""

    direct_max_rows: int
    gemm_max_rows: int

    def way(self, rows: int) -> str:
        """ "direct", "gemm" or "dequantize" for a product of `rows` rows."""
        if rows <= self.direct_max_rows:
            return "direct"
        return "gemm" if rows <= self.gemm_max_rows else "dequantize"


# Before a shape is measured: a middle of what the measurements give (docs/benchmarks.md).
UNMEASURED = RowCrossover(direct_max_rows=4, gemm_max_rows=64)

DIRECT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # where the direct kernel may still lead
GEMM_ROWS = (32, 64, 128, 256, 512)  # where the many-row kernel may still lead oneDNN
SLOW_PROBE_S = 0.05  # a probe slower than this ends the sweep (the head at hundreds of rows)
# The next way takes over only where it is at least this much faster: a tie measured on a busy
# machine keeps the way that reads the weight least.
TAKE_OVER = 0.95


def shape_key(weight: QuantizedWeight, threads: int) -> str:
    """What a measurement depends on besides the machine: the format, the shape, the threads."""
    offsets = "offsets" if weight.offsets is not None else "no-offsets"
    out, width = weight.shape
    return f"{weight.format}/g{weight.group_size}/{offsets}/{out}x{width}/t{threads}"


EVICTION_BYTES = 64 << 20  # more than most CPUs' last-level cache


def _faster(first: Callable[[torch.Tensor], torch.Tensor], second: Callable[[torch.Tensor], torch.Tensor],
            x: torch.Tensor, eviction: torch.Tensor) -> tuple[float, float]:  # fmt: skip
    """The best of a few timings of each, taken in turn (so that a busy moment of the machine
    falls on both rather than on one), after one call each to warm pages and threads; fewer for
    slow calls. Before each timed call the caches are filled with other data (`eviction`, written
    whole): in a model's step a
    product's weight comes from memory, read once, not from the cache a repeated call leaves it in
    (which would favour the many-row kernel's arithmetic over the direct kernel's single read)."""
    started = time.perf_counter()
    first(x), second(x)
    repeats = 3 if time.perf_counter() - started < SLOW_PROBE_S / 2 else 2
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for index, run in enumerate((first, second)):
            eviction.add_(1.0)
            started = time.perf_counter()
            run(x)
            best[index] = min(best[index], time.perf_counter() - started)
    return best[0], best[1]


def measure_crossover(weight: QuantizedWeight, kernels: QuantKernels) -> RowCrossover:
    """Time the three ways on random rows of `weight`'s width and return where each stops
    leading (the first row count at which the next way is clearly faster ends a way's range)."""
    width = weight.in_features

    def direct(x: torch.Tensor) -> torch.Tensor:
        return kernels.matmul_unchecked(x, weight, None)

    def gemm(x: torch.Tensor) -> torch.Tensor:
        return kernels.gemm_unchecked(x, weight, None)

    def dequantize(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, kernels.dequantize_unchecked(weight))

    eviction = torch.zeros(EVICTION_BYTES // 4)  # held only while this shape is measured
    direct_max = 0
    for rows in DIRECT_ROWS:
        direct_s, gemm_s = _faster(direct, gemm, torch.randn(rows, width), eviction)
        if gemm_s < TAKE_OVER * direct_s:
            break
        direct_max = rows
        if direct_s > SLOW_PROBE_S:
            break
    gemm_max = max(direct_max, 1)
    for rows in (rows for rows in GEMM_ROWS if rows > gemm_max):
        gemm_s, dequantize_s = _faster(gemm, dequantize, torch.randn(rows, width), eviction)
        if dequantize_s < TAKE_OVER * gemm_s:
            break
        gemm_max = rows
        if gemm_s > SLOW_PROBE_S:
            gemm_max = GEMM_ROWS[-1]  # still leading where probing stops costing little
            break
    return RowCrossover(direct_max, gemm_max)


def _store_path() -> Path:
    machine = hashlib.sha256(cpu_identity().encode()).hexdigest()[:16]
    return kernels_dir() / f"row-crossovers-{machine}.json"


def _read_store(path: Path) -> dict[str, RowCrossover]:
    try:
        entries = json.loads(path.read_text())
        return {key: RowCrossover(**value) for key, value in entries.items()}
    except (OSError, ValueError, TypeError) as error:
        if path.exists():
            logger.warning("row crossovers in %s are unreadable (%s): measuring again", path, error)
        return {}


def _write_store(path: Path, measured: dict[str, RowCrossover]) -> None:
    """Merge `measured` into the file, replacing it whole (concurrent loads each leave a complete file)."""
    entries = _read_store(path) | measured
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
    with os.fdopen(handle, "w") as file:
        json.dump({key: asdict(value) for key, value in sorted(entries.items())}, file, indent=1)
    os.replace(partial, path)


@cache
def _known() -> dict[str, RowCrossover]:
    return _read_store(_store_path())


def crossovers_for(weights: list[QuantizedWeight], kernels: QuantKernels) -> list[RowCrossover]:
    """Each weight's crossover at the current thread count: from this process's memory, the
    file on disk, or measured now (and saved)."""
    threads = torch.get_num_threads()
    known, measured = _known(), {}
    for weight in weights:
        key = shape_key(weight, threads)
        if key not in known and key not in measured:
            started = time.perf_counter()
            measured[key] = measure_crossover(weight, kernels)
            logger.debug("row crossover of %s: %s (%.2f s)", key, measured[key], time.perf_counter() - started)
    if measured:
        known.update(measured)
        logger.info(
            "quantized products change kernels at (direct up to, many-row up to) rows, measured: %s",
            ", ".join(f"{key} {value.direct_max_rows}/{value.gemm_max_rows}" for key, value in measured.items()),
        )
        try:
            _write_store(_store_path(), measured)
        except OSError as error:
            logger.warning("row crossovers not saved (%s): the next load measures again", error)
    return [known[shape_key(weight, threads)] for weight in weights]
