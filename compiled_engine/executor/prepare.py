"""Every rewrite of a loaded model, in the one order they must run: the frame arena (before any
step's Python runs), the tensor-parallel shard (the kernels see this rank's part), the kernels
(linear/install.py), the adapter products (before compilation, which traces them), compilation,
then the forwards each rank runs alone (warm-up, memory measurement, graph capture), and last
the pipeline stage's links (their sends and receives would wait on the other stages)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from compiled_engine.cache_paths import compiled_dir, inductor_dir
from compiled_engine.executor.compilation import ModelForward, model_forward, use_compile_cache
from compiled_engine.executor.frame_arena import install_frame_arena
from compiled_engine.executor.pipeline import StageLinks, link_stage
from compiled_engine.executor.precompiled import artifact_dir, model_signature
from compiled_engine.linear.install import install_kernels
from compiled_engine.linear.tensor_parallel import parallelize
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.layers import DecoderModel


class AdapterSlots(Protocol):
    def set_tokens(self, query_lens: list[int], seq_slots: list[int] | None, padded_tokens: int = 0) -> None:
        """The next forward's tokens: sequence s runs `query_lens[s]` of them on slot
        `seq_slots[s]` (-1 or None: the base model); padding rows up to `padded_tokens` use none."""
        ...


class AdapterInstall(Protocol):
    """The adapter seam's rewrite (engine/adapters.py): its products put into the model, and the
    slots the runner sets before each forward. `max_tokens`: the most one forward runs."""

    def __call__(
        self, model: DecoderModel, config: ModelConfig, max_tokens: int, dtype: torch.dtype
    ) -> AdapterSlots: ...


class NoAdapterSlots:
    def set_tokens(self, query_lens: list[int], seq_slots: list[int] | None, padded_tokens: int = 0) -> None:
        pass


def install_no_adapters(model: DecoderModel, config: ModelConfig, max_tokens: int, dtype: torch.dtype) -> AdapterSlots:
    return NoAdapterSlots()


@dataclass(frozen=True)
class PreparePlan:
    """What to apply to a loaded model."""

    mesh: DeviceMesh | None  # this rank's tensor-parallel group; None: the model stays whole
    compiled: bool  # compiled kernels and a compiled forward; False: eager
    cpu_activations: str
    adapters: Callable[[DecoderModel], AdapterSlots]  # an AdapterInstall with its arguments
    # What names this model's saved traces besides its modules (executor/precompiled.py); None:
    # traced at every start.
    trace_key: list[str] | None
    # A pipeline stage's sends and receives (its layers compiled one by one, with no one-token
    # forward of the whole model); None: not a stage.
    links: StageLinks | None


@dataclass(frozen=True)
class PreparedModel:
    forward: ModelForward
    adapter_slots: AdapterSlots


def prepare(model: DecoderModel, plan: PreparePlan, run_alone: Callable[[PreparedModel], None]) -> PreparedModel:
    """Rewrite `model` in place as `plan` says. `run_alone`: the forwards this rank runs before
    its stage is linked to the others (the runner's warm-up, KV pool sizing and graph capture)."""
    install_frame_arena()  # a step's Python calls stay off mmap at any stack depth
    if plan.mesh is not None:
        parallelize(model, plan.mesh)
    install_kernels(model, plan.compiled, plan.cpu_activations)
    slots = plan.adapters(model)
    prepared = PreparedModel(_compile(model, plan), slots)
    run_alone(prepared)
    if plan.links is not None:  # each stage compiled and warmed up alone; now linked
        link_stage(model, plan.links)
    return prepared


def _compile(model: DecoderModel, plan: PreparePlan) -> ModelForward:
    if not plan.compiled:
        return model_forward(model, compiled=False)
    use_compile_cache(inductor_dir())
    saved_dir: Path | None = None
    if plan.trace_key is not None:  # named by the model as the kernels and adapters left it
        saved_dir = artifact_dir(compiled_dir(), [*model_signature(model), *plan.trace_key])
    return model_forward(model, compiled=True, saved_dir=saved_dir, whole_forward=plan.links is None)
