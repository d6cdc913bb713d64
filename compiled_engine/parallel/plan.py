"""The tensor-parallel plan, applied with DTensor's `parallelize_module`.

Per decoder layer: `qkv_proj` and `gate_up_proj` column-parallel (each rank computes its own heads
and intermediate features, no communication), `o_proj` and `down_proj` row-parallel (partial
sums, one all-reduce each). The embedding, the norms and the head are replicated: the head's
logits are needed whole on rank 0, and at these vocabulary sizes a replicated head measured
simpler and no slower on CPU than a vocab-parallel one plus an all-gather.

Weights arrive already sliced (each rank reads only its part of the checkpoint), so the styles
wrap local tensors with `DTensor.from_local` instead of scattering full ones. Our `Linear`
stores [out, in]: column-parallel is Shard(0), row-parallel Shard(1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from compiled_engine.model.layers import DecoderModel, Linear


def _wrap_local(module: nn.Module, mesh: DeviceMesh, weight: Shard | Replicate, bias: Shard | Replicate) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        placement = weight if name == "weight" else bias
        module.register_parameter(
            name, nn.Parameter(DTensor.from_local(param.data, mesh, [placement], run_check=False), requires_grad=False)
        )


class ColwiseLinear(ParallelStyle):
    """Output features split across ranks: replicated input, this rank's features out (local)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Linear):
            raise TypeError(f"ColwiseLinear applies to compiled_engine Linear, not {type(module).__name__}")

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            _wrap_local(mod, mesh, Shard(0), Shard(0))

        def prepare_input(mod: nn.Module, inputs: Any, mesh: DeviceMesh) -> DTensor:
            return DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False)

        def prepare_output(mod: nn.Module, outputs: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return outputs.to_local()

        # torch types these hooks as returning None; its own styles return the new input/output.
        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)  # type: ignore[arg-type]


class RowwiseLinear(ParallelStyle):
    """Input features split across ranks: this rank's features in, the all-reduced sum out."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Linear):
            raise TypeError(f"RowwiseLinear applies to compiled_engine Linear, not {type(module).__name__}")

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            _wrap_local(mod, mesh, Shard(1), Replicate())

        def prepare_input(mod: nn.Module, inputs: Any, mesh: DeviceMesh) -> DTensor:
            local = inputs[0]
            return DTensor.from_local(local, mesh, [Shard(local.dim() - 1)], run_check=False)

        def prepare_output(mod: nn.Module, outputs: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return outputs.redistribute(placements=[Replicate()]).to_local()  # the all-reduce

        # torch types these hooks as returning None; its own styles return the new input/output.
        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)  # type: ignore[arg-type]


def tensor_parallel_plan(num_layers: int) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    for i in range(num_layers):
        plan[f"layers.{i}.self_attn.qkv_proj"] = ColwiseLinear()
        plan[f"layers.{i}.self_attn.o_proj"] = RowwiseLinear()
        plan[f"layers.{i}.mlp.gate_up_proj"] = ColwiseLinear()
        plan[f"layers.{i}.mlp.down_proj"] = RowwiseLinear()
    return plan


def parallelize(model: DecoderModel, mesh: DeviceMesh) -> DecoderModel:
    parallelize_module(model, mesh, tensor_parallel_plan(model.config.num_layers))
    return model
