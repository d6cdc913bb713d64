"""Which attention backend runs: the backends by name, the automatic choice for a device, and the
fallback to the torch backend, with one warning saying why, when the one asked for cannot run
this model here (never a silently wrong result).

A backend declares what it supports (`unsupported_reason`, `supports_cuda_graphs`,
`supports_sliding_window`, `supports_soft_cap`, `supports_sinks`) and how it is built (`create`); adding one is its
module plus its line in `REGISTRY`.
"""

from __future__ import annotations

import logging
from typing import Any

from compiled_engine.attention.backend import AttentionBackend, AttentionShape, BackendUnavailableError
from compiled_engine.attention.cpu_backend import CpuAttentionBackend
from compiled_engine.attention.flashinfer_backend import FlashInferAttentionBackend
from compiled_engine.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)

REGISTRY: dict[str, type[AttentionBackend[Any]]] = {
    backend.name: backend for backend in (TorchAttentionBackend, CpuAttentionBackend, FlashInferAttentionBackend)
}
BACKENDS = tuple(REGISTRY)
# Runs every model on every device: what a backend that cannot run falls back to.
FALLBACK: type[AttentionBackend[Any]] = TorchAttentionBackend
# The default per device type: FlashInfer on CUDA, the native CPU kernel anywhere else.
AUTO = {"cuda": FlashInferAttentionBackend.name}
AUTO_ELSEWHERE = CpuAttentionBackend.name


def layer_kinds_reason(backend: type[AttentionBackend[Any]], shape: AttentionShape) -> str | None:
    """Why `backend` cannot run the model's layer kinds (a sliding window, a logit soft-cap or
    attention sinks it does not implement), or None when it can: it would ignore them and attend
    wrongly."""
    windows = sorted({window for window, _ in shape.layer_kinds if window})
    caps = sorted({cap for _, cap in shape.layer_kinds if cap})
    if windows and not backend.supports_sliding_window:
        return f"the {backend.name} backend has no sliding-window attention (the model's layers slide over {windows} tokens)"
    if caps and not backend.supports_soft_cap:
        return f"the {backend.name} backend cannot soft-cap attention logits (the model caps them at {caps})"
    if shape.sinks and not backend.supports_sinks:
        return f"the {backend.name} backend has no attention sinks (the model's layers have them)"
    return None


def get_backend(name: str | None, shape: AttentionShape | None = None) -> AttentionBackend[Any]:
    """`name` None picks FlashInfer on CUDA and the CPU backend (native decode kernel) on the CPU
    when they can run this model, else the torch backend, with one warning saying why. An
    explicit "cpu" or "flashinfer" that cannot run falls back to torch with a warning: never a
    silently wrong result. Without a shape, the torch backend for float32."""
    if name is not None and name not in REGISTRY:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(BACKENDS)})")
    if shape is None:
        return TorchAttentionBackend()
    chosen = REGISTRY[name if name is not None else AUTO.get(shape.device.type, AUTO_ELSEWHERE)]
    reason = layer_kinds_reason(chosen, shape) or chosen.unsupported_reason(shape)
    if reason is None:
        try:
            return chosen.create(shape)
        except BackendUnavailableError as error:
            reason = str(error)
    cannot = layer_kinds_reason(FALLBACK, shape)
    if cannot is not None:
        raise ValueError(f"no attention backend can run this model: {reason}; {cannot}")
    logger.warning("attention backend: %s, because %s", FALLBACK.name, reason)
    return FALLBACK.create(shape)
