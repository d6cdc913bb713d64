"""Attention as one opaque operator, so torch.compile traces the model without graph breaks.

The model calls `paged_attention(q, k, v, kv_cache, scale, window, soft_cap, sinks)`: its layer's
sliding window and logit soft-cap (0: none; see `LayerKind` in attention/backend.py), and its
attention sinks (None: none; gpt-oss's learned logit per query head, see AttentionBackend). They
are each layer's own, so they are arguments of the operator rather than part of the plan. What the operator needs besides its tensors (the backend, and the plan the backend
prepared for this batch) is set once per forward by the runner with
`attention_forward(backend, plan)`, outside any compiled region. Neither Dynamo nor the model
ever sees the plan: batch composition changes neither the traced graph nor its guards, and the
token count is the only shape that varies.

On the CPU the operator can have a native kernel (attention/kernels/paged_decode_op.cpp, loaded
by the cpu backend): when the backend's plan is one that kernel runs (`native_plan`: every
sequence decoding or verifying a few tokens), `attention_forward` installs it there and every
layer's call stays in C++; any other call goes on to `paged_attention_planned`, the Python
implementation below, which asks the backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from compiled_engine.attention.backend import AttentionBackend
from compiled_engine.attention.native_decode import install_plan


@dataclass(frozen=True)
class _Forward:
    backend: AttentionBackend[Any]
    plan: Any  # the backend's own plan type


_current: _Forward | None = None


@contextmanager
def attention_forward(backend: AttentionBackend[Any], plan: Any) -> Iterator[None]:
    """Every `paged_attention` call inside this block attends with `backend` by `plan`
    (`backend.prepare(...)` or, inside a CUDA-graph capture, `backend.prepare_graph(...)`)."""
    global _current
    previous, _current = _current, _Forward(backend, plan)
    install_plan(backend.native_plan(plan))
    try:
        yield
    finally:
        _current = previous
        install_plan(None if previous is None else previous.backend.native_plan(previous.plan))


# The operator is declared with a schema and a plain kernel (torch.library.define / impl) rather
# than torch.library.custom_op: custom_op wraps each call in Python autograd and aliasing checks,
# paid once per layer per step (docs/benchmarks.md has the cost). The schema declares no
# mutation of kv_cache, though the kernel writes the new K/V into it: inside the decoder layer's
# nested compile region, functionalization refuses a custom operator that mutates its input. It
# is safe because nothing else in the graph reads or writes the pages: each layer's operator is
# the only user of its layer's slice, and data dependencies keep the layers in order.
_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor kv_cache, float scale, int window=0, float soft_cap=0.0, "
    "Tensor? sinks=None) -> Tensor"
)
torch.library.define("compiled_engine::paged_attention", _SCHEMA)
torch.library.define("compiled_engine::paged_attention_planned", _SCHEMA)


def _paged_attention_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if _current is None:
        raise RuntimeError("paged_attention called outside attention_forward(...)")
    return _current.backend.forward(q, k, v, kv_cache, _current.plan, scale, window, soft_cap, sinks)


for _name in ("compiled_engine::paged_attention", "compiled_engine::paged_attention_planned"):
    torch.library.impl(_name, "CompositeExplicitAutograd")(_paged_attention_kernel)


def _paged_attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(q)


for _name in ("compiled_engine::paged_attention", "compiled_engine::paged_attention_planned"):
    torch.library.register_fake(_name)(_paged_attention_fake)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write k, v into `kv_cache` (one layer's pages) and attend; see AttentionBackend.
    q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]; returns q's shape.
    `window` (0: every earlier token), `soft_cap` (0.0: none) and `sinks` ([heads] fp32, one
    logit per query head; None: none) are this layer's."""
    return torch.ops.compiled_engine.paged_attention(q, k, v, kv_cache, scale, window, soft_cap, sinks)
