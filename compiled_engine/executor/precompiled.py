"""Compiled entries whose Dynamo trace is saved at the first start and loaded at the next ones.

Inductor's caches keep the generated kernels between starts, but Dynamo still traces every
compiled function at every start (for the one-token forward, through all the layers), and that
is most of a warm start's compile phase (docs/benchmarks.md). `PrecompiledFunction` compiles its
function ahead of time with torch's `aot_compile` at its first call, saves the result (the traced
bytecode, the guards and Inductor's compiled graph) in a directory keyed by everything the trace
depends on (`artifact_dir`), and at later starts loads it instead of tracing.

What runs is always checked: a call evaluates the saved guards (input shapes, dtypes, the
model's constants) on its arguments, and a call they refuse runs the same function through plain
`torch.compile` instead, which traces it as before. The guards are evaluated once per call
signature (`call_signature`: the same module objects, tensors of the same dtype, device, shape and
strides, the same grad and inference modes and thread count): on a decode step they read every
weight tensor's metadata, cold in the caches after the weights streamed through, and cost about
1 ms a step (docs/benchmarks.md). What else they check, the model's own tensors and constants,
does not change while the engine serves (adapters are written into their slots in place). A file
that does not load (another torch, a damaged file) is compiled again and replaced, with a log
line saying why. With no directory the entry is plain `torch.compile`: the slow twin the saved
path is tested against.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
from torch import nn

logger = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parents[1]
_SOURCE_SUFFIXES = (".py", ".c", ".cpp", ".h")


@functools.cache
def _source_digest() -> str:
    """One hash of the package's own code: a trace is only as valid as the code it traced. Read
    once per process: the code that runs is the code imported, whatever changes on disk later."""
    digest = hashlib.sha256()
    for path in sorted(p for p in _PACKAGE.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
        digest.update(str(path.relative_to(_PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def model_signature(model: nn.Module) -> list[str]:
    """The model's structure as the trace sees it: each module's class, and each parameter's and
    buffer's name, shape and dtype (not its values: weights are graph inputs)."""
    parts = [f"{name}:{type(module).__qualname__}" for name, module in model.named_modules()]
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        parts.append(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.device.type}")
    return parts


def artifact_dir(root: Path, parts: Iterable[str]) -> Path:
    """The directory of one model's saved entries under `root`, keyed by `parts` (the model's
    signature and configuration), the package's code, torch's and Python's versions and the CPU
    (the generated kernels are built for its instruction set)."""
    from compiled_engine.native_build import cpu_identity

    digest = hashlib.sha256()
    for part in (torch.__version__, sys.version, cpu_identity(), _source_digest(), *parts):
        digest.update(part.encode())
        digest.update(b"\0")
    return root / digest.hexdigest()[:32]


# While a saved entry loads, Inductor finds its kernels already built in its cache (an entry is
# saved after its kernels built and ran on this CPU: the directory's key includes it), but it
# would still test-build a library for the vector instruction set and load it in a new Python
# (half a second) before using them. That check does not enter the kernels' cache keys, so it is
# skipped while loading.
_LOADING_OPTIONS = {"cpp.vec_isa_ok": True}

DynamicDims = tuple[tuple[int, int], ...]  # (argument index, dimension) pairs that vary between calls


MAX_CHECKED_SIGNATURES = 4096


def call_signature(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What a call's guards depend on that can differ from call to call: each tensor argument's
    dtype, device, shape, strides, grad and inference flags; each module argument itself (alive
    as long as the entry's model); every other argument's value; and the global state Dynamo
    guards (grad and inference modes, the default dtype, the thread count). None when an argument
    has no hashable value: such calls are always checked."""
    parts: list[Any] = [
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.get_default_dtype(),
        torch.get_num_threads(),
    ]
    for arg in args:
        if isinstance(arg, torch.Tensor):
            parts.append((arg.dtype, arg.device, arg.shape, arg.stride(), arg.requires_grad, arg.is_inference()))
        elif isinstance(arg, nn.Module):
            parts.append(id(arg))
        else:
            parts.append((type(arg), arg))
    signature = tuple(parts)
    try:
        hash(signature)
    except TypeError:
        return None
    return signature


class PrecompiledFunction:
    """`fn` under `torch.compile(fullgraph=True)`, its trace saved as `path` by the first call and
    loaded from there by the first call of a later start. `dynamic_dims` are the argument
    dimensions that may change between calls (marked dynamic for the trace, never at a call of
    the saved entry: its guards compare the marking too). `path` None: plain torch.compile."""

    def __init__(
        self,
        fn: Callable[..., Any],
        path: Path | None,
        dynamic_dims: DynamicDims = (),
        dynamic: bool | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.fn = fn
        self.path = path
        self.dynamic_dims = dynamic_dims
        self.traced: Any = torch.compile(fn, fullgraph=True, dynamic=dynamic, options=options)
        self.saved: Any = None  # torch._dynamo.aot_compile.AOTCompiledFunction
        self.source = "not called yet"  # then "loaded", "compiled and saved" or "traced"
        self.seconds = 0.0  # spent loading or compiling it ahead of time (not the first call's run)
        self._prepared = False
        self._refused = False
        self._checked: set[tuple[Any, ...]] = set()  # call signatures the saved guards accepted

    def __call__(self, *args: Any) -> Any:
        if not self._prepared:
            self._prepare(args)
        saved = self.saved
        if saved is not None:
            signature = call_signature(args)
            if signature is not None and signature in self._checked:
                return saved.fn(*args)
            if saved.guard_check(*args):
                if signature is not None:
                    if len(self._checked) >= MAX_CHECKED_SIGNATURES:  # token counts of many-token steps
                        self._checked.clear()
                    self._checked.add(signature)
                return saved.fn(*args)
            self._log_refusal(args)
        self._mark_dynamic(args)
        return self.traced(*args)

    def _mark_dynamic(self, args: tuple[Any, ...]) -> None:
        for index, dim in self.dynamic_dims:
            torch._dynamo.maybe_mark_dynamic(args[index], dim)

    def _prepare(self, args: tuple[Any, ...]) -> None:
        started = time.perf_counter()
        try:
            self._load_or_compile(args)
        finally:
            self.seconds = time.perf_counter() - started

    def _load_or_compile(self, args: tuple[Any, ...]) -> None:
        self._prepared = True
        if self.path is None:
            self.source = "traced"
            return
        if self.path.exists():
            self.saved = self._load(self.path, args)
            if self.saved is not None:
                self.source = "loaded"
                return
        try:
            self._mark_dynamic(args)
            compiled = self.traced.aot_compile((args, {}))
            self._save(compiled)
        except Exception as error:  # whatever fails here, plain torch.compile still runs the function
            logger.warning("%s: could not compile ahead of time (%s); traced at every start instead", self.path, error)
            self.source = "traced"
            return
        self.saved = compiled
        self.source = "compiled and saved"

    def _load(self, path: Path, args: tuple[Any, ...]) -> Any:
        try:
            with path.open("rb") as file, torch._inductor.config.patch(_LOADING_OPTIONS):
                loaded: Any = torch.compiler.load_compiled_function(file, f_globals=self.fn.__globals__)
        except Exception as error:  # another torch or Python, a damaged file, an operator not registered
            logger.info("%s does not load (%s: %s); compiling it again", path, type(error).__name__, error)
            return None
        if not loaded.guard_check(*args):
            logger.info("%s does not fit this model; compiling it again", path)
            return None
        return loaded

    def _save(self, compiled: Any) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        compiled.save_compiled_function(str(self.path))  # written whole, then renamed into place

    def _log_refusal(self, args: tuple[Any, ...]) -> None:
        if self._refused:
            return
        self._refused = True
        reason = self.saved._artifacts.guard_manager.check_verbose(self.saved.prepare_f_locals(*args))
        logger.warning("%s: its guards refuse a call (%s); such calls are traced", self.path, reason.verbose_code_parts)
