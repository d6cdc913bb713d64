"""Pooling a prompt's hidden states into one embedding (`--runner pooling`): the engine's pooler
(engine/pooler.py), registered as "embed".

How a model pools comes from its sentence-transformers files when it has them: `modules.json`
names a Pooling module (its `config.json`: mean, CLS or last token) and, if the embeddings are
normalized, a Normalize module. Without them: the last token's hidden state, normalized (vLLM's
default for embedding models). The hidden states are the final norm's output, as transformers'
`last_hidden_state`.

A sequence's `Pooling` takes its prompt's hidden states chunk by chunk as the scheduler runs
them. Mean and CLS pooling need every prompt token's state, so such sequences take no
prefix-cache hits (as prompt logprobs); last-token pooling does, since the last token is always
computed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compiled_engine.engine.feature_state import PoolingState
from compiled_engine.engine.pooler import PoolingConfig
from compiled_engine.engine.sequence import Sequence
from compiled_engine.engine.step_inputs import ScheduledBatch
from compiled_engine.errors import ModelConfigError, RequestError
from compiled_engine.executor.step import Wants

POOLING_MODES = ("mean", "cls", "last")
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


def pooling_config(model_dir: Path) -> PoolingConfig:
    """The model's pooling from its sentence-transformers files, else last-token, normalized."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig()
    modules = _read(modules_file)
    if not isinstance(modules, list):
        raise ModelConfigError(f"{modules_file}: expected a list of modules")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    normalize = "Normalize" in kinds
    pooling = kinds.get("Pooling")
    if pooling is None:
        return PoolingConfig("last", normalize)
    config_file = model_dir / str(pooling.get("path", "")) / "config.json"
    settings = _read(config_file)
    chosen = [mode for key, mode in _ST_MODES.items() if isinstance(settings, dict) and settings.get(key)]
    others = [
        key
        for key, value in (settings or {}).items()
        if key.startswith("pooling_mode_") and value and key not in _ST_MODES
    ]
    if len(chosen) != 1 or others:
        raise ModelConfigError(
            f"{config_file}: one of {', '.join(_ST_MODES)} must be true (and no other pooling mode), got {settings}"
        )
    return PoolingConfig(chosen[0], normalize)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelConfigError(f"cannot read {path}: {error}") from error


@dataclass
class Pooling:
    """One sequence's pooled hidden state so far (its `PoolingState`, engine/feature_state.py)."""

    config: PoolingConfig
    total: torch.Tensor | None = None  # mean: the sum so far; cls and last: the chosen row
    count: int = 0

    def add(self, rows: torch.Tensor, start: int) -> None:
        rows = rows.float()
        if start == 0:
            self.total, self.count = None, 0
        if self.config.mode == "mean":
            chunk = rows.sum(dim=0)
            self.total = chunk if self.total is None else self.total + chunk
            self.count += rows.shape[0]
        elif self.config.mode == "cls":
            if start == 0:
                self.total = rows[0].clone()
        else:
            self.total = rows[-1].clone()

    def result(self) -> list[float]:
        assert self.total is not None, "no hidden states were pooled"
        pooled = self.total / self.count if self.config.mode == "mean" else self.total
        if self.config.normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return [float(value) for value in pooled.cpu().tolist()]


class EmbeddingPooler:
    """Every request pools its prompt into one embedding, as the model's `config` says."""

    wants = Wants.HIDDEN_STATES

    def __init__(self, model_dir: Path) -> None:
        self.config = pooling_config(model_dir)

    def states(self, pooled: bool, n: int) -> list[PoolingState | None]:
        if not pooled:
            raise RequestError("this engine pools (runner pooling): it makes embeddings, not text")
        return [Pooling(self.config) for _ in range(n)]

    def reads_whole_prompt(self, seq: Sequence) -> bool:
        return self.config.needs_every_token

    def pool(self, batch: ScheduledBatch, rows: torch.Tensor) -> tuple[ScheduledBatch, torch.Tensor]:
        row = 0
        for seq, num_new in batch:
            assert seq.pooling is not None
            seq.pooling.add(rows[row : row + num_new], seq.num_computed_tokens)
            row += num_new
        return [], rows[:0]  # nothing to sample

    def results(self, due: list[Sequence]) -> list[tuple[Sequence, list[float]]]:
        return [(seq, seq.pooling.result()) for seq in due if seq.pooling is not None]
