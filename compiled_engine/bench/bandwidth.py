"""The memory-bandwidth ceiling, measured on the spot on the device the bench runs on."""

from __future__ import annotations

import time

import torch


def measure_read_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second: the best of `repeats` passes that read (CPU: a sum) or copy (GPU) a
    tensor far larger than the caches."""
    numel = megabytes * (1 << 20) // 4
    data = torch.ones(numel, dtype=torch.float32, device=device)
    best = float("inf")
    if device.type == "cuda":
        out = torch.empty_like(data)
        for _ in range(repeats + 1):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            out.copy_(data)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        return 2 * data.numel() * 4 / best  # a copy reads and writes every byte
    for _ in range(repeats + 1):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best
