"""Hugging Face transformers on the same model directory, dtype and workload: the baseline a user
would reach for first. Everything here raises BaselineUnavailable when it cannot run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


class BaselineUnavailable(Exception):
    pass


def load_hf(model_dir: Path, dtype: torch.dtype, device: torch.device) -> Any:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise BaselineUnavailable("transformers is not installed (pip install 'compiled_engine[convert]')") from exc
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        return model.to(device).eval()
    except Exception as exc:  # any load failure: report it and let our figures stand alone
        raise BaselineUnavailable(f"transformers could not load {model_dir}: {exc}") from exc


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_generate_seconds(model: Any, prompts: list[list[int]], new_tokens: int, device: torch.device) -> float:
    """Wall time of one greedy `generate` over a left-padded batch, exactly `new_tokens` each."""
    width = max(len(p) for p in prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    _sync(device)
    start = time.perf_counter()
    model.generate(
        input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=pad,
    )
    _sync(device)
    return time.perf_counter() - start
