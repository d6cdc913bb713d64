"""LoRA on the model's products, applied from outside the model file.

`install_lora` wraps each decoder layer's four products (qkv, o, gate_up, down) in a
`LoRALinear`: the base product plus the opaque operator `compiled_engine::lora_delta`, which adds
each token's adapter delta. The adapters sit in device slots, buffers of a fixed shape, zero where
an adapter's rank is smaller or it leaves a product (or a piece of one) alone, so the compiled
graphs take them as inputs and never recompile when adapters load or the batch's mix changes:

- `a` [slots, pieces x rank, in]: piece p's A in rows [p x rank, p x rank + its rank);
- `b` [slots, rank, out], B transposed: output column o of piece p takes piece p's hidden rank
  rows only, so a fused product costs what its pieces do, not a block-diagonal
  [out, pieces x rank] product.

Which slot each token of a forward uses is one more buffer, `token_slots` (-1: the base model),
written by the runner before each forward and shared by every product. The operator is thus a
function of its inputs, and a CUDA graph replays it with the slots of the batch in that static
buffer. Kernels: on the CPU a C++ one (`kernels/lora_op.cpp`): up to 32 tokens a slot (decode)
run as vector loops on every thread, more (prefill) as two small products per slot on its tokens
(contiguous runs, or one gather), never a per-token gather of whole adapter matrices; on CUDA
`dense_lora_delta`, two products over every slot with the other slots' columns masked to zero,
which needs no host decision and so captures into a graph. Both are tested against
`reference_lora_delta`.

`LoRALinear` wraps whatever kernel the product table installed (products/table.py), and asks it
nothing of its kind: a kernel with an operator of its own for its product plus the delta says so
(`fuses_lora`) and runs it (`lora_forward`). The quantized kernel (a GGUF model's) does, with
`quantized_lora_linear_f32` (declared here, beside its C++ kernel), which saves an operator call,
a zeroed delta and a sum per product; up to 32 tokens it runs the product's strips and the slots'
rank rows in one parallel region, each thread reading its share of A and B front to back.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn

from compiled_engine.lora.adapter import PRODUCTS, LoRAAdapter, product_shapes
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.layers import DecoderModel
from compiled_engine.native_build import KernelBuildError, TorchOperatorLibrary
from compiled_engine.quantization.ops import reference_linear

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
    "Tensor a_store, Tensor b_store, Tensor token_slots, int a_start, int b_start, int slots, int rank, int[] widths) "
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
    base = reference_linear(x, data, scales, offsets, bias, group_size)
    a = StoreView(a_start, (slots, len(widths) * rank, x.shape[1])).of(a_store)
    b = StoreView(b_start, (slots, rank, base.shape[1])).of(b_store)
    return base + reference_lora_delta(x, a, b, token_slots, widths)


torch.library.impl("compiled_engine::quantized_lora_linear_f32", "CompositeExplicitAutograd")(
    reference_quantized_lora_linear
)


@torch.library.register_fake("compiled_engine::quantized_lora_linear_f32")
def _quantized_lora_linear_fake(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    max_kernel_rows: int,
    a_store: torch.Tensor,
    b_store: torch.Tensor,
    token_slots: torch.Tensor,
    a_start: int,
    b_start: int,
    slots: int,
    rank: int,
    widths: Sequence[int],
) -> torch.Tensor:
    return x.new_empty(x.shape[0], data.shape[0])


# The quantized products' C kernels are linked in too: a decode-sized product and its delta run in
# one parallel region (kernels/lora_op.cpp).
NATIVE_KERNEL = TorchOperatorLibrary(
    Path(__file__).with_name("kernels") / "lora_op.cpp",
    Path(__file__).parents[1] / "quantization" / "kernels" / "quant_matmul.c",
    "native LoRA operator",
)


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


class FusesLoRA(Protocol):
    """A kernel that runs its product and the adapters' delta as one operator (CPU, fp32, 2-D)."""

    def lora_forward(self, x: torch.Tensor, lora: LoRALinear) -> torch.Tensor: ...


class LoRALinear(nn.Module):
    """A product with adapter slots: base(x) plus each token's adapter delta. A base kernel with
    an operator of its own for both (`fuses_lora`, `lora_forward`: the quantized kernel's) runs
    that instead, when the LoRA kernel is native too.

    The slots (`lora_a`, `lora_b`) are views of two flat stores shared by the layer's products,
    so that a compiled forward takes two tensors a layer for them, not eight (each input of a
    compiled graph costs its call a few microseconds)."""

    a_store: torch.Tensor
    b_store: torch.Tensor
    token_slots: torch.Tensor

    def __init__(
        self,
        base: nn.Module,
        widths: list[int],
        a_store: torch.Tensor,
        a_view: StoreView,
        b_store: torch.Tensor,
        b_view: StoreView,
        token_slots: torch.Tensor,
    ) -> None:
        super().__init__()
        self.base = base
        self.widths = widths
        self.a_view, self.b_view = a_view, b_view
        self.register_buffer("a_store", a_store, persistent=False)  # shared by the layer's products
        self.register_buffer("b_store", b_store, persistent=False)
        self.register_buffer("token_slots", token_slots, persistent=False)  # shared by every product
        self.fused = bool(getattr(base, "fuses_lora", False)) and native_lora_kernel()

    @property
    def lora_a(self) -> torch.Tensor:
        """[slots, pieces x rank, in]"""
        return self.a_view.of(self.a_store)

    @property
    def lora_b(self) -> torch.Tensor:
        """[slots, rank, out], B transposed"""
        return self.b_view.of(self.b_store)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu":
            return cast(FusesLoRA, self.base).lora_forward(x, self)
        y: torch.Tensor = self.base(x)
        delta = torch.ops.compiled_engine.lora_delta(x, self.lora_a, self.lora_b, self.token_slots, self.widths)
        return y + delta.to(y.dtype)


class LoRASlots:
    """The model's adapter slots: `load(slot, adapter)` writes an adapter into every product's
    slot (zeros where it has no weights), `clear(slot)` empties one, and `set_tokens` says which
    slot each token of the next forward uses."""

    def __init__(
        self, products: dict[tuple[int, str], LoRALinear], num_slots: int, max_rank: int, token_slots: torch.Tensor
    ) -> None:
        self.products = products
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.token_slots = token_slots

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        rank = self.max_rank
        with torch.no_grad():
            for key, product in self.products.items():
                product.lora_a[slot].zero_()
                product.lora_b[slot].zero_()
                starts = [sum(product.widths[:i]) for i in range(len(product.widths))]
                for piece in adapter.weights.get(key, ()):
                    piece_rank = piece.a.shape[0]
                    row, width = starts[piece.piece], product.widths[piece.piece]
                    product.lora_a[slot, piece.piece * rank : piece.piece * rank + piece_rank].copy_(piece.a)
                    product.lora_b[slot, :piece_rank, row : row + width].copy_(piece.b.T)

    def clear(self, slot: int) -> None:
        with torch.no_grad():
            for product in self.products.values():
                product.lora_a[slot].zero_()
                product.lora_b[slot].zero_()

    def set_tokens(self, query_lens: list[int], seq_slots: list[int] | None, padded_tokens: int = 0) -> None:
        """The next forward's tokens: sequence s runs `query_lens[s]` of them on slot
        `seq_slots[s]` (-1 or None: the base model); tokens past the batch up to
        `padded_tokens` (a CUDA graph's padding rows) use none."""
        slots = seq_slots if seq_slots is not None else [-1] * len(query_lens)
        per_token = [slot for count, slot in zip(query_lens, slots, strict=True) for _ in range(count)]
        tokens = max(len(per_token), padded_tokens)
        if tokens > self.token_slots.numel():
            raise ValueError(f"a forward of {tokens} tokens exceeds the {self.token_slots.numel()} the LoRA slots hold")
        per_token += [-1] * (tokens - len(per_token))
        self.token_slots[:tokens].copy_(torch.tensor(per_token, dtype=torch.int64))


def install_lora(
    model: DecoderModel, config: ModelConfig, num_slots: int, max_rank: int, max_tokens: int, dtype: torch.dtype
) -> LoRASlots:
    """Wrap every decoder layer's products in LoRALinear with `num_slots` empty slots of
    `max_rank` per piece, in `dtype` (the activations'), for forwards of up to `max_tokens`."""
    native_lora_kernel()  # registered before anything traces the products
    device = model.norm.weight.device
    token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
    shapes = product_shapes(config)
    a_views: dict[str, StoreView] = {}
    b_views: dict[str, StoreView] = {}
    a_size = b_size = 0
    for name in PRODUCTS:
        in_features, widths = shapes[name]
        a_views[name] = StoreView(a_size, (num_slots, len(widths) * max_rank, in_features))
        b_views[name] = StoreView(b_size, (num_slots, max_rank, sum(widths)))
        a_size += math.prod(a_views[name].shape)
        b_size += math.prod(b_views[name].shape)
    products: dict[tuple[int, str], LoRALinear] = {}
    for index, layer in enumerate(model.layers):
        a_store = torch.zeros(a_size, dtype=dtype, device=device)
        b_store = torch.zeros(b_size, dtype=dtype, device=device)
        for name in PRODUCTS:
            block_name, product_name = name.split(".")
            block = getattr(layer, block_name)
            wrapped = LoRALinear(
                getattr(block, product_name), shapes[name][1], a_store, a_views[name], b_store, b_views[name],
                token_slots,
            )  # fmt: skip
            setattr(block, product_name, wrapped)
            products[(index, name)] = wrapped
    return LoRASlots(products, num_slots, max_rank, token_slots)
