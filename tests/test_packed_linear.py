"""Packed fp32 weights (model/packed_linear.py): the one packed copy and its two products (the
native kernel for up to four rows, oneDNN for more) against their slow twin, F.linear; the
two-copy fallback; and which weights the compiled model packs."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from compiled_engine.config import EngineConfig
from compiled_engine.engine.compilation import BlockedEmbedding, CpuLinear
from compiled_engine.engine.model_runner import ModelRunner
from compiled_engine.engine.step_inputs import StepInputs
from compiled_engine.model import packed_linear as packing
from compiled_engine.model.llama import Linear
from compiled_engine.model.packed_linear import (
    blocked_gemv_operator,
    blocked_rows,
    has_packed_copy,
    is_blocked,
    pack,
    packed_bytes,
    packed_linear,
    unblocked,
)

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
    blocked = pack(weight)
    assert is_blocked(blocked) and blocked.shape == (3, 80, 64)
    assert torch.equal(unblocked(blocked), weight)
    x = torch.randn(rows, 80)
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear(x, blocked, b), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


def test_the_kernel_and_onednn_both_run_where_they_should(gemv: object) -> None:
    blocked = pack(torch.randn(128, 64))
    for rows, op in [(4, "compiled_engine::blocked_gemv_f32"), (5, "mkldnn::_linear_pointwise")]:
        with torch.profiler.profile() as prof:
            packed_linear(torch.randn(rows, 64), blocked, None)
        assert op in {event.key for event in prof.key_averages()}


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
    weight = torch.randn(128, 48)
    expected = weight.clone()
    before = packed_bytes()
    blocked = pack(weight)
    assert packed_bytes() == before  # no copy beside the weight
    del weight
    gc.collect()
    junk = [torch.randn(128, 48) for _ in range(64)]  # reuse freed memory, if any was freed
    assert torch.equal(unblocked(blocked), expected)
    del junk
    rows = torch.tensor([0, 63, 64, 127, 5])
    assert torch.equal(blocked_rows(blocked, rows), expected[rows])


def test_the_kernel_refuses_what_it_does_not_take(gemv: torch._ops.OpOverload) -> None:
    blocked = pack(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="takes 1 to 4 rows, got 5"):
        gemv(torch.randn(5, 32), blocked, None)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[rows, 32\]"):
        gemv(torch.randn(2, 31), blocked, None)
    with pytest.raises(RuntimeError, match=r"bias must be float32 \[64\]"):
        gemv(torch.randn(2, 32), blocked, torch.randn(63))
    with pytest.raises(RuntimeError, match="must be a contiguous float32"):
        gemv(torch.randn(2, 32), torch.randn(64, 32), None)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_a_weight_that_is_not_whole_blocks_keeps_a_copy_beside_it(rows: int, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 80)
    packing._warned.clear()
    with caplog.at_level(logging.WARNING, logger=packing.__name__):
        held = pack(weight)
    assert held is weight and has_packed_copy(weight)
    assert "96 output rows are not whole blocks of 64" in caplog.text
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
    other = torch.ops.mkldnn._reorder_linear_weight(weight.flip(1).contiguous())  # the view reads it wrong
    assert packing._why_not_blocked(weight, other) == "oneDNN chose another layout on this CPU"
    narrow = torch.randn(64, 13)  # oneDNN pads the input dimension to a multiple of 16 here
    assert packing._why_not_blocked(narrow, torch.ops.mkldnn._reorder_linear_weight(narrow)) == (
        "oneDNN padded the packed weight"
    )
    assert packing._why_not_blocked(weight, torch.ops.mkldnn._reorder_linear_weight(weight)) is None


def test_an_unpacked_weight_takes_the_plain_product() -> None:
    weight = torch.randn(16, 8)
    assert not has_packed_copy(weight) and not is_blocked(weight)
    x = torch.randn(3, 8)
    assert torch.equal(packed_linear(x, weight, None), F.linear(x, weight))


def test_packing_refuses_what_onednn_does_not_run_here() -> None:
    with pytest.raises(ValueError, match=r"cannot pack a torch\.bfloat16 weight"):
        pack(torch.randn(4, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("tied", [False, True])
def test_the_compiled_model_holds_each_weight_once_packed_and_the_eager_one_dense(
    tiny_model_factory: Callable[..., Path], tied: bool, gemv: object
) -> None:
    model_dir = tiny_model_factory("qwen3", max_position_embeddings=64, tie_word_embeddings=tied)

    def build(compiled: bool) -> tuple[ModelRunner, list[Linear]]:
        runner = ModelRunner(
            model_dir, EngineConfig(model=str(model_dir), enforce_eager=not compiled, kv_cache_memory_gib=0.02)
        )
        return runner, [m for layer in runner.model.layers for m in layer.modules() if isinstance(m, Linear)]

    eager_runner, eager = build(compiled=False)
    assert not any(isinstance(m, CpuLinear) for m in [*eager, eager_runner.model.lm_head])
    runner, compiled = build(compiled=True)
    model = runner.model
    layers_and_head = [*compiled, model.lm_head]
    for module in layers_and_head:
        assert isinstance(module, CpuLinear) and module.blocked is not None and is_blocked(module.blocked)
        assert "weight" not in dict(module.named_parameters())
    # one copy: the compiled model's tensors take the bytes of the eager model's
    assert runner.weight_bytes == eager_runner.weight_bytes
    assert isinstance(model.embed_tokens, BlockedEmbedding) == tied
    if tied:
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
    # oneDNN, three through the native kernel
    for tokens, op in [(5, "mkldnn::_linear_pointwise"), (3, "compiled_engine::blocked_gemv_f32")]:
        with torch.profiler.profile() as prof:
            runner.hidden_states(StepInputs(list(range(3, 3 + tokens)), list(range(tokens)), [tokens], [tokens], [[0]]))
        ops = {event.key: event.count for event in prof.key_averages()}
        assert ops.get(op, 0) == len(compiled)
