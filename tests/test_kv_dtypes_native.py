"""The CPU backend's native decode kernel over KV pages of fp16, bf16, fp8 e4m3 and fp8 e5m2: its
conversions bit for bit against torch's (stores round to nearest even, FP8 saturates to +-max),
and its attention against the torch backend over the same stored values: decode-only and mixed
batches, page boundaries, GQA, sliding windows and soft-caps, the model's operator, and its
refusals of a cache type it does not keep."""

from __future__ import annotations

import ctypes
import platform
from functools import cache
from pathlib import Path

import pytest
import torch

from compiled_engine.attention import native_decode
from compiled_engine.attention.backend import AttentionShape
from compiled_engine.attention.cpu_backend import CpuAttentionBackend
from compiled_engine.attention.native_decode import KV_TYPES, NativeDecode, load_native_decode, load_native_operator
from compiled_engine.attention.op import attention_forward, paged_attention
from compiled_engine.attention.paged import kv_rows, write_kv
from compiled_engine.attention.torch_backend import TorchAttentionBackend
from compiled_engine.native_build import NativeLibrary
from tests.test_cpu_attention import CAPPED_SCALE, SOFT_CAP, _batch

SMALL = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
SMALL_IDS = ["f16", "bf16", "e4m3", "e5m2"]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a cache of `dtype` holds for fp32 `x`: FP8 saturated to its finite range, then cast."""
    if dtype in FP8:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@cache
def _torch_writes(dtype: torch.dtype) -> bool:
    """Whether the torch path's write_kv can store this type on the CPU (index_copy_ of FP8 is not
    implemented in every torch): the mixed batches' prompts and the same-type reference need it."""
    pool = torch.zeros(1, 2, 1, 1, 8, dtype=dtype)
    try:
        write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), pool, torch.zeros(1, dtype=torch.int64))
    except (NotImplementedError, RuntimeError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# the conversions, element by element


def _probe_values() -> torch.Tensor:
    """Random fp32 values over many magnitudes and random bit patterns, every finite value of each
    small type with the midpoints between neighbours and the floats beside them (ties and near
    ties), the types' extremes and the infinities; padded to a whole number of vectors."""
    torch.manual_seed(0)
    parts = [torch.randn(1 << 14) * scale for scale in (1e-9, 1e-6, 1e-3, 0.1, 1.0, 30.0, 500.0, 1e5, 1e38)]
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int32).view(torch.float32)
    parts.append(bits[torch.isfinite(bits)])
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    for dtype in SMALL:
        info = torch.finfo(dtype)
        extremes = [info.max, -info.max, info.tiny, -info.tiny, info.smallest_normal, 0.0, -0.0]
        parts.append(torch.tensor([*extremes, float("inf"), float("-inf")]))
        patterns = torch.arange(256, dtype=torch.uint8) if dtype in FP8 else torch.arange(65536).to(torch.int16)
        values = patterns.view(dtype).float()
        values = values[torch.isfinite(values)].unique()
        middles = ((values[1:].double() + values[:-1].double()) / 2).float()
        parts += [values, middles, torch.nextafter(middles, up), torch.nextafter(middles, down)]
    x = torch.cat(parts)
    return torch.cat([x, torch.zeros(-x.numel() % native_decode.LANES)])


def _convert_with(library: ctypes.CDLL, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` stored as `dtype` by the kernel, and what the kernel reads back from that."""
    stored = torch.empty(x.numel(), dtype=dtype)
    back = torch.empty(x.numel())
    n, kind = ctypes.c_int64(x.numel()), ctypes.c_int(KV_TYPES[dtype])
    library.paged_kv_from_f32(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(stored.data_ptr()), n, kind)
    library.paged_kv_to_f32(ctypes.c_void_p(stored.data_ptr()), ctypes.c_void_p(back.data_ptr()), n, kind)
    return stored, back


def _check_conversions(library: ctypes.CDLL, dtype: torch.dtype) -> None:
    x = _probe_values()
    stored, back = _convert_with(library, x, dtype)
    want = _stored(x, dtype)
    wrong = (_bits(stored) != _bits(want)).nonzero().flatten()
    assert wrong.numel() == 0, f"{wrong.numel()} stores differ from torch's, first at {x[wrong[:4]].tolist()}"
    # Reading: every bit pattern of the type (NaNs as NaNs), against torch's .float().
    patterns = torch.arange(256, dtype=torch.uint8) if dtype in FP8 else torch.arange(65536).to(torch.int16)
    patterns = patterns.view(dtype)
    read = torch.empty(patterns.numel())
    n, kind = ctypes.c_int64(patterns.numel()), ctypes.c_int(KV_TYPES[dtype])
    library.paged_kv_to_f32(ctypes.c_void_p(patterns.data_ptr()), ctypes.c_void_p(read.data_ptr()), n, kind)
    reference = patterns.float()
    nan = reference.isnan()
    assert torch.equal(read.isnan(), nan)
    assert torch.equal(read[~nan].view(torch.int32), reference[~nan].view(torch.int32))  # signed zeros too
    assert torch.equal(back, want.float())


@pytest.mark.parametrize("dtype", SMALL, ids=SMALL_IDS)
def test_conversions_match_torch_bit_for_bit(dtype: torch.dtype) -> None:
    _check_conversions(native_decode.LIBRARY.load(), dtype)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_saturates_to_its_largest_finite_value(dtype: torch.dtype) -> None:
    """A K or V beyond the type's range (a per-tensor scale of 1.0) is stored as +-max, through
    the kernel's own store as much as the element conversion."""
    top = torch.finfo(dtype).max
    x = torch.tensor([top * 1.01, -top * 1.01, 1e6, -1e6, float("inf"), float("-inf"), 3e38, top * 1.0625])
    _, back = _convert_with(native_decode.LIBRARY.load(), x, dtype)
    assert back.tolist() == [top, -top, top, -top, top, -top, top, top]
    q, k, v, pool, (metadata, _) = _batch([1, 1], [20, 40], 16, 4, 2, 64)
    k[0, 0, :8], v[1, 1, 8:16] = x, -x
    pool = _stored(pool, dtype)
    CpuAttentionBackend(load_native_decode(), 4).attend(q, k, v, pool, metadata, 0.125)
    flat = pool.view(-1, 2, 64).float()
    rows = kv_rows(metadata.slot_mapping, 16)
    assert flat[rows[0], 0, :8].tolist() == [top, -top, top, -top, top, -top, top, top]
    assert flat[rows[1] + 16, 1, 8:16].tolist() == [-top, top, -top, top, -top, top, -top, -top]


@pytest.mark.full  # a second build of the kernel: the quick tier runs the F16C one every x86 CI machine has
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="F16C is an x86 extension")
def test_the_portable_fp16_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built without F16C, fp16 and the FP8 types (read through fp16) convert in plain vector
    code: the same bits, and the same attention as the F16C build (to rounding: without F16C the
    compiler also drops AVX-512, so the sums may run in another order)."""
    monkeypatch.setenv("COMPILED_ENGINE_CACHE", str(tmp_path))
    library = NativeLibrary(native_decode.LIBRARY.source, "CPU attention kernel", extra_flags=("-mno-f16c",))
    loaded = library.load()
    for dtype in SMALL:
        _check_conversions(loaded, dtype)
    function = loaded.paged_decode_attention
    function.argtypes = load_native_decode().function.argtypes  # type: ignore[attr-defined]
    function.restype = ctypes.c_int
    portable = NativeDecode(function)
    q, k, v, pool, (metadata, _) = _batch([1, 1, 1], [17, 300, 40], 16, 9, 3, 64)
    for dtype in (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        outs, pools = [], []
        for kernel in (portable, load_native_decode()):
            small = _stored(pool, dtype)
            plan = kernel.plan(
                metadata.slot_mapping, metadata.block_tables, metadata.seq_lens, 300, 9, small.shape, dtype
            )
            outs.append(plan.run(q, k, v, small, 0.125))
            pools.append(small)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)
        assert _same_bits(pools[0], pools[1])


# ---------------------------------------------------------------------------------------------
# attention against the torch backend


def _compare(
    dtype: torch.dtype,
    query_lens: list[int],
    seq_lens: list[int],
    page_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int = 0,
    soft_cap: float = 0.0,
    scale: float | None = None,
) -> None:
    """The cpu backend on a cache of `dtype` against the torch backend on an fp32 cache holding the
    same values, its new K/V the values `dtype` stores (what the torch backend computes on the
    small cache, which reads it .to(q.dtype)); and, where torch's write_kv stores the type, the
    torch backend on the same small cache. The written pages must hold exactly the bits
    write_kv stores; the model's operator must give the same bits as the backend."""
    q, k, v, pool, (md_native, md_reference) = _batch(query_lens, seq_lens, page_size, heads, kv_heads, head_dim)
    scale = head_dim**-0.5 if scale is None else scale
    small = _stored(pool, dtype)
    native_cache = small.clone()
    backend = CpuAttentionBackend(load_native_decode(), heads)
    plan = backend.prepare(md_native, native_cache)
    assert plan.native is not None and plan.native.cache_dtype == dtype  # the kernel runs the short sequences
    got = backend.attend(q, k, v, native_cache, md_native, scale, window, soft_cap)

    expected_cache = small.clone()
    flat = expected_cache.view(-1, kv_heads, head_dim)
    rows = kv_rows(md_reference.slot_mapping, page_size)
    flat[rows], flat[rows + page_size] = _stored(k, dtype), _stored(v, dtype)
    assert _same_bits(native_cache, expected_cache)

    k_stored, v_stored = _stored(k, dtype).float(), _stored(v, dtype).float()
    reference_cache = small.float()
    want = TorchAttentionBackend().attend(
        q, k_stored, v_stored, reference_cache, md_reference, scale, window, soft_cap
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(reference_cache, expected_cache.float())

    if _torch_writes(dtype):
        same_type_cache = small.clone()
        md_same = _batch(query_lens, seq_lens, page_size, heads, kv_heads, head_dim)[4][0]
        same = TorchAttentionBackend().attend(q, k, v, same_type_cache, md_same, scale, window, soft_cap)
        torch.testing.assert_close(got, same, atol=2e-5, rtol=1e-5)
        assert _same_bits(same_type_cache, expected_cache)

    operator_cache = small.clone()
    operator_backend = CpuAttentionBackend(load_native_decode(), heads, native_operator=load_native_operator())
    operator_plan = operator_backend.prepare(md_native, operator_cache)
    with attention_forward(operator_backend, operator_plan):
        through_operator = paged_attention(q, k, v, operator_cache, scale, window, soft_cap)
    assert torch.equal(through_operator, got)
    assert _same_bits(operator_cache, native_cache)


@pytest.mark.parametrize("dtype", SMALL, ids=SMALL_IDS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size"),
    [(9, 3, 64, 16), (8, 2, 128, 8), (6, 3, 40, 16), (4, 4, 64, 1)],
    ids=["gqa3", "gqa4-d128-p8", "d40", "mha-p1"],
)
def test_decode_batch_matches_the_torch_backend(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, page_size: int
) -> None:
    # One token, exactly a page, one past a page, and contexts split into several chunks.
    seq_lens = [1, page_size, page_size + 1, 300, 1100]
    _compare(dtype, [1] * len(seq_lens), seq_lens, page_size, heads, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", SMALL, ids=SMALL_IDS)
@pytest.mark.parametrize(("window", "soft_cap"), [(0, SOFT_CAP), (40, 0.0), (3, SOFT_CAP), (600, SOFT_CAP)])
def test_window_and_soft_cap_decode_batch(dtype: torch.dtype, window: int, soft_cap: float) -> None:
    seq_lens = [1, 3, 16, 17, 300, 1100]
    _compare(dtype, [1] * len(seq_lens), seq_lens, 16, 9, 3, 64, window, soft_cap, CAPPED_SCALE)


@pytest.mark.parametrize("dtype", SMALL, ids=SMALL_IDS)
def test_short_sequences_only_run_as_kernel_rows(dtype: torch.dtype) -> None:
    """Verified drafts, a short prompt and a decode: every token a row of the kernel."""
    _compare(dtype, [5, 2, 1], [700, 17, 1], 16, 9, 3, 64)
    _compare(dtype, [5, 2, 1], [700, 17, 1], 16, 4, 2, 64, 40, SOFT_CAP, CAPPED_SCALE)


@pytest.mark.parametrize("dtype", SMALL, ids=SMALL_IDS)
def test_mixed_batch_matches_the_torch_backend(dtype: torch.dtype) -> None:
    """Long prompts and chunks after a cached prefix beside decodes and verified drafts: the
    prompts' K/V go through write_kv, so the types it cannot store yet wait for it."""
    if not _torch_writes(dtype):
        pytest.skip(f"write_kv cannot store {dtype} on the CPU with this torch")
    _compare(dtype, [5, 1, 8, 3, 20], [300, 33, 8, 40, 60], 16, 9, 3, 64)
    _compare(dtype, [7, 1, 20, 1, 1], [7, 33, 40, 16, 600], 16, 4, 1, 64, 40, SOFT_CAP, CAPPED_SCALE)


# ---------------------------------------------------------------------------------------------
# refusals


def test_the_plan_names_a_cache_type_it_cannot_keep() -> None:
    *_, pool, (md, _) = _batch([1, 1], [20, 40], 16, 4, 2, 64)
    with pytest.raises(ValueError, match=r"keeps KV pages of float32, float16, .*float8_e5m2, not torch.int8"):
        load_native_decode().plan(md.slot_mapping, md.block_tables, md.seq_lens, 40, 4, pool.shape, torch.int8)
    shape = AttentionShape(9, 3, 64, 16, torch.float32, torch.device("cpu"), kv_dtype=torch.float64)
    assert "not torch.float64" in (CpuAttentionBackend.unsupported_reason(shape) or "")
    for dtype in SMALL:
        small = AttentionShape(9, 3, 64, 16, torch.float32, torch.device("cpu"), kv_dtype=dtype)
        assert CpuAttentionBackend.unsupported_reason(small) is None


def test_a_run_refuses_a_cache_of_another_type_and_leaves_it() -> None:
    q, k, v, pool, (md, _) = _batch([1, 1], [20, 40], 16, 4, 2, 64)
    plan = load_native_decode().plan(md.slot_mapping, md.block_tables, md.seq_lens, 40, 4, pool.shape, torch.float16)
    for other in (pool, pool.bfloat16()):
        before = other.clone()
        with pytest.raises(ValueError, match=r"contiguous torch\.float16 cache"):
            plan.run(q, k, v, other, 0.125)
        assert _same_bits(other, before) if other.dtype != torch.float32 else torch.equal(other, before)
    with pytest.raises(ValueError, match="all float32"):
        plan.run(q.half(), k.half(), v.half(), pool.half(), 0.125)


def test_a_cache_of_another_type_takes_the_torch_path() -> None:
    q, k, v, pool, (md_native, md_reference) = _batch([1, 1], [20, 40], 16, 4, 2, 64)
    pool = pool.double()
    native_cache, reference_cache = pool.clone(), pool.clone()
    backend = CpuAttentionBackend(load_native_decode(), 4)
    assert backend.prepare(md_native, native_cache).native is None
    got = backend.attend(q, k, v, native_cache, md_native, 0.125)
    want = TorchAttentionBackend().attend(q, k, v, reference_cache, md_reference, 0.125)
    assert torch.equal(got, want) and torch.equal(native_cache, reference_cache)


def test_the_operator_refuses_a_cache_type_it_cannot_keep() -> None:
    assert load_native_operator()
    q, k, v, pool, (md, _) = _batch([1, 1], [20, 40], 16, 4, 2, 64)
    with pytest.raises(
        RuntimeError, match=r"float8_e5m2 \[pages, 2, page_size, kv_heads, head_dim\] on the CPU, not Int"
    ):
        torch.ops.compiled_engine.paged_decode_f32(
            q, k, v, pool.int(), md.slot_mapping, md.block_tables, md.seq_lens, 40, 0.125
        )  # fmt: skip
