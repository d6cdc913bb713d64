"""oneDNN-packed weights (model/packed_linear.py): the fast CPU product of a few rows against its
slow twin, F.linear, and which weights the compiled model packs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from compiled_engine.config import EngineConfig
from compiled_engine.engine.compilation import CpuLinear
from compiled_engine.engine.model_runner import ModelRunner
from compiled_engine.engine.step_inputs import StepInputs
from compiled_engine.model.llama import Linear
from compiled_engine.model.packed_linear import is_packed, pack, packed_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


@pytest.mark.parametrize("rows", [2, 8, 33, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 80)
    b = torch.randn(96) if bias else None
    pack(weight)
    assert is_packed(weight)
    x = torch.randn(rows, 80)
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear(x, weight, b), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


def test_an_unpacked_weight_takes_the_plain_product() -> None:
    weight = torch.randn(16, 8)
    assert not is_packed(weight)
    assert not is_packed(weight.clone())
    x = torch.randn(3, 8)
    assert torch.equal(packed_linear(x, weight, None), F.linear(x, weight))


def test_packing_refuses_what_onednn_does_not_run_here() -> None:
    with pytest.raises(ValueError, match=r"cannot pack a torch\.bfloat16 weight"):
        pack(torch.randn(4, 4, dtype=torch.bfloat16))


def test_the_compiled_model_packs_its_layer_and_head_weights_and_the_eager_one_does_not(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model_dir = tiny_model_factory("qwen3", max_position_embeddings=64)

    def build(compiled: bool) -> tuple[ModelRunner, list[Linear]]:
        runner = ModelRunner(
            model_dir, EngineConfig(model=str(model_dir), enforce_eager=not compiled, kv_cache_memory_gib=0.02)
        )
        return runner, [m for layer in runner.model.layers for m in layer.modules() if isinstance(m, Linear)]

    runner, compiled = build(compiled=True)
    assert compiled and all(isinstance(m, CpuLinear) and m.packed and is_packed(m.weight) for m in compiled)
    head = runner.model.lm_head
    assert isinstance(head, CpuLinear) and head.packed and is_packed(head.weight)
    hidden = torch.randn(4, runner.model.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(
            runner.model.compute_logits(hidden), F.linear(hidden, head.weight), atol=1e-4, rtol=1e-5
        )
    # and the compiled graph for many tokens really runs the packed products
    with torch.profiler.profile() as prof:
        runner.hidden_states(StepInputs(list(range(3, 8)), list(range(5)), [5], [5], [[0]]))
    ops = {event.key: event.count for event in prof.key_averages()}
    assert ops.get("mkldnn::_linear_pointwise", 0) == len(compiled)
    eager_runner, eager = build(compiled=False)
    assert not any(isinstance(m, CpuLinear) or is_packed(m.weight) for m in [*eager, eager_runner.model.lm_head])
