"""quant_matmul.c's instruction-set paths: the engine builds it with -march=native, so a machine
runs only the path its CPU selects, and the others (the portable one without AVX2, the AVX2 one
without AVX-512, the AVX-512 one) never run there. Each is built here with flags that select it
(checked against the macros the source tests), and each this CPU can run is loaded and held to
dequantize-then-F.linear on the blocks the other kernel tests use (tests/test_quantization.py,
tests/test_gguf_kquants.py); the others are only compiled."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import subprocess
from functools import cache
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from compiled_engine.linear import quantized_cpu_kernels as cpu_kernels
from compiled_engine.linear import quantized_op as ops
from compiled_engine.linear.quantized_weight import QuantizedWeight, dequantize_rows
from compiled_engine.native_build import FLAGS, KernelBuildError, compiler
from tests.test_gguf_kquants import TYPES, fixture_weight
from tests.test_quantization import FORMATS, Q8X_FORMATS, _q8x_weight, _weight


class PathFlags(NamedTuple):
    flags: tuple[str, ...]  # after -march=native
    defined: frozenset[str]  # the source's macros that must be set, and those that must not
    undefined: frozenset[str]
    cpu_flags: frozenset[str]  # what /proc/cpuinfo must list for the build to run here


AVX2, AVX512 = "__AVX2__", "__AVX512F__"
PATHS = {
    "portable": PathFlags(
        ("-mno-avx2", "-mno-fma", "-mno-avx512f"), frozenset(), frozenset({AVX2, AVX512}), frozenset()
    ),
    "avx2": PathFlags(
        ("-mavx2", "-mfma", "-mno-avx512f"), frozenset({AVX2}), frozenset({AVX512}), frozenset({"avx2", "fma"})
    ),
    "avx512": PathFlags(
        ("-mavx2", "-mfma", "-mavx512f"),
        frozenset({AVX2, AVX512}),
        frozenset(),
        frozenset({"avx2", "fma", "avx512f"}),
    ),
}

# The portable path runs nowhere else: the quick tier builds it; the instruction-set builds (the
# native build already runs one of them on most machines) are the full tier's.
PATH_NAMES = [pytest.param(name, marks=() if name == "portable" else pytest.mark.full) for name in sorted(PATHS)]

pytestmark = [
    pytest.mark.skipif(
        platform.machine().lower() not in ("x86_64", "amd64"), reason="the kernel's paths are x86 instruction sets"
    ),
    pytest.mark.usefixtures("one_thread"),
]


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def _macros(flags: tuple[str, ...]) -> set[str]:
    """The macros the compiler defines under the engine's flags and `flags`; skips the test when
    it does not take them."""
    command = [compiler(), *FLAGS, *flags, "-dM", "-E", "-x", "c", os.devnull]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"the compiler does not take {' '.join(flags)}: {done.stderr.strip()[-300:]}")
    return {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}


@cache
def _built(name: str, directory: Path) -> Path:
    """quant_matmul.c built for path `name` into `directory` (once per test session)."""
    output = directory / f"quant_matmul-{name}.so"
    library = dataclasses.replace(cpu_kernels.LIBRARY, extra_flags=PATHS[name].flags)
    library.build(compiler(), output)
    return output


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quant-kernel-paths")


@pytest.mark.parametrize("name", PATH_NAMES)
def test_each_path_builds_with_the_macros_that_select_it(name: str, build_dir: Path) -> None:
    path = PATHS[name]
    macros = _macros(path.flags)
    assert path.defined <= macros, f"{name}: {sorted(path.defined - macros)} not defined"
    assert not path.undefined & macros, f"{name}: {sorted(path.undefined & macros)} defined"
    try:
        built = _built(name, build_dir)
    except KernelBuildError as error:
        pytest.fail(f"quant_matmul.c does not build for its {name} path: {error}")
    assert built.stat().st_size > 0


def _kernels(name: str, build_dir: Path) -> tuple[cpu_kernels.QuantKernels, ctypes.CDLL]:
    missing = PATHS[name].cpu_flags - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))}: the {name} path is only built here")
    _macros(PATHS[name].flags)  # skips where the compiler does not take the flags
    library = ctypes.CDLL(str(_built(name, build_dir)))
    return cpu_kernels.bind_quant_kernels(library), library


def _assert_products_match(kernels: cpu_kernels.QuantKernels, weight: QuantizedWeight, rows: int, what: str) -> None:
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(weight.out_features, generator=torch.Generator().manual_seed(rows + 100))
    dense = weight.dequantize()
    want = F.linear(x, dense, bias)
    scale = want.abs().max()
    got = kernels.matmul(x, weight, bias)
    assert (got - want).abs().max() <= 1e-5 * scale, f"{what}, {rows} rows"
    assert (kernels.matmul(x, weight, None) - (want - bias)).abs().max() <= 1e-5 * scale, f"{what}, {rows} rows"
    many = kernels.gemm_unchecked(x, weight, bias)  # the many-row kernel, from one row up
    assert (many - want).abs().max() <= 1e-5 * scale, f"{what}, {rows} rows, many-row kernel"


@pytest.mark.parametrize("name", PATH_NAMES)
def test_each_path_this_cpu_runs_matches_dequantize_then_f_linear(name: str, build_dir: Path) -> None:
    """Products of 1 to 5 rows (the row tiles of 4 and a remainder) and of 13 (the many-row
    kernel's tiles and a remainder), and the dequantization, on the random weights of each
    (format, group) and on llama.cpp's blocks of every GGUF type."""
    kernels, _ = _kernels(name, build_dir)
    weights = [(f"{fmt} group {group}", _weight(53, 384, fmt, group, seed=7)) for fmt, group in FORMATS]
    weights += [(qtype.name, fixture_weight(qtype)) for qtype in TYPES]
    for what, weight in weights:
        assert torch.equal(kernels.dequantize(weight), dequantize_rows(weight, None)), what
        for rows in (1, 2, 3, 4, 5, 13):
            _assert_products_match(kernels, weight, rows, what)


@pytest.mark.parametrize("name", PATH_NAMES)
def test_each_path_this_cpu_runs_gives_the_int8_activation_products_of_their_twin(name: str, build_dir: Path) -> None:
    """`quant_matmul_q8x_f32` (block dot products in integers: AVX2's byte multiplies, or the
    portable scalar loop) against its torch twin, as tests/test_quantization.py holds the engine's
    build to it."""
    _, library = _kernels(name, build_dir)
    function = library.quant_matmul_q8x_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int]
    function.restype = ctypes.c_int
    for fmt, group, offsets in Q8X_FORMATS:
        for rows in (1, 3, 5):
            weight = _q8x_weight(53, 384, fmt, group, offsets, seed=rows)
            x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(rows))
            x[0, :32] = 0.0  # an all-zero block: scale 0
            bias = torch.randn(53)
            y = torch.empty(rows, 53)
            status = function(
                x.data_ptr(), rows, 384, weight.data.data_ptr(), int(fmt == "int4"), weight.scales.data_ptr(),
                None if weight.offsets is None else weight.offsets.data_ptr(), 53, group, bias.data_ptr(),
                y.data_ptr(), 1,
            )  # fmt: skip
            assert status == 0
            args = (x, weight, bias)
            torch.testing.assert_close(y, ops.int8_activations_reference(*args), rtol=1e-5, atol=1e-4)
