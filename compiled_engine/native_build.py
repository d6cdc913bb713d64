"""Building the engine's C kernels with the machine's compiler (the one Inductor already needs on
CPU), cached under the engine cache and loaded through ctypes.

A library is keyed by its source, the compiler's identity and the CPU's feature flags (kernels
are built with `-march=native`), so a cache copied to another machine rebuilds rather than runs
instructions that CPU lacks. Libraries link OpenMP as `libgomp.so.1`, the name of the runtime
PyTorch has already loaded, so they share one thread pool. Each builds in well under a second.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from compiled_engine.cache_paths import kernels_dir

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
OPENMP = ("-fopenmp",)
# After the source: with --as-needed (many distributions' default) a library named before the
# object that uses it is dropped. libm for the kernels' tanhf and friends.
LIBS = ("-lm",)
CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared")  # operator libraries: kernels live there too


class KernelBuildError(RuntimeError):
    """The C compiler is missing or failed, or the library cannot be loaded; the message says
    which and why."""


def compiler() -> str:
    name = os.environ.get("CC", "cc")
    path = shutil.which(name)
    if path is None:
        raise KernelBuildError(f"no C compiler: {name!r} is not on PATH (set CC to one)")
    return path


def cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


@dataclass(frozen=True)
class NativeLibrary:
    """One C source built into a shared library; `what` names it in messages."""

    source: Path
    what: str
    include_dirs: tuple[str, ...] = ()  # beyond the compiler's own (for example Python's headers)
    # After FLAGS, so they can take back what -march=native gives: the tests build the kernels'
    # other instruction-set paths this way (for example "-mno-avx2").
    extra_flags: tuple[str, ...] = ()

    def path(self) -> Path:
        """Where the library for this source, compiler and CPU lives (built there if missing)."""
        cc = compiler()
        flags = " ".join(FLAGS + self.extra_flags + OPENMP + LIBS + tuple(f"-I{d}" for d in self.include_dirs))
        path = _cached_path(self.source.stem, [self.source.read_text(), cc, _version(cc), flags])
        if not path.exists():
            self.build(cc, path)
        return path

    def build(self, cc: str, output: Path) -> None:
        """Compile the source into `output` (atomically: concurrent builders each rename a whole file)."""
        output.parent.mkdir(parents=True, exist_ok=True)
        errors = []
        for extra in (OPENMP, ()):  # without OpenMP (for example Apple clang) the kernel runs on one thread
            with tempfile.NamedTemporaryFile(dir=output.parent, suffix=".so", delete=False) as tmp:
                partial = Path(tmp.name)
            includes = [f"-I{d}" for d in self.include_dirs]
            command = [cc, *FLAGS, *self.extra_flags, *extra, *includes, "-o", str(partial), str(self.source), *LIBS]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode == 0:
                partial.replace(output)
                if not extra:
                    logger.warning("%s built without OpenMP: it runs on one thread", self.what)
                return
            partial.unlink(missing_ok=True)
            errors.append(f"$ {' '.join(command)}\n{done.stderr.strip()[-2000:]}")
        raise KernelBuildError(f"building the {self.what} failed:\n" + "\n".join(errors))

    def load(self) -> ctypes.CDLL:
        """Build (once per machine) and load; raises KernelBuildError when it cannot."""
        try:
            return ctypes.CDLL(str(self.path()))
        except OSError as error:  # an unwritable cache, a library the loader refuses
            raise KernelBuildError(f"building or loading the {self.what} failed: {error}") from error


@dataclass(frozen=True)
class TorchOperatorLibrary:
    """A native torch operator: a C++ source registering the operator (TORCH_LIBRARY) linked with
    a C kernel source, against the running torch's headers and libraries. Keyed like
    NativeLibrary, plus torch's version and C++ ABI; loaded with torch.ops.load_library."""

    cpp_source: Path
    c_source: Path | None  # None: the operator is C++ alone
    what: str

    def path(self) -> Path:
        import torch

        cc, cxx = compiler(), _cxx_compiler()
        c_text = self.c_source.read_text() if self.c_source is not None else ""
        parts = [self.cpp_source.read_text(), c_text, cc, cxx, _version(cc), _version(cxx), " ".join(CXX_FLAGS)]
        parts += [torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), " ".join(_torch_includes())]
        path = _cached_path(self.cpp_source.stem, parts)
        if not path.exists():
            self.build(cc, cxx, path)
        return path

    def build(self, cc: str, cxx: str, output: Path) -> None:
        import torch

        output.parent.mkdir(parents=True, exist_ok=True)
        torch_lib = str(Path(torch.__file__).parent / "lib")
        with tempfile.TemporaryDirectory(dir=output.parent) as scratch:
            kernel = Path(scratch) / "kernels.o"
            partial = Path(scratch) / output.name
            abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
            objects = [str(kernel)] if self.c_source is not None else []
            commands = [
                [
                    cxx, *CXX_FLAGS, abi,
                    *(f"-I{p}" for p in _torch_includes()),
                    str(self.cpp_source), *objects, "-o", str(partial),
                    f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu", *OPENMP,
                ],
            ]  # fmt: skip
            if self.c_source is not None:
                commands.insert(
                    0, [cc, "-O3", "-march=native", "-fPIC", *OPENMP, "-c", str(self.c_source), "-o", str(kernel)]
                )
            for command in commands:
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise KernelBuildError(
                        f"building the {self.what} failed:\n$ {' '.join(command)}\n{done.stderr.strip()[-2000:]}"
                    )
            partial.replace(output)

    def load(self) -> None:
        """Build (once per machine) and register the operator; raises KernelBuildError when it cannot."""
        import torch

        try:
            torch.ops.load_library(str(self.path()))
        except OSError as error:
            raise KernelBuildError(f"building or loading the {self.what} failed: {error}") from error


def _cached_path(stem: str, parts: list[str]) -> Path:
    """The cache path of a library built from `parts` (sources, compilers, flags) on this CPU."""
    key = hashlib.sha256("\0".join([*parts, cpu_identity()]).encode()).hexdigest()[:16]
    return kernels_dir() / f"{stem}-{key}.so"


def _version(compiler_path: str) -> str:
    return subprocess.run([compiler_path, "--version"], capture_output=True, text=True, check=False).stdout


def _torch_includes() -> list[str]:
    """torch's C++ headers (what torch.utils.cpp_extension.include_paths() gives for CPU builds,
    without importing that module, which costs about 0.2 s at every start)."""
    import torch

    include = Path(torch.__file__).parent / "include"
    return [str(include), str(include / "torch" / "csrc" / "api" / "include")]


def _cxx_compiler() -> str:
    name = os.environ.get("CXX", "c++")
    path = shutil.which(name)
    if path is None:
        raise KernelBuildError(f"no C++ compiler: {name!r} is not on PATH (set CXX to one)")
    return path
