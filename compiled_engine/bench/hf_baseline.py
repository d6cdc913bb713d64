"""Hugging Face transformers on the same model directory, dtype and workload: the baseline a user
would reach for first. Everything here raises BaselineUnavailable when it cannot run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

PAD = 0  # masked out; any id would do


class BaselineUnavailable(Exception):
    pass


DENSE_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def load_hf(model_dir: Path, dtype: torch.dtype, device: torch.device, gguf: str | None = None) -> Any:
    """transformers' model of `model_dir`: its dense weights, or with `gguf` (a file name in the
    directory) that GGUF as transformers dequantizes it (through gguf-py), under the directory's
    config. A directory prepared from a GGUF alone has no dense weights: its `model.gguf` then."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise BaselineUnavailable("transformers is not installed (pip install 'compiled_engine[convert]')") from exc
    if (
        gguf is None
        and (model_dir / "model.gguf").is_file()
        and not any((model_dir / n).is_file() for n in DENSE_FILES)
    ):
        gguf = "model.gguf"
    try:
        source: dict[str, Any] = {}
        if gguf is not None:
            source = {"gguf_file": gguf, "config": AutoConfig.from_pretrained(model_dir)}
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **source)
        return model.to(device).eval()
    except Exception as exc:  # any load failure: report it and let our figures stand alone
        raise BaselineUnavailable(f"transformers could not load {model_dir}: {exc}") from exc


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, mask


def _generate(model: Any, input_ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, **options: Any) -> None:
    """Greedy, exactly `new_tokens` for each row."""
    model.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=PAD,
        **options,
    )


@torch.inference_mode()
def hf_generate_seconds(model: Any, prompts: list[list[int]], new_tokens: int, device: torch.device) -> float:
    """Wall time of one greedy `generate` over a left-padded batch, exactly `new_tokens` each."""
    input_ids, mask = _left_padded(prompts, device)
    _sync(device)
    start = time.perf_counter()
    _generate(model, input_ids, mask, new_tokens)
    _sync(device)
    return time.perf_counter() - start


@torch.inference_mode()
def hf_generate_token_times(model: Any, prompts: list[list[int]], new_tokens: int, device: torch.device) -> list[float]:
    """Like `hf_generate_seconds`, but the time (from the call) at which each of the
    `new_tokens` generation steps finished: a stopping criterion that never stops records them."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    start = 0.0
    times: list[float] = []

    class RecordTimes(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            _sync(device)
            times.append(time.perf_counter() - start)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    input_ids, mask = _left_padded(prompts, device)
    start = time.perf_counter()
    _generate(model, input_ids, mask, new_tokens, stopping_criteria=StoppingCriteriaList([RecordTimes()]))
    return times
