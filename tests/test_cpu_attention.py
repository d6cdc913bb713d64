"""The CPU backend's native decode kernel against the torch reference backend: decode-only and
mixed batches, GQA ratios, head sizes, page sizes, contexts split into several chunks, sliding
windows, logit soft-caps and attention sinks; its refusals of bad input; its build, cache and fallback when no
compiler works."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from compiled_engine.attention import native_decode
from compiled_engine.attention.backend import AttentionShape
from compiled_engine.attention.cpu_backend import CpuAttentionBackend
from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.attention.native_decode import (
    KernelBuildError,
    chunk_size,
    load_native_decode,
    load_native_operator,
)
from compiled_engine.attention.op import attention_forward, paged_attention
from compiled_engine.attention.selector import get_backend
from compiled_engine.attention.torch_backend import TorchAttentionBackend
from compiled_engine.native_build import NativeLibrary

CPU = torch.device("cpu")


def _batch(
    query_lens: list[int], seq_lens: list[int], page_size: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0
):
    """Random q/k/v, a random cache and two copies of the metadata over shuffled pages."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pages_needed = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_needed) + 3
    free = list(range(num_pages))
    rng.shuffle(free)
    tables = []
    for n in pages_needed:
        tables.append(free[:n])
        free = free[n:]
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, head_dim)
    k = torch.randn(tokens, kv_heads, head_dim)
    v = torch.randn(tokens, kv_heads, head_dim)
    cache = torch.randn(num_pages, 2, page_size, kv_heads, head_dim)
    metadata = [AttentionMetadata.build(query_lens, seq_lens, tables, page_size, CPU) for _ in range(2)]
    return q, k, v, cache, metadata


def _compare(
    query_lens: list[int],
    seq_lens: list[int],
    page_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int = 0,
    soft_cap: float = 0.0,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    q, k, v, cache, (md_native, md_reference) = _batch(query_lens, seq_lens, page_size, heads, kv_heads, head_dim)
    scale = head_dim**-0.5 if scale is None else scale
    native_cache, reference_cache = cache.clone(), cache.clone()
    backend = CpuAttentionBackend(load_native_decode(), heads)
    got = backend.attend(q, k, v, native_cache, md_native, scale, window, soft_cap, sinks)
    want = TorchAttentionBackend().attend(q, k, v, reference_cache, md_reference, scale, window, soft_cap, sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(native_cache, reference_cache)  # the same K/V stored in the same slots
    assert backend.prepare(md_native, native_cache).native is not None  # the kernel ran the decodes
    # The model's operator, as a compiled graph calls it: the native C++ kernel where the plan is
    # all short sequences, the backend (through paged_attention_planned) otherwise; the same
    # kernel either way, so the same bits.
    operator_cache = cache.clone()
    operator_backend = CpuAttentionBackend(load_native_decode(), heads, native_operator=load_native_operator())
    plan = operator_backend.prepare(md_native, operator_cache)
    with attention_forward(operator_backend, plan):
        through_operator = paged_attention(q, k, v, operator_cache, scale, window, soft_cap, sinks)
    assert torch.equal(through_operator, got)
    assert torch.equal(operator_cache, native_cache)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 4, 64), (9, 3, 64), (8, 2, 128), (16, 2, 64), (6, 3, 40), (2, 1, 256)],
    ids=["mha", "gqa3", "gqa4-d128", "gqa8", "d40", "d256"],
)
@pytest.mark.parametrize("page_size", [16, 8, 1])
def test_decode_batch_matches_the_torch_backend(heads: int, kv_heads: int, head_dim: int, page_size: int) -> None:
    # Contexts of 1 token, exactly one page, one past a page, and long enough for several chunks.
    seq_lens = [1, page_size, page_size + 1, 300, 1100]
    _compare([1] * len(seq_lens), seq_lens, page_size, heads, kv_heads, head_dim)


@pytest.mark.parametrize("seq_len", [1, 7, 16, 17, 511, 512, 513, 2049])
def test_one_sequence_split_into_chunks(seq_len: int) -> None:
    _compare([1], [seq_len], 16, 9, 3, 64)


def test_mixed_batch_matches_the_torch_backend() -> None:
    # a whole prompt, a decode, a chunk after a cached prefix, and two more decodes
    _compare([7, 1, 20, 1, 1], [7, 33, 40, 16, 600], 16, 9, 3, 64)


def test_mixed_batch_with_one_decode() -> None:
    _compare([5, 1], [5, 70], 4, 8, 2, 64)


def test_short_queries_run_as_kernel_rows() -> None:
    """Verified drafts (a few tokens after a long context), a short prompt, decodes and a long
    prompt chunk in one batch: every sequence of up to SHORT_QUERY tokens runs in the kernel,
    one row per token, each attending up to its own position."""
    _compare([5, 1, 8, 3, 20], [300, 33, 8, 40, 60], 16, 9, 3, 64)
    _compare([5, 2, 1], [700, 17, 1], 16, 9, 3, 64)  # short ones only: no torch plan at all
    *_, cache, (metadata, _) = _batch([5, 2, 9], [700, 17, 30], 16, 9, 3, 64)
    plan = CpuAttentionBackend(load_native_decode(), 9).prepare(metadata, cache)
    assert plan.decode_seqs == {0, 1} and plan.prompts is not None  # nine tokens: the torch path


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare([1, 1, 1], [40, 700, 3], 16, 9, 3, 64)
        _compare([1, 1, 1], [40, 700, 3], 16, 9, 3, 64, window=100, soft_cap=SOFT_CAP, scale=CAPPED_SCALE)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# sliding windows and logit soft-caps

SOFT_CAP = 5.0
CAPPED_SCALE = 3 * 64**-0.5  # raw logits spread well past SOFT_CAP, so the cap bites


@pytest.mark.parametrize("soft_cap", [0.0, SOFT_CAP])
@pytest.mark.parametrize("window", [1, 3, 16, 40, 600])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "page_size"),
    [(9, 3, 16), (4, 2, 4), (4, 1, 16), (8, 8, 4)],
    ids=["gqa3-p16", "gqa2-p4", "gqa4-p16", "mha-p4"],
)
def test_window_and_soft_cap_decode_batch(
    heads: int, kv_heads: int, page_size: int, window: int, soft_cap: float
) -> None:
    # Contexts shorter than the windows, a page and one past it, and longer than every window
    # (several chunks, windows that start mid-page and mid-chunk).
    seq_lens = [1, 3, page_size, page_size + 1, 300, 1100]
    _compare([1] * len(seq_lens), seq_lens, page_size, heads, kv_heads, 64, window, soft_cap, CAPPED_SCALE)


@pytest.mark.parametrize(("window", "soft_cap"), [(3, 0.0), (40, SOFT_CAP), (0, SOFT_CAP), (700, SOFT_CAP)])
def test_window_and_soft_cap_mixed_batch(window: int, soft_cap: float) -> None:
    """Verified drafts and short prompts as kernel rows (each row's window ends at its own
    position), decodes, and long prompt chunks after a cached prefix on the torch path."""
    _compare([5, 1, 8, 3, 20], [300, 33, 8, 40, 60], 16, 9, 3, 64, window, soft_cap, CAPPED_SCALE)
    _compare([7, 1, 20, 1, 1], [7, 33, 40, 16, 600], 16, 4, 1, 64, window, soft_cap, CAPPED_SCALE)
    _compare([5, 2, 1], [700, 17, 1], 16, 4, 2, 64, window, soft_cap, CAPPED_SCALE)  # kernel rows only


@pytest.mark.parametrize(("seq_len", "window"), [(2049, 100), (2049, 513), (2049, 2048), (129, 128), (129, 200)])
def test_a_window_splits_its_span_into_chunks(seq_len: int, window: int) -> None:
    """A windowed layer splits its window, not the whole context, into work items: with two
    threads, (129, 128) needs more chunks (8 of 16 keys) than the plan made for the context (5 of
    32), so the call takes a scratch of its own."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if (seq_len, window) == (129, 128):
            assert -(-129 // chunk_size(1, 129, 16, 2)) == 5 and -(-128 // chunk_size(1, 128, 16, 2)) == 8
        _compare([1], [seq_len], 16, 9, 3, 64, window, SOFT_CAP, CAPPED_SCALE)
        _compare([1, 1, 1], [seq_len, 5, seq_len - 7], 16, 9, 3, 64, window)
    finally:
        torch.set_num_threads(before)


def _sinks(heads: int, seed: int = 7) -> torch.Tensor:
    # Around the scores' size (scale 1/8 over 64 dims of unit normals), so they take real weight.
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("window", [0, 3, 40])
@pytest.mark.parametrize(("heads", "kv_heads", "page_size"), [(9, 3, 16), (4, 4, 4)], ids=["gqa3-p16", "mha-p4"])
def test_sinks_decode_batch(heads: int, kv_heads: int, page_size: int, window: int) -> None:
    seq_lens = [1, 3, page_size, page_size + 1, 300, 1100]
    _compare([1] * len(seq_lens), seq_lens, page_size, heads, kv_heads, 64, window, sinks=_sinks(heads))


@pytest.mark.parametrize(("window", "soft_cap"), [(0, 0.0), (3, 0.0), (40, SOFT_CAP)])
def test_sinks_mixed_batch(window: int, soft_cap: float) -> None:
    _compare([5, 1, 8, 3, 20], [300, 33, 8, 40, 60], 16, 9, 3, 64, window, soft_cap, CAPPED_SCALE, _sinks(9))
    _compare([5, 2, 1], [700, 17, 1], 16, 4, 2, 64, window, soft_cap, CAPPED_SCALE, _sinks(4))  # kernel rows only


def test_sinks_change_the_kernel_output() -> None:
    """The sink comparisons above can fail: sinks far below every score change nothing, a zero
    sink changes every row."""
    q, k, v, cache, (md, _) = _batch([1, 1], [20, 300], 16, 4, 2, 64)
    backend = CpuAttentionBackend(load_native_decode(), 4)
    plain = backend.attend(q, k, v, cache.clone(), md, 0.125)
    torch.testing.assert_close(backend.attend(q, k, v, cache.clone(), md, 0.125, sinks=torch.full((4,), -80.0)), plain)
    with_sink = backend.attend(q, k, v, cache.clone(), md, 0.125, sinks=torch.zeros(4))
    assert ((with_sink - plain).abs().amax(dim=-1) > 1e-4).all()


def test_a_bf16_cache_takes_the_torch_path_with_a_window() -> None:
    q, k, v, cache, (md_native, md_reference) = _batch([3, 1], [20, 40], 16, 4, 2, 64)
    q, k, v, cache = q.bfloat16(), k.bfloat16(), v.bfloat16(), cache.bfloat16()
    native_cache, reference_cache = cache.clone(), cache.clone()
    backend = CpuAttentionBackend(load_native_decode(), 4, dtype=torch.bfloat16)
    got = backend.attend(q, k, v, native_cache, md_native, 0.125, 6, SOFT_CAP)
    want = TorchAttentionBackend().attend(q, k, v, reference_cache, md_reference, 0.125, 6, SOFT_CAP)
    assert torch.equal(got, want) and torch.equal(native_cache, reference_cache)


def test_a_window_covering_the_context_changes_nothing() -> None:
    """Full attention is window 0; a window at least as long as every context is the same."""
    q, k, v, cache, (md, _) = _batch([1, 1, 4], [300, 17, 40], 16, 9, 3, 64)
    backend = CpuAttentionBackend(load_native_decode(), 9)
    full = backend.attend(q, k, v, cache.clone(), md, 0.125)
    assert torch.equal(backend.attend(q, k, v, cache.clone(), md, 0.125, 300), full)
    assert not torch.allclose(backend.attend(q, k, v, cache.clone(), md, 0.125, 299), full)


def test_a_bf16_cache_takes_the_torch_path() -> None:
    q, k, v, cache, (md_native, md_reference) = _batch([1, 1], [20, 40], 16, 4, 2, 64)
    q, k, v, cache = q.bfloat16(), k.bfloat16(), v.bfloat16(), cache.bfloat16()
    native_cache, reference_cache = cache.clone(), cache.clone()
    got = CpuAttentionBackend(load_native_decode(), 4, dtype=torch.bfloat16).attend(
        q, k, v, native_cache, md_native, 0.125
    )
    want = TorchAttentionBackend().attend(q, k, v, reference_cache, md_reference, 0.125)
    assert torch.equal(got, want) and torch.equal(native_cache, reference_cache)


@pytest.mark.parametrize(
    ("work", "max_seq_len", "page_size", "threads", "expected"),
    [
        (1, 512, 16, 2, 64),  # one sequence: 8 chunks of 4 pages for 2 threads
        (1, 5, 16, 2, 16),  # never less than a page
        (1, 100000, 16, 2, 512),  # never more than MAX_CHUNK
        (32, 300, 16, 2, 304),  # enough sequences: whole contexts
        (3, 512, 100, 8, 100),  # whole pages of an odd size
        (1, 512, 512, 4, 512),
    ],
)
def test_chunk_size(work: int, max_seq_len: int, page_size: int, threads: int, expected: int) -> None:
    chunk = chunk_size(work, max_seq_len, page_size, threads)
    assert chunk == expected
    assert chunk % page_size == 0 and chunk <= native_decode.MAX_CHUNK


# ---------------------------------------------------------------------------------------------
# refusals: a clear error, and the cache untouched


def _plan_inputs():
    q, k, v, cache, (md, _) = _batch([1, 1], [20, 40], 16, 4, 2, 64)
    return q, k, v, cache, md


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "slots": a["slots"].int()}, "slots must be int64"),
        (lambda a: {**a, "block_tables": a["block_tables"].long()}, "block_tables must be int32"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, r"seq_lens must be int32 \[seqs\]"),
        (lambda a: {**a, "max_seq_len": 41}, "maximum max_seq_len=41"),
        (
            lambda a: {**a, "seq_lens": torch.tensor([20, 99], dtype=torch.int32), "max_seq_len": 99},
            "block tables' capacity",
        ),
        (lambda a: {**a, "slots": a["slots"] + 10**6}, "slots must be in"),
        (lambda a: {**a, "block_tables": a["block_tables"] + 1000}, "page ids"),
        (lambda a: {**a, "cache_shape": (8, 2, 16, 2, 36)}, "head_dim 36"),
        (lambda a: {**a, "num_heads": 5}, "whole groups"),
        (lambda a: {**a, "cache_shape": (8, 16, 2, 64)}, r"a layer's cache is \[pages, 2"),
    ],
)
def test_plan_refuses_bad_input(change, message: str) -> None:
    *_, cache, md = _plan_inputs()
    arguments = dict(
        slots=md.slot_mapping, block_tables=md.block_tables, seq_lens=md.seq_lens, max_seq_len=40,
        num_heads=4, cache_shape=tuple(cache.shape),
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        load_native_decode().plan(**change(arguments))


def test_run_refuses_a_mismatched_call_and_leaves_the_cache() -> None:
    q, k, v, cache, md = _plan_inputs()
    plan = load_native_decode().plan(md.slot_mapping, md.block_tables, md.seq_lens, 40, 4, tuple(cache.shape))
    before = cache.clone()
    for args in [
        (q[:1], k[:1], v[:1], cache),  # fewer sequences than planned
        (q.double(), k.double(), v.double(), cache.double()),
        (q, k, v, cache.transpose(0, 1).contiguous().transpose(0, 1)),  # not contiguous
        (q, k, v, cache[:4]),  # another cache shape
        (q, v[:, :1], v, cache),
    ]:
        with pytest.raises(ValueError, match="paged decode attention planned for"):
            plan.run(*args, 0.125)
    for window, soft_cap in ((-1, 0.0), (0, -1.0)):
        with pytest.raises(ValueError, match="must not be negative"):
            plan.run(q, k, v, cache, 0.125, window, soft_cap)
    for sinks in (torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.zeros(2, 2)):
        with pytest.raises(ValueError, match=r"sinks must be float32 \[4\] \(one per query head\)"):
            plan.run(q, k, v, cache, 0.125, sinks=sinks)
    assert torch.equal(cache, before)
    out = plan.run(q, k, v, cache, 0.125)  # and the right call still works
    assert out.shape == q.shape and torch.isfinite(out).all()


def _operator_backend(heads: int) -> CpuAttentionBackend:
    assert load_native_operator()  # this machine has a C++ compiler: the operator must build
    return CpuAttentionBackend(load_native_decode(), heads, native_operator=True)


def test_the_native_operator_runs_decodes_without_python_and_hands_on_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a plan of decodes installed, no layer call reaches the backend's Python forward; a
    plan with a prompt in it goes to the backend for every call."""
    backend = _operator_backend(4)
    calls = []
    python_forward = CpuAttentionBackend.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return python_forward(self, *args, **kwargs)

    monkeypatch.setattr(CpuAttentionBackend, "forward", counted)
    q, k, v, cache, (decodes, _) = _batch([1, 1], [20, 40], 16, 4, 2, 64)
    with attention_forward(backend, backend.prepare(decodes, cache)):
        for _ in range(3):
            paged_attention(q, k, v, cache, 0.125)
    assert calls == []
    q, k, v, cache, (mixed, _) = _batch([12, 1], [12, 40], 16, 4, 2, 64)
    with attention_forward(backend, backend.prepare(mixed, cache)):
        paged_attention(q, k, v, cache, 0.125)
    assert calls == [1]


def test_nested_forwards_restore_the_installed_plan() -> None:
    """An inner forward (another batch, or another backend) installs its own plan, and the outer
    one's comes back when it ends; outside every forward the operator refuses to run."""
    backend = _operator_backend(4)
    q, k, v, cache, (outer, _) = _batch([1, 1], [20, 40], 16, 4, 2, 64, seed=1)
    q1, k1, v1, cache1, (inner, _) = _batch([1], [70], 16, 4, 2, 64, seed=2)
    want = backend.attend(q, k, v, cache.clone(), outer, 0.125)
    want_inner = TorchAttentionBackend().attend(q1, k1, v1, cache1.clone(), inner, 0.125)
    with attention_forward(backend, backend.prepare(outer, cache)):
        with attention_forward(TorchAttentionBackend(), TorchAttentionBackend().prepare(inner, cache1)):
            torch.testing.assert_close(paged_attention(q1, k1, v1, cache1, 0.125), want_inner)
        assert torch.equal(paged_attention(q, k, v, cache, 0.125), want)
    with pytest.raises(RuntimeError, match="outside attention_forward"):
        paged_attention(q, k, v, cache, 0.125)


def test_the_native_operator_refuses_a_mismatched_call_and_leaves_the_cache() -> None:
    backend = _operator_backend(4)
    q, k, v, cache, md = _plan_inputs()
    before = cache.clone()
    with attention_forward(backend, backend.prepare(md, cache)):
        for args, message in [
            ((q, k, v, cache[:4]), "installed plan is for layer caches of shape"),
            ((q[:1], k[:1], v[:1], cache), "q must be float32"),
            ((q, v[:, :1], v, cache), "k and v must be float32"),
            ((q.double(), k.double(), v.double(), cache.double()), "contiguous float32"),
        ]:
            with pytest.raises(RuntimeError, match=message):
                paged_attention(*args, 0.125)
        with pytest.raises(RuntimeError, match="must not be negative"):
            paged_attention(q, k, v, cache, 0.125, -1)
        assert torch.equal(cache, before)
        out = paged_attention(q, k, v, cache, 0.125)  # and the right call still works
    assert torch.equal(out, CpuAttentionBackend(load_native_decode(), 4).attend(q, k, v, before, md, 0.125))


# ---------------------------------------------------------------------------------------------
# build, cache and backend choice


@pytest.fixture
def fresh_kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("COMPILED_ENGINE_CACHE", str(tmp_path))
    load_native_decode.cache_clear()
    yield tmp_path
    load_native_decode.cache_clear()


def test_the_library_is_built_once_and_reused(fresh_kernel_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = native_decode.LIBRARY.path()
    assert path.parent == fresh_kernel_cache / "kernels" and path.exists()

    def no_rebuild(self: NativeLibrary, compiler: str, output: Path) -> None:
        raise AssertionError("rebuilt a cached kernel")

    monkeypatch.setattr(NativeLibrary, "build", no_rebuild)
    assert native_decode.LIBRARY.path() == path
    assert load_native_decode().plan is not None


def test_a_missing_compiler_falls_back_to_torch(
    fresh_kernel_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(KernelBuildError, match="'no-such-compiler' is not on PATH"):
        load_native_decode()
    shape = AttentionShape(4, 2, 64, 16, torch.float32, CPU)
    with caplog.at_level(logging.WARNING):
        backend = get_backend(None, shape)
    assert backend.name == "torch"
    assert "attention backend: torch, because no C compiler" in caplog.text
    assert not (fresh_kernel_cache / "kernels").exists() or not any((fresh_kernel_cache / "kernels").iterdir())


def test_a_failing_compiler_reports_its_error(fresh_kernel_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = fresh_kernel_cache / "broken-cc"
    script.write_text("#!/bin/sh\necho 'fatal: this compiler is broken' >&2\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    with pytest.raises(KernelBuildError, match="this compiler is broken"):
        load_native_decode()
    assert list((fresh_kernel_cache / "kernels").glob("*.so")) == []  # no partial library left behind


def test_an_unwritable_cache_falls_back_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("COMPILED_ENGINE_CACHE", str(blocker))
    load_native_decode.cache_clear()
    try:
        with pytest.raises(KernelBuildError, match="building or loading the CPU attention kernel failed"):
            load_native_decode()
        with caplog.at_level(logging.WARNING):
            assert get_backend(None, AttentionShape(4, 2, 64, 16, torch.float32, CPU)).name == "torch"
        assert "attention backend: torch, because building or loading" in caplog.text
    finally:
        load_native_decode.cache_clear()


def test_a_failing_operator_build_keeps_the_python_call(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a working C++ compiler the backend still runs the kernel, called from Python."""
    monkeypatch.setenv("CXX", "no-such-compiler")
    native_decode.load_native_operator.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            backend = get_backend("cpu", AttentionShape(4, 2, 64, 16, torch.float32, CPU))
        assert "decode attention calls its kernel from Python" in caplog.text and "no-such-compiler" in caplog.text
        assert isinstance(backend, CpuAttentionBackend) and not backend.native_operator
        q, k, v, cache, md = _plan_inputs()
        assert backend.native_plan(backend.prepare(md, cache)) is None
        with attention_forward(backend, backend.prepare(md, cache.clone())):
            got = paged_attention(q, k, v, cache.clone(), 0.125)
        assert torch.equal(got, backend.attend(q, k, v, cache.clone(), md, 0.125))
    finally:
        native_decode.load_native_operator.cache_clear()


def test_get_backend_on_the_cpu(caplog: pytest.LogCaptureFixture) -> None:
    fp32 = AttentionShape(9, 3, 64, 16, torch.float32, CPU)
    assert get_backend(None, fp32).name == "cpu"
    assert get_backend("cpu", fp32).name == "cpu"
    assert get_backend("torch", fp32).name == "torch"
    with caplog.at_level(logging.WARNING):
        assert get_backend(None, AttentionShape(9, 3, 64, 16, torch.bfloat16, CPU)).name == "torch"
        assert get_backend("cpu", AttentionShape(9, 3, 36, 16, torch.float32, CPU)).name == "torch"
        assert get_backend("cpu", AttentionShape(9, 3, 64, 16, torch.float16, torch.device("cuda"))).name == "torch"
    assert "fp32 only" in caplog.text and "head_dim 36" in caplog.text and "runs on the CPU, not cuda" in caplog.text
