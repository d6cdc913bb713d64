"""FlashInfer against the torch reference backend on CUDA (marked gpu; skipped without CUDA or
without flashinfer): prefill, prefill over a cached prefix, decode and mixed batches across page
boundaries, GQA ratios 1, 3, 4 and 8, head_dim 64 and 128, bf16; and layers with a sliding window
or a logit soft-cap, each running its own planned wrapper (not yet run on a GPU)."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
import torch

from compiled_engine.attention.backend import AttentionBackend, AttentionShape
from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.attention.torch_backend import TorchAttentionBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"),
]
PAGE = 16


def _run(
    backend: AttentionBackend[Any],
    batch: list[tuple[int, int]],
    kv_heads: int,
    heads: int,
    head_dim: int,
    seed: int,
    window: int = 0,
    soft_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """batch: (cached tokens, new tokens) per sequence. Returns (output, cache after)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    device, dtype = torch.device("cuda"), torch.bfloat16
    pages = [math.ceil((c + n) / PAGE) for c, n in batch]
    num_pages = sum(pages) + 2
    order = torch.randperm(num_pages, generator=gen, device=device).tolist()
    tables, at = [], 0
    for p in pages:
        tables.append(order[at : at + p])
        at += p
    cache = torch.randn(num_pages, 2, PAGE, kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    tokens = sum(n for _, n in batch)
    q = torch.randn(tokens, heads, head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    md = AttentionMetadata.build([n for _, n in batch], [c + n for c, n in batch], tables, PAGE, device)
    out = backend.attend(q, k, v, cache, md, head_dim**-0.5, window, soft_cap)
    return out, cache


BATCHES = {
    "prefill": [(0, 37), (0, 5)],
    "chunk_after_prefix": [(33, 20), (16, 16)],
    "decode": [(0, 1), (15, 1), (16, 1), (130, 1)],
    "mixed": [(40, 1), (0, 23), (17, 9), (64, 1)],
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (9, 3), (16, 4), (32, 4)])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_flashinfer_matches_torch_backend(kind: str, heads: int, kv_heads: int, head_dim: int) -> None:
    from compiled_engine.attention.flashinfer_backend import FlashInferAttentionBackend

    flashinfer = FlashInferAttentionBackend(
        AttentionShape(heads, kv_heads, head_dim, PAGE, torch.bfloat16, torch.device("cuda"))
    )
    got, cache_fi = _run(flashinfer, BATCHES[kind], kv_heads, heads, head_dim, seed=1)
    want, cache_ref = _run(TorchAttentionBackend(torch.bfloat16), BATCHES[kind], kv_heads, heads, head_dim, seed=1)
    assert torch.equal(cache_fi, cache_ref)  # the same K/V scatter
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


# Windows inside a page and across pages, a cap small enough to bite, and both together.
LAYER_KINDS = ((0, 0.0), (7, 0.0), (40, 0.0), (0, 5.0), (40, 5.0))


@pytest.mark.parametrize("kind", LAYER_KINDS[1:])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (16, 4)])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_flashinfer_layer_kinds_match_torch_backend(
    batch: str, heads: int, kv_heads: int, kind: tuple[int, float]
) -> None:
    from compiled_engine.attention.flashinfer_backend import FlashInferAttentionBackend

    shape = AttentionShape(heads, kv_heads, 128, PAGE, torch.bfloat16, torch.device("cuda"), layer_kinds=LAYER_KINDS)
    flashinfer = FlashInferAttentionBackend(shape)
    window, soft_cap = kind
    got, cache_fi = _run(flashinfer, BATCHES[batch], kv_heads, heads, 128, 1, window, soft_cap)
    want, cache_ref = _run(
        TorchAttentionBackend(torch.bfloat16), BATCHES[batch], kv_heads, heads, 128, 1, window, soft_cap
    )
    assert torch.equal(cache_fi, cache_ref)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # The same backend's full-attention wrapper still attends without window or cap.
    got_full, _ = _run(flashinfer, BATCHES[batch], kv_heads, heads, 128, 1)
    want_full, _ = _run(TorchAttentionBackend(torch.bfloat16), BATCHES[batch], kv_heads, heads, 128, 1)
    torch.testing.assert_close(got_full.float(), want_full.float(), atol=2e-2, rtol=2e-2)
