"""LoRA's operators: `compiled_engine::lora_delta`, each token's adapter delta on a product, and
`compiled_engine::quantized_lora_linear_f32`, a quantized product plus that delta in one call. The
LoRA modules (lora/layers.py) and the quantized kernel (linear/quantized.py) call them through
`lora_delta` and `quantized_lora_linear` here.

The adapters sit in slots of a fixed shape (lora/layers.py): `a` [slots, pieces x rank, in] and
`b` [slots, rank, out] (B transposed), and `token_slots[t]` is token t's slot (-1: the base
model). The operator is thus a function of its inputs, and a CUDA graph replays it with the slots
of the batch in that static buffer. Kernels: on the CPU a C++ one (`kernels/lora_op.cpp`): up to
32 tokens a slot (decode) run as vector loops on every thread, more (prefill) as two small
products per slot on its tokens (contiguous runs, or one gather), never a per-token gather of
whole adapter matrices; on CUDA `dense_lora_delta`, two products over every slot with the other
slots' columns masked to zero, which needs no host decision and so captures into a graph. Both
are tested against `reference_lora_delta`.

The fused quantized operator saves an operator call, a zeroed delta and a sum per product; up to
32 tokens it runs the product's strips and the slots' rank rows in one parallel region, each
thread reading its share of A and B front to back.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import torch

from compiled_engine.linear.crossover import RowCrossover
from compiled_engine.linear.quantized_op import reference_linear
from compiled_engine.linear.quantized_weight import QuantizedWeight
from compiled_engine.native_build import KernelBuildError, TorchOperatorLibrary

logger = logging.getLogger(__name__)


def token_runs(token_slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """The runs of neighbouring tokens on one slot, (first token, end token, slot); tokens on
    the base model (-1) are in none."""
    runs: list[tuple[int, int, int]] = []
    for token, slot in enumerate(token_slots):
        if slot < 0:
            continue
        if runs and runs[-1][2] == slot and runs[-1][1] == token:
            runs[-1] = (runs[-1][0], token + 1, slot)
        else:
            runs.append((token, token + 1, slot))
    return runs


@dataclass(frozen=True)
class StoreView:
    """Where one product's slots sit in its layer's flat store: elements [start, start + their
    count), viewed as `shape`. Every layer lays its products out alike, so the layers' compiled
    code is one."""

    start: int
    shape: tuple[int, ...]

    def of(self, store: torch.Tensor) -> torch.Tensor:
        return store[self.start : self.start + math.prod(self.shape)].view(self.shape)


torch.library.define(
    "compiled_engine::lora_delta", "(Tensor x, Tensor a, Tensor b, Tensor token_slots, int[] widths) -> Tensor"
)


def reference_lora_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, widths: Sequence[int]
) -> torch.Tensor:
    """The operator in plain torch, run by run: `x` [tokens, in], `a` and `b` as the slots hold
    them, `token_slots[t]` token t's slot (-1: none), `widths` the output rows of each piece.
    The slow twin of both kernels."""
    out = x.new_zeros(x.shape[0], b.shape[2])
    rank = b.shape[1]
    for start, end, slot in token_runs(token_slots[: x.shape[0]].tolist()):
        hidden = x[start:end] @ a[slot].T
        row = 0
        for piece, width in enumerate(widths):
            columns = hidden[:, piece * rank : (piece + 1) * rank]
            out[start:end, row : row + width] = columns @ b[slot, :, row : row + width]
            row += width
    return out


def dense_lora_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, widths: Sequence[int]
) -> torch.Tensor:
    """The operator as products over all slots at once, each token's hidden columns of other
    slots masked to zero: no host work, so it captures into a CUDA graph. Costs every slot's
    weights per call, which on a GPU's bandwidth is small beside the base model's."""
    tokens = x.shape[0]
    num_slots, piece_ranks, _ = a.shape
    rank = b.shape[1]
    hidden = x @ a.reshape(num_slots * piece_ranks, -1).T  # [tokens, slots x pieces x rank]
    owner = torch.arange(num_slots, device=x.device).repeat_interleave(piece_ranks)
    hidden = hidden * (token_slots[:tokens, None] == owner).to(hidden.dtype)
    by_slot = hidden.view(tokens, num_slots, len(widths), rank).transpose(0, 1)  # [slots, tokens, pieces, rank]
    parts, row = [], 0
    for piece, width in enumerate(widths):
        # every slot's product, summed: a token's other slots contribute exact zeros
        parts.append(torch.bmm(by_slot[:, :, piece], b[:, :, row : row + width]).sum(0))
        row += width
    return torch.cat(parts, dim=1)


torch.library.impl("compiled_engine::lora_delta", "CompositeExplicitAutograd")(reference_lora_delta)

torch.library.impl("compiled_engine::lora_delta", "CUDA")(dense_lora_delta)


@torch.library.register_fake("compiled_engine::lora_delta")
def _lora_delta_fake(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, widths: Sequence[int]
) -> torch.Tensor:
    return x.new_empty(x.shape[0], b.shape[2])


torch.library.define(
    "compiled_engine::quantized_lora_linear_f32",
    "(Tensor x, Tensor data, Tensor scales, Tensor? offsets, Tensor? bias, int group_size, int max_kernel_rows, "
    "int gemm_max_rows, Tensor a_store, Tensor b_store, Tensor token_slots, int a_start, int b_start, int slots, int rank, int[] widths) "
    "-> Tensor",
)


def reference_quantized_lora_linear(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    max_kernel_rows: int,
    gemm_max_rows: int,
    a_store: torch.Tensor,
    b_store: torch.Tensor,
    token_slots: torch.Tensor,
    a_start: int,
    b_start: int,
    slots: int,
    rank: int,
    widths: Sequence[int],
) -> torch.Tensor:
    """A quantized product plus its adapters' delta, in one operator: the native kernel runs both
    in one call (the product through `quantized_linear_f32`); this is its slow twin. The slots
    are read from the layer's flat stores: `a` [slots, pieces x rank, in] from element
    `a_start` of `a_store`, `b` [slots, rank, out] from `b_start` of `b_store`."""
    base = reference_linear(x, QuantizedWeight.of_tensors(data, scales, offsets, group_size), bias)
    a = StoreView(a_start, (slots, len(widths) * rank, x.shape[1])).of(a_store)
    b = StoreView(b_start, (slots, rank, base.shape[1])).of(b_store)
    return base + reference_lora_delta(x, a, b, token_slots, widths)


torch.library.impl("compiled_engine::quantized_lora_linear_f32", "CompositeExplicitAutograd")(
    reference_quantized_lora_linear
)


@torch.library.register_fake("compiled_engine::quantized_lora_linear_f32")
def _quantized_lora_linear_fake(x: torch.Tensor, data: torch.Tensor, *shapeless: Any) -> torch.Tensor:
    # the output's shape is x's rows by the weight's: the other arguments do not change it
    return x.new_empty(x.shape[0], data.shape[0])


# The quantized products' C kernels are linked in too: a decode-sized product and its delta run in
# one parallel region (kernels/lora_op.cpp).
_KERNELS = Path(__file__).with_name("kernels")
NATIVE_KERNEL = TorchOperatorLibrary(_KERNELS / "lora_op.cpp", _KERNELS / "quant_matmul.c", "native LoRA operator")


@cache
def native_lora_kernel() -> bool:
    """Registers the C++ CPU kernel of `lora_delta`; False (with one warning saying why) when it
    cannot be built: the Python kernel above then runs."""
    try:
        NATIVE_KERNEL.load()
    except KernelBuildError as error:
        logger.warning("LoRA products run through Python (slower per call), because %s", error)
        return False
    return True


def lora_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, widths: Sequence[int]
) -> torch.Tensor:
    """Each token's adapter delta: `x` [tokens, in], `a` and `b` its product's slots."""
    delta: torch.Tensor = torch.ops.compiled_engine.lora_delta(x, a, b, token_slots, widths)
    return delta


class LoRAStores(Protocol):
    """What `quantized_lora_linear` reads of a LoRALinear (lora/layers.py): its layer's flat slot
    stores, where this product's pieces sit in them, and each token's slot."""

    a_store: torch.Tensor
    b_store: torch.Tensor
    token_slots: torch.Tensor
    a_view: StoreView
    b_view: StoreView
    widths: list[int]


def quantized_lora_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, lora: LoRAStores, crossover: RowCrossover
) -> torch.Tensor:
    """x @ weight.T + bias plus each token's adapter delta, in one native call, reading the slots
    from the layer's flat stores as they are; the product changes kernels at `crossover`'s rows."""
    slots, rank, _ = lora.b_view.shape
    out: torch.Tensor = torch.ops.compiled_engine.quantized_lora_linear_f32(
        x, weight.data, weight.scales, weight.offsets, bias, weight.group_size, crossover.direct_max_rows,
        crossover.gemm_max_rows, lora.a_store, lora.b_store, lora.token_slots, lora.a_view.start, lora.b_view.start, slots, rank, lora.widths,
    )  # fmt: skip
    return out
