"""The CPU backend's native decode-attention kernel: `kernels/paged_decode.c`, built, cached and
loaded by compiled_engine/native_build.py and called through ctypes; and the same kernel as native
torch operators (`kernels/paged_decode_op.cpp`), which let a compiled graph run every layer's
decode attention without Python once the forward's plan is installed (`install_plan`)."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from compiled_engine.native_build import KernelBuildError, NativeLibrary, TorchOperatorLibrary

__all__ = [
    "LIBRARY",
    "DecodePlan",
    "KernelBuildError",
    "NativeDecode",
    "install_plan",
    "load_native_decode",
    "load_native_operator",
]

logger = logging.getLogger(__name__)

LIBRARY = NativeLibrary(Path(__file__).with_name("kernels") / "paged_decode.c", "CPU attention kernel")
NATIVE_OPERATOR = TorchOperatorLibrary(
    Path(__file__).with_name("kernels") / "paged_decode_op.cpp", LIBRARY.source, "native decode-attention operator"
)
# Limits compiled into the kernel; shapes outside them take the torch backend's decode path.
MAX_CHUNK = 512
MAX_HEADS = 128
MAX_HEAD_DIM = 256
LANES = 8
# Each sequence's keys are split into chunks so that there are at least this many work items
# per thread (one sequence alone must still use every core).
ITEMS_PER_THREAD = 4  # paged_decode.c's paged_decode_chunk_keys applies the same rule (the operator path)
# The KV page types the kernel reads and writes, and their codes in paged_decode.c (kv_type).
KV_TYPES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}


def unsupported_reason(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
) -> str | None:
    """Why the native kernel cannot run this attention shape, or None if it can: `dtype` is the
    activations' (q, k, v), `kv_dtype` the KV pages' (None: `dtype`)."""
    if dtype != torch.float32:
        return f"the native kernel takes fp32 only for q, k and v (got {dtype})"
    reason = unsupported_kv_dtype(dtype if kv_dtype is None else kv_dtype)
    if reason is not None:
        return reason
    if num_heads % num_kv_heads != 0 or num_heads > MAX_HEADS:
        return f"{num_heads} query heads over {num_kv_heads} KV heads: the kernel needs whole groups and at most {MAX_HEADS} heads"
    if head_dim % LANES != 0 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is not a multiple of {LANES} up to {MAX_HEAD_DIM}"
    if page_size > MAX_CHUNK:
        return f"page_size {page_size} is above the kernel's {MAX_CHUNK}"
    return None


def unsupported_kv_dtype(kv_dtype: torch.dtype) -> str | None:
    """Why the native kernel cannot keep KV pages of `kv_dtype`, or None if it can."""
    if kv_dtype not in KV_TYPES:
        names = ", ".join(str(t).removeprefix("torch.") for t in KV_TYPES)
        return f"the native kernel keeps KV pages of {names}, not {kv_dtype}"
    return None


@dataclass(frozen=True)
class DecodePlan:
    """One decode batch, checked and laid out once per forward and then run by every layer:
    sequence s stores its new token's K/V in `slots[s]` and attends over its first
    `seq_lens[s]` slots, found through `block_tables[s]` (over the last `window` of them for a
    layer with a sliding window). `chunk` and `chunks` split the longest context into work
    items; `max_seq_len` lets a windowed layer split its shorter span afresh. q, k, v and the
    output are float32; the caches hold `cache_dtype` (one of KV_TYPES)."""

    function: Callable[..., int]
    slots: torch.Tensor  # int64 [seqs]
    block_tables: torch.Tensor  # int32 [seqs, width], contiguous
    seq_lens: torch.Tensor  # int32 [seqs]
    cache_shape: tuple[int, ...]  # one layer's [pages, 2, page_size, kv_heads, head_dim]
    num_heads: int
    max_seq_len: int
    chunk: int
    chunks: int
    threads: int
    scratch: torch.Tensor  # shared by the layers: each call writes it before reading it
    cache_dtype: torch.dtype = torch.float32

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        window: int = 0,
        soft_cap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [seqs, heads, d]; k, v: [seqs, kv_heads, d]; kv_cache: one layer's pages. `window`
        (0: every key), `soft_cap` (0.0: none) and `sinks` (float32 [heads]; None: none) are
        the layer's."""
        num_seqs = self.slots.shape[0]
        _, _, page_size, num_kv_heads, head_dim = self.cache_shape
        if (
            q.shape != (num_seqs, self.num_heads, head_dim)
            or k.shape != (num_seqs, num_kv_heads, head_dim)
            or v.shape != k.shape
            or tuple(kv_cache.shape) != self.cache_shape
            or not kv_cache.is_contiguous()
            or not q.dtype == k.dtype == v.dtype == torch.float32
            or kv_cache.dtype != self.cache_dtype
        ):
            raise ValueError(
                f"paged decode attention planned for q [{num_seqs}, {self.num_heads}, {head_dim}], k and v "
                f"[{num_seqs}, {num_kv_heads}, {head_dim}], all float32, and a contiguous {self.cache_dtype} cache "
                f"{list(self.cache_shape)}; "
                f"got q {list(q.shape)} {q.dtype}, k {list(k.shape)}, v {list(v.shape)}, cache {list(kv_cache.shape)} {kv_cache.dtype}"
            )
        if window < 0 or soft_cap < 0:
            raise ValueError(f"paged decode attention: window {window} and soft_cap {soft_cap} must not be negative")
        if sinks is not None and (
            sinks.shape != (self.num_heads,) or sinks.dtype != torch.float32 or sinks.device.type != "cpu"
        ):
            raise ValueError(
                f"paged decode attention: sinks must be float32 [{self.num_heads}] (one per query head) on the CPU, "
                f"got {sinks.dtype} {list(sinks.shape)} on {sinks.device.type}"
            )
        sink_values = None if sinks is None else sinks.contiguous()
        chunk, chunks, scratch = self.chunk, self.chunks, self.scratch
        if 0 < window < self.max_seq_len:
            # A query attends at most `window` keys, from its window's start: split that span
            # into work items afresh, rather than the longest context, so that every thread
            # still gets its share. The plan's scratch may hold fewer chunks than that needs.
            chunk = chunk_size(num_seqs, window, page_size, self.threads)
            chunks = -(-window // chunk)
            if chunks > self.chunks:
                scratch = torch.empty(num_seqs * self.num_heads * chunks * (head_dim + 2))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        status = self.function(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), self.slots.data_ptr(), kv_cache.data_ptr(),
            KV_TYPES[self.cache_dtype], self.block_tables.data_ptr(), self.block_tables.shape[1], self.seq_lens.data_ptr(), num_seqs,
            self.num_heads, num_kv_heads, head_dim, page_size, chunk, chunks, scale, window, soft_cap,
            None if sink_values is None else sink_values.data_ptr(), scratch.data_ptr(), out.data_ptr(), self.threads,
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"paged decode attention: the kernel refused its shapes (status {status})")
        return out


@dataclass(frozen=True)
class NativeDecode:
    """The loaded kernel."""

    function: Callable[..., int]

    def plan(
        self,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        num_heads: int,
        cache_shape: tuple[int, ...],
        cache_dtype: torch.dtype = torch.float32,
    ) -> DecodePlan:
        """Check a decode batch once: `slots` int64 [seqs] (where each new token goes),
        `block_tables` int32 [seqs, width], `seq_lens` int32 [seqs] with max `max_seq_len`
        (known on the host), for `num_heads` query heads over caches of `cache_shape` holding
        `cache_dtype`."""
        if len(cache_shape) != 5 or cache_shape[1] != 2:
            raise ValueError(
                f"paged decode attention: a layer's cache is [pages, 2, page_size, kv_heads, head_dim], not {list(cache_shape)}"
            )
        _, _, page_size, num_kv_heads, head_dim = cache_shape
        reason = unsupported_reason(num_heads, num_kv_heads, head_dim, page_size, torch.float32, cache_dtype)
        if reason is not None:
            raise ValueError(f"paged decode attention: {reason}")
        num_seqs = slots.shape[0] if slots.dim() == 1 else -1
        width = block_tables.shape[1] if block_tables.dim() == 2 else 0
        problems = [
            message
            for message, bad in (
                ("slots must be int64 [seqs]", num_seqs < 1 or slots.dtype != torch.int64),
                (
                    "block_tables must be int32 [seqs, pages]",
                    block_tables.shape[:1] != (num_seqs,) or width < 1 or block_tables.dtype != torch.int32,
                ),
                ("seq_lens must be int32 [seqs]", seq_lens.shape != (num_seqs,) or seq_lens.dtype != torch.int32),
                (
                    "every index tensor must be on the CPU",
                    any(t.device.type != "cpu" for t in (slots, block_tables, seq_lens)),
                ),
            )
            if bad
        ]
        if not problems and not 1 <= int(seq_lens.min()) <= int(seq_lens.max()) == max_seq_len <= width * page_size:
            problems.append(
                f"seq_lens must be 1..{width * page_size} (the block tables' capacity) with maximum max_seq_len={max_seq_len}"
            )
        if not problems and not 0 <= int(slots.min()) <= int(slots.max()) < cache_shape[0] * page_size:
            problems.append(f"slots must be in 0..{cache_shape[0] * page_size - 1}")
        if not problems and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < cache_shape[0]:
            problems.append(f"block_tables must hold page ids 0..{cache_shape[0] - 1}")
        if problems:
            raise ValueError("paged decode attention: " + "; ".join(problems))
        threads = torch.get_num_threads()
        chunk = chunk_size(num_seqs, max_seq_len, page_size, threads)
        chunks = -(-max_seq_len // chunk)
        scratch = torch.empty(num_seqs * num_heads * chunks * (head_dim + 2))
        return DecodePlan(
            self.function, slots.contiguous(), block_tables.contiguous(), seq_lens.contiguous(),
            tuple(cache_shape), num_heads, max_seq_len, chunk, chunks, threads, scratch, cache_dtype,
        )  # fmt: skip


def chunk_size(work: int, max_seq_len: int, page_size: int, threads: int) -> int:
    """Keys per work item: whole pages, at most MAX_CHUNK, and small enough that `work`
    (sequences) times the chunks per sequence gives every thread ITEMS_PER_THREAD items where
    the context allows it."""
    chunks_wanted = -(-ITEMS_PER_THREAD * threads // max(work, 1))
    keys = -(-max_seq_len // chunks_wanted)
    whole_pages = max(1, -(-keys // page_size)) * page_size
    return min(whole_pages, MAX_CHUNK // page_size * page_size)


@cache
def load_native_decode() -> NativeDecode:
    """Build (once per machine) and load the kernel; raises KernelBuildError when it cannot."""
    library = LIBRARY.load()
    function = library.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [
        ptr,
        ptr,
        ptr,
        ptr,
        ptr,
        ctypes.c_int,  # kv_type
        ptr,
        i64,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_float,  # scale
        i64,  # window
        ctypes.c_float,  # soft_cap
        ptr,  # sinks, or NULL
        ptr,
        ptr,
        ctypes.c_int,
    ]
    function.restype = ctypes.c_int
    return NativeDecode(function)


_operator_loaded = False


@cache
def load_native_operator() -> bool:
    """Build (once per machine) and register the native operators: `paged_decode_f32`, and the
    CPU kernel of the model's `paged_attention` (attention/op.py), which runs the installed plan
    natively and hands every other call to the planning backend (the schemas it implements are
    attention/op.py's: its caller imports that module first). False, with one warning, when
    they cannot be built: the model's operator then calls the backend from Python, as before."""
    global _operator_loaded
    try:
        NATIVE_OPERATOR.load()
    except KernelBuildError as error:
        logger.warning("decode attention calls its kernel from Python (slower per layer), because %s", error)
        return False
    torch.library.register_fake("compiled_engine::paged_decode_f32")(_paged_decode_fake)
    _operator_loaded = True
    return True


def _paged_decode_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(q)


def install_plan(plan: DecodePlan | None) -> None:
    """Make `plan` the one the native `paged_attention` kernel runs every call by, or (None) hand
    every call to the planning backend. Nothing to do when the operators were never loaded."""
    if not _operator_loaded:
        return
    if plan is None:
        torch.ops.compiled_engine.set_native_decode_plan(None, None, None, 0, [])
    else:
        torch.ops.compiled_engine.set_native_decode_plan(
            plan.slots, plan.block_tables, plan.seq_lens, plan.max_seq_len, list(plan.cache_shape)
        )
