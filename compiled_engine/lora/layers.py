"""LoRA on the model's products, applied from outside the model file.

`install_lora` wraps each decoder layer's four products (qkv, o, gate_up, down) in a
`LoRALinear`: the base product plus the opaque operator `compiled_engine::lora_delta`, which adds
`b @ (a @ x)` for the tokens of each sequence that uses an adapter. The adapters sit in device
slots, buffers of a fixed shape ([slots, rank, in] and [slots, out, rank], zero where an
adapter's rank is smaller or it leaves a product alone), so the compiled graphs take them as
inputs and never recompile when adapters load or the batch's mix changes.

Which tokens use which slot is the runner's per-forward `LoRAPlan`, set around the forward with
`lora_forward` as the attention plan is: contiguous runs of tokens (one sequence's new tokens are
contiguous in the flat batch), each multiplied by its slot's matrices in two small products,
never a per-token gather of whole adapter matrices.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import nn

from compiled_engine.lora.adapter import PRODUCTS, LoRAAdapter, product_shapes
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.llama import Transformer
from compiled_engine.native_build import KernelBuildError, TorchOperatorLibrary

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAPlan:
    """One forward's runs of tokens that use an adapter: (first token, end token, slot)."""

    segments: tuple[tuple[int, int, int], ...]

    @classmethod
    def from_slots(cls, query_lens: list[int], slots: list[int]) -> LoRAPlan:
        """`slots[s]`: the slot of sequence s's adapter, or -1 for the base model. Neighbouring
        sequences on the same slot make one run."""
        segments: list[tuple[int, int, int]] = []
        start = 0
        for count, slot in zip(query_lens, slots, strict=True):
            if slot >= 0:
                if segments and segments[-1][2] == slot and segments[-1][1] == start:
                    segments[-1] = (segments[-1][0], start + count, slot)
                else:
                    segments.append((start, start + count, slot))
            start += count
        return cls(tuple(segments))

    def runs(self) -> torch.Tensor:
        return torch.tensor(self.segments, dtype=torch.int64).reshape(-1, 3)


_current: LoRAPlan | None = None
_NO_RUNS = torch.zeros(0, 3, dtype=torch.int64)
_native_plan: Callable[[torch.Tensor], None] | None = None  # the C++ kernel's plan, once install_lora loaded it


@contextmanager
def lora_forward(plan: LoRAPlan | None) -> Iterator[None]:
    """Every `lora_delta` inside this block adds the adapters of `plan` (None: none)."""
    global _current
    previous, _current = _current, plan
    native = _native_plan
    if native is not None:
        native(plan.runs() if plan is not None else _NO_RUNS)
    try:
        yield
    finally:
        _current = previous
        if native is not None:
            native(previous.runs() if previous is not None else _NO_RUNS)


torch.library.define("compiled_engine::lora_delta", "(Tensor x, Tensor a, Tensor b) -> Tensor")


def reference_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The operator in plain torch, by the current plan: the kernel on devices without the
    native one, and its slow twin."""
    out = x.new_zeros(x.shape[0], b.shape[1])
    if _current is not None:
        for start, end, slot in _current.segments:
            out[start:end] = (x[start:end] @ a[slot].T) @ b[slot].T
    return out


torch.library.impl("compiled_engine::lora_delta", "CompositeExplicitAutograd")(reference_lora_delta)


@torch.library.register_fake("compiled_engine::lora_delta")
def _lora_delta_fake(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], b.shape[1])


NATIVE_KERNEL = TorchOperatorLibrary(Path(__file__).with_name("kernels") / "lora_op.cpp", None, "native LoRA operator")


@cache
def native_lora_kernel() -> Callable[[torch.Tensor], None] | None:
    """Registers the C++ CPU kernel of `lora_delta` and returns its plan setter, or None (with
    one warning saying why) when it cannot be built: the Python kernel above then runs."""
    try:
        NATIVE_KERNEL.load()
    except KernelBuildError as error:
        logger.warning("LoRA products run through Python (slower per call), because %s", error)
        return None
    setter: Callable[[torch.Tensor], None] = torch.ops.compiled_engine_lora.set_plan.default
    return setter


class LoRALinear(nn.Module):
    """A product with adapter slots: base(x) plus each token's adapter delta."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(self, base: nn.Module, in_features: int, out_features: int, slots: int, rank: int) -> None:
        super().__init__()
        self.base = base
        tensors = [*base.parameters(), *base.buffers()]
        device = tensors[0].device if tensors else None
        self.register_buffer("lora_a", torch.zeros(slots, rank, in_features, device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots, out_features, rank, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        return y + torch.ops.compiled_engine.lora_delta(x, self.lora_a, self.lora_b).to(y.dtype)


class LoRASlots:
    """The model's adapter slots: `load(slot, adapter)` writes an adapter into every product's
    slot (zeros where it has no weights), `clear(slot)` empties one."""

    def __init__(self, products: dict[tuple[int, str], LoRALinear], num_slots: int, max_rank: int) -> None:
        self.products = products
        self.num_slots = num_slots
        self.max_rank = max_rank

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        with torch.no_grad():
            for key, product in self.products.items():
                product.lora_a[slot].zero_()
                product.lora_b[slot].zero_()
                weights = adapter.weights.get(key)
                if weights is not None:
                    rank = weights.a.shape[0]
                    product.lora_a[slot, :rank].copy_(weights.a)
                    product.lora_b[slot, :, :rank].copy_(weights.b)

    def clear(self, slot: int) -> None:
        with torch.no_grad():
            for product in self.products.values():
                product.lora_a[slot].zero_()
                product.lora_b[slot].zero_()


def install_lora(model: Transformer, config: ModelConfig, num_slots: int, max_rank: int) -> LoRASlots:
    """Wrap every decoder layer's products in LoRALinear with `num_slots` empty slots. A fused
    product's slots hold its pieces' ranks side by side: up to pieces x `max_rank`."""
    global _native_plan
    _native_plan = native_lora_kernel()  # registered before anything traces the products
    shapes = product_shapes(config)
    products: dict[tuple[int, str], LoRALinear] = {}
    for index, layer in enumerate(model.layers):
        for name in PRODUCTS:
            block_name, product_name = name.split(".")
            block = getattr(layer, block_name)
            in_features, widths = shapes[name]
            wrapped = LoRALinear(
                getattr(block, product_name), in_features, sum(widths), num_slots, len(widths) * max_rank
            )
            setattr(block, product_name, wrapped)
            products[(index, name)] = wrapped
    return LoRASlots(products, num_slots, max_rank)
