"""Packed fp32 weights (linear/packed_cpu.py): the one packed copy and its two products (the
native kernel for up to four rows, oneDNN for more) against their slow twin, F.linear; the
detection of oneDNN's block width; the two-copy fallback; and which weights the compiled model
packs. oneDNN picks the width per shape and per machine, so each test first reads what it does
here (tests/onednn_layout.py) and asserts the behaviour for that."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from compiled_engine.config import EngineConfig
from compiled_engine.executor.runner import Runner
from compiled_engine.executor.step import StepInputs
from compiled_engine.linear import packed_cpu as packing
from compiled_engine.linear.packed_cpu import (
    BLOCK_WIDTHS,
    BlockedEmbedding,
    CpuLinear,
    block,
    blocked_gemv_operator,
    blocked_rows,
    has_packed_copy,
    is_blocked,
    pack,
    packed_bytes,
    packed_linear,
    unblocked,
)
from compiled_engine.model.layers import Linear
from tests.onednn_layout import packs_as_one_copy, this_machines_width

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


@pytest.fixture(scope="module")
def gemv() -> torch._ops.OpOverload:
    op = blocked_gemv_operator()
    assert op is not None, "the native kernel must build on the test machine (it has a C++ compiler)"
    return op


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 33, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_one_packed_copy_runs_every_row_count_like_f_linear(rows: int, bias: bool, gemv: object) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(192, 80)
    b = torch.randn(192) if bias else None
    width = this_machines_width(weight)
    held = pack(weight)
    if isinstance(width, int):
        assert is_blocked(held) and held.shape == (192 // width, 80, width)
        assert torch.equal(unblocked(held), weight)
    else:  # oneDNN's layout here is not blocks the kernel reads: two copies
        assert held is weight and has_packed_copy(weight)
    x = torch.randn(rows, 80)
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear(x, held, b), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


def test_the_kernel_and_onednn_both_run_where_they_should(gemv: object) -> None:
    weight = torch.randn(128, 64)
    one_copy = packs_as_one_copy(weight)
    held = pack(weight)
    # with one copy the native kernel runs up to four rows; with two, oneDNN runs every product
    small = "compiled_engine::blocked_gemv_f32" if one_copy else "mkldnn::_linear_pointwise"
    for rows, op in [(4, small), (5, "mkldnn::_linear_pointwise")]:
        with torch.profiler.profile() as prof:
            packed_linear(torch.randn(rows, 64), held, None)
        assert op in {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("width", BLOCK_WIDTHS)
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_reads_blocks_of_every_width_it_takes(width: int, bias: bool, gemv: torch._ops.OpOverload) -> None:
    """Blocked tensors built by hand (not by oneDNN), one per width, against F.linear."""
    torch.manual_seed(width)
    for out_features, in_features in [(width, 1), (3 * width, 80), (5 * width, 77)]:
        weight = torch.randn(out_features, in_features)
        blocked = block(weight, width)
        assert blocked.shape == (out_features // width, in_features, width)
        assert torch.equal(unblocked(blocked), weight)
        b = torch.randn(out_features) if bias else None
        for rows in range(1, packing.GEMV_MAX_ROWS + 1):
            x = torch.randn(rows, in_features)
            with torch.inference_mode():
                torch.testing.assert_close(gemv(x, blocked, b), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


def test_a_kernel_that_disagrees_with_f_linear_is_not_used(
    gemv: torch._ops.OpOverload, caplog: pytest.LogCaptureFixture
) -> None:
    """The check the kernel passes once it is built: here, a stand-in wrong at one width fails it."""
    narrowest = BLOCK_WIDTHS[-1]

    def wrong_at_one_width(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = gemv(x, blocked, bias)
        return y + 1e-2 if blocked.shape[2] == narrowest else y

    assert packing.agrees_with_f_linear(gemv)
    with caplog.at_level(logging.WARNING, logger=packing.__name__):
        assert not packing.agrees_with_f_linear(wrong_at_one_width)
    assert f"disagrees with F.linear at block widths [{narrowest}]" in caplog.text


@pytest.mark.parametrize(("out_features", "in_features"), [(192, 80), (192, 576), (256, 80), (576, 576), (1536, 64)])
def test_the_width_found_is_the_one_whose_view_reads_back_the_weight(out_features: int, in_features: int) -> None:
    """Detection on whatever this machine's oneDNN picks: the width found is one whose view of the
    packed memory equals the weight (checked here on a copy of that memory), and where none is
    found, no width the kernel takes reads it back."""
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    found = packing.blocked_width(weight, packed)
    whole = torch.ops.mkldnn._nbytes(packed) == weight.numel() * 4
    memory = packing._memory(packed, weight.numel()).clone() if whole else None
    reads_back = [
        w
        for w in BLOCK_WIDTHS
        if memory is not None and out_features % w == 0 and torch.equal(memory, block(weight, w).flatten())
    ]
    if isinstance(found, int):
        assert found in reads_back
    else:
        assert reads_back == [], found


@pytest.mark.parametrize("width", BLOCK_WIDTHS)
def test_detection_finds_each_width_in_real_packed_memory(width: int) -> None:
    """Packed memory that holds a weight blocked at `width`, whatever width oneDNN itself picks
    here: pack W2, the weight whose layout at this machine's width is the blocked-at-`width` W."""
    torch.manual_seed(width)
    out_features, in_features = 6720, 32  # whole blocks of every width
    probe = this_machines_width(torch.randn(out_features, in_features))
    if not isinstance(probe, int):
        pytest.skip(f"oneDNN's layout here cannot be read as blocks for [{out_features}, {in_features}]: {probe}")
    weight = torch.randn(out_features, in_features)
    # unblocked at the machine's width, the memory of weight blocked at `width`
    carrier = unblocked(block(weight, width).view(out_features // probe, in_features, probe))
    packed = torch.ops.mkldnn._reorder_linear_weight(carrier)
    assert packing.blocked_width(carrier, packed) == probe
    assert packing.blocked_width(weight, packed) == width


@pytest.mark.parametrize("out_features", [192, 49152])
def test_onednn_sees_few_row_counts_and_bounded_pieces(out_features: int, gemv: object) -> None:
    """oneDNN keeps a primitive, with a buffer of its output's size, per row count it is given:
    every product gives it only row counts of ONEDNN_ROWS, each piece under ONEDNN_PIECE_BYTES."""
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, 16)
    blocked = pack(weight)
    seen: set[int] = set()
    for rows in [*range(5, 70), 100, 129, 255, 257, 300]:
        x = torch.randn(rows, 16)
        with torch.profiler.profile(record_shapes=True) as prof, torch.inference_mode():
            y = packed_linear(x, blocked, None)
        torch.testing.assert_close(y, F.linear(x, weight), atol=1e-4, rtol=1e-5)
        for event in prof.events():
            if event.name == "mkldnn::_linear_pointwise":
                seen.add(event.input_shapes[0][0])
    assert seen and seen <= set(packing.ONEDNN_ROWS)
    assert max(seen) * out_features * 4 <= packing.ONEDNN_PIECE_BYTES


def test_the_blocked_view_is_the_packed_memory_and_keeps_it_alive(gemv: object) -> None:
    torch.manual_seed(0)
    shapes = [(128, 48), (192, 80), (256, 64), (576, 576)]
    weight = next((w for w in (torch.randn(*shape) for shape in shapes) if packs_as_one_copy(w)), None)
    if weight is None:
        pytest.skip(f"oneDNN packs none of {shapes} as blocks here")
    expected = weight.clone()
    before = packed_bytes()
    blocked = pack(weight)
    assert packed_bytes() == before  # no copy beside the weight
    del weight
    gc.collect()
    junk = [torch.randn(*expected.shape) for _ in range(64)]  # reuse freed memory, if any was freed
    assert torch.equal(unblocked(blocked), expected)
    del junk
    rows = torch.tensor([0, 63, 64, 127, 5])
    assert torch.equal(blocked_rows(blocked, rows), expected[rows])


def test_the_kernel_refuses_what_it_does_not_take(gemv: torch._ops.OpOverload) -> None:
    blocked = block(torch.randn(64, 32), 16)
    with pytest.raises(RuntimeError, match="takes 1 to 4 rows, got 5"):
        gemv(torch.randn(5, 32), blocked, None)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[rows, 32\]"):
        gemv(torch.randn(2, 31), blocked, None)
    with pytest.raises(RuntimeError, match=r"bias must be float32 \[64\]"):
        gemv(torch.randn(2, 32), blocked, torch.randn(63))
    with pytest.raises(RuntimeError, match="must be a contiguous float32"):
        gemv(torch.randn(2, 32), torch.randn(64, 32), None)
    for width in (4, 12, 72):
        with pytest.raises(RuntimeError, match=f"takes blocks of 8 to 64 outputs in steps of 8, got {width}"):
            gemv(torch.randn(2, 32), torch.randn(2, 32, width), None)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_a_weight_that_is_not_whole_blocks_keeps_a_copy_beside_it(rows: int, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(100, 80)
    packing._warned.clear()
    with caplog.at_level(logging.WARNING, logger=packing.__name__):
        held = pack(weight)
    assert held is weight and has_packed_copy(weight)
    assert f"100 output rows are not whole blocks of any width in {BLOCK_WIDTHS}" in caplog.text
    x = torch.randn(rows, 80)
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear(x, weight, None), F.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_without_the_kernel_weights_keep_a_copy_beside_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(packing, "blocked_gemv_operator", lambda: None)
    weight = torch.randn(64, 16)
    packing._warned.clear()
    with caplog.at_level(logging.WARNING, logger=packing.__name__):
        assert pack(weight) is weight and has_packed_copy(weight)
    assert "the native kernel is not built" in caplog.text


def test_a_packed_memory_that_does_not_read_back_as_the_weight_is_refused() -> None:
    weight = torch.randn(64, 16)
    other = torch.ops.mkldnn._reorder_linear_weight(weight.flip(1).contiguous())  # no view reads it right
    widths = tuple(w for w in BLOCK_WIDTHS if 64 % w == 0)
    assert packing.blocked_width(weight, other) == (
        f"oneDNN chose a layout on this CPU that is not [out / B, in, B] for B in {widths}"
    )
    larger = torch.ops.mkldnn._reorder_linear_weight(torch.randn(128, 16))  # more bytes than the weight
    assert packing.blocked_width(weight, larger) == "oneDNN padded the packed weight"


def test_packing_falls_back_to_two_copies_when_no_width_reads_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The fallback, forced: oneDNN's memory matches no view, so the dense weight stays beside it."""
    torch.manual_seed(1)
    weight = torch.randn(192, 80)
    monkeypatch.setattr(packing, "BLOCK_WIDTHS", (8,) if this_machines_width(weight) != 8 else (16,))
    packing._warned.clear()
    with caplog.at_level(logging.WARNING, logger=packing.__name__):
        held = pack(weight)
    assert held is weight and has_packed_copy(weight) and not is_blocked(held)
    assert "twice the memory" in caplog.text and "is not [out / B, in, B]" in caplog.text
    x = torch.randn(3, 80)
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear(x, held, None), F.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_an_unpacked_weight_takes_the_plain_product() -> None:
    weight = torch.randn(16, 8)
    assert not has_packed_copy(weight) and not is_blocked(weight)
    x = torch.randn(3, 8)
    assert torch.equal(packed_linear(x, weight, None), F.linear(x, weight))


def test_packing_refuses_what_onednn_does_not_run_here() -> None:
    with pytest.raises(ValueError, match=r"cannot pack a torch\.bfloat16 weight"):
        pack(torch.randn(4, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.full)])
def test_the_compiled_model_holds_each_weight_once_packed_and_the_eager_one_dense(
    tiny_model_factory: Callable[..., Path], tied: bool, gemv: object
) -> None:
    model_dir = tiny_model_factory("qwen3", max_position_embeddings=64, tie_word_embeddings=tied)

    def build(compiled: bool) -> tuple[Runner, list[Linear]]:
        runner = Runner(
            model_dir, EngineConfig(model=str(model_dir), enforce_eager=not compiled, kv_cache_memory_gib=0.02)
        )
        return runner, [m for layer in runner.model.layers for m in layer.modules() if isinstance(m, Linear)]

    eager_runner, eager = build(compiled=False)
    assert not any(isinstance(m, CpuLinear) for m in [*eager, eager_runner.model.lm_head])
    eager_weights = [m.weight for m in [*eager, eager_runner.model.lm_head]]
    one_copy = [packs_as_one_copy(w) for w in eager_weights]  # what oneDNN does here, per weight
    gc.collect()
    before = packed_bytes()
    runner, compiled = build(compiled=True)
    model = runner.model
    layers_and_head = [*compiled, model.lm_head]
    for module, once in zip(layers_and_head, one_copy, strict=True):
        assert isinstance(module, CpuLinear)
        if once:
            assert module.blocked is not None and is_blocked(module.blocked) and not module.packed
            assert "weight" not in dict(module.named_parameters())
        else:  # the fallback: dense, with oneDNN's copy beside it
            assert module.blocked is None and module.packed and has_packed_copy(module.weight)
    # the module tensors take the eager model's bytes; only the fallback's copies come beside them
    assert runner.weight_bytes == eager_runner.weight_bytes
    beside = sum(w.numel() * 4 for w, once in zip(eager_weights, one_copy, strict=True) if not once)
    assert packed_bytes() - before == beside
    assert isinstance(model.embed_tokens, BlockedEmbedding) == (tied and one_copy[-1])
    if isinstance(model.embed_tokens, BlockedEmbedding):
        assert model.embed_tokens.blocked is model.lm_head.blocked
    ids = torch.tensor([3, 64, 319, 0])
    hidden = torch.randn(4, model.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(model.embed_tokens(ids), eager_runner.model.embed_tokens(ids))
        for rows in (1, 4):
            torch.testing.assert_close(
                runner.forward.logits(hidden[:rows]),
                eager_runner.model.compute_logits(hidden[:rows]),
                atol=1e-4,
                rtol=1e-5,
            )
    # and the compiled graph for many tokens really runs the packed products: five tokens through
    # oneDNN; three through the native kernel where a layer's weight is one copy, else oneDNN
    layers_once = sum(one_copy[:-1])
    for tokens, op, count in [
        (5, "mkldnn::_linear_pointwise", len(compiled)),
        (3, "compiled_engine::blocked_gemv_f32", layers_once),
        (3, "mkldnn::_linear_pointwise", len(compiled) - layers_once),
    ]:
        with torch.profiler.profile() as prof:
            runner.hidden_states(StepInputs(list(range(3, 3 + tokens)), list(range(tokens)), [tokens], [tokens], [[0]]))
        ops = {event.key: event.count for event in prof.key_averages()}
        assert ops.get(op, 0) == count
