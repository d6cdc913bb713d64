"""oneDNN-packed weights for the CPU products of a few rows (batched decode, small prefills).

For a few rows, oneDNN's linear on a weight reordered once into its blocked layout runs the
decoder layer's products faster than F.linear on the CPU; for many rows the two are even
(figures in docs/benchmarks.md, "Compiled path on CPU, second round"). Inductor only uses these kernels
when it freezes the weights into constants, which would give every layer its own compiled graph,
so the compiled layer calls them through the opaque operator `compiled_engine::packed_linear`,
which finds the packed copy of the weight it is given. The packed copies (layers and head) are
kept beside the dense weights (which one-token products and the eager model read), so packing
costs one more copy of those weights in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

# weight Parameter -> its oneDNN-packed copy; entries go with their weights.
_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> None:
    """Keep a oneDNN-packed copy of `weight` ([out, in], fp32, CPU) for `packed_linear`."""
    if not can_pack(weight):
        raise ValueError(f"cannot pack a {weight.dtype} weight on {weight.device} for oneDNN")
    _packed[weight] = torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_bytes() -> int:
    """Bytes held by the packed copies of this process (each beside its original weight)."""
    return sum(packed.numel() * packed.element_size() for packed in list(_packed.values()))


def is_packed(weight: torch.Tensor) -> bool:
    return weight in _packed


torch.library.define("compiled_engine::packed_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


@torch.library.impl("compiled_engine::packed_linear", "CompositeExplicitAutograd")
def _packed_linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = _packed.get(weight)
    if packed is None:  # not packed (or packed for another tensor): the plain product
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.register_fake("compiled_engine::packed_linear")
def _packed_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D x, through the packed copy of `weight` when there is one."""
    return torch.ops.compiled_engine.packed_linear(x, weight, bias)
