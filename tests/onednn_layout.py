"""What this machine's oneDNN does with an fp32 weight, read before a test asserts the behaviour
that follows from it: the block width of its packed layout is oneDNN's choice per shape and per
CPU, so no test may assume one."""

from __future__ import annotations

import torch

from compiled_engine.linear.packed_cpu import blocked_gemv_operator, blocked_width


def this_machines_width(weight: torch.Tensor) -> int | str:
    """The block width oneDNN packs `weight` with here, or why it cannot be read as blocks."""
    return blocked_width(weight, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))


def packs_as_one_copy(weight: torch.Tensor) -> bool:
    """Whether `pack` holds `weight` as one blocked copy on this machine (else two copies)."""
    return blocked_gemv_operator() is not None and isinstance(this_machines_width(weight), int)
