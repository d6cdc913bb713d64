"""LoRA on the model's products, applied from outside the model file.

`install_lora` wraps each decoder layer's four products (qkv, o, gate_up, down) in a
`LoRALinear`: the base product plus LoRA's operator (`lora_delta`, linear/lora_op.py), which adds
each token's adapter delta. The adapters sit in device slots, buffers of a fixed shape, zero where
an adapter's rank is smaller or it leaves a product (or a piece of one) alone, so the compiled
graphs take them as inputs and never recompile when adapters load or the batch's mix changes:

- `a` [slots, pieces x rank, in]: piece p's A in rows [p x rank, p x rank + its rank);
- `b` [slots, rank, out], B transposed: output column o of piece p takes piece p's hidden rank
  rows only, so a fused product costs what its pieces do, not a block-diagonal
  [out, pieces x rank] product.

Which slot each token of a forward uses is one more buffer, `token_slots` (-1: the base model),
written by the runner before each forward and shared by every product.

`LoRALinear` wraps whatever kernel the kernel table installed (linear/table.py), and asks it
nothing of its kind: a kernel with an operator of its own for its product plus the delta says so
(`fuses_lora`) and runs it (`lora_forward`). The quantized kernel (a GGUF model's) does, with
`quantized_lora_linear` (linear/lora_op.py).
"""

from __future__ import annotations

import math
from typing import Protocol, cast

import torch
from torch import nn

from compiled_engine.linear.lora_op import StoreView, lora_delta, native_lora_kernel
from compiled_engine.lora.adapter import PRODUCTS, LoRAAdapter, product_shapes
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.layers import DecoderModel


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
        delta = lora_delta(x, self.lora_a, self.lora_b, self.token_slots, self.widths)
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
            if not hasattr(block, product_name):  # a mixture of experts: its adapters are refused (lora/adapter.py)
                continue
            wrapped = LoRALinear(
                getattr(block, product_name), shapes[name][1], a_store, a_views[name], b_store, b_views[name],
                token_slots,
            )  # fmt: skip
            setattr(block, product_name, wrapped)
            products[(index, name)] = wrapped
    return LoRASlots(products, num_slots, max_rank, token_slots)
