"""The tensor-parallel plan, applied with DTensor's `parallelize_module`.

Per decoder layer: `qkv_proj` and `gate_up_proj` column-parallel (each rank computes its own heads
and intermediate features, no communication), `o_proj` and `down_proj` row-parallel (partial
sums, one all-reduce each). In a mixture of experts every expert is split the same way (each rank
holds every expert's share of its intermediate features, so every rank works on every chosen
expert): the experts' partial sums are all-reduced (`AllReducedExperts`), the shared expert is
an MLP like any other, and the router is replicated. The embedding, the norms and the head are replicated: the head's
logits are needed whole on rank 0, and at these vocabulary sizes a replicated head measured
simpler and no slower on CPU than a vocab-parallel one plus an all-gather.

Weights arrive already sliced (each rank reads only its part of the checkpoint), so the styles
wrap local tensors with `DTensor.from_local` instead of scattering full ones. Our `Linear`
stores [out, in]: column-parallel is Shard(0), row-parallel Shard(1).

A GGUF's quantized products (`QuantizedLinear`, which DTensor does not know) arrive sliced too
(weights/gguf_loader.py): column-parallel they need nothing (replicated input, local features
out), row-parallel they run on the local input and are wrapped in `AllReduced`, which sums the
ranks' partial outputs with a functional collective (traced whole under torch.compile).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from compiled_engine.linear.install import replace
from compiled_engine.linear.quantized import QuantizedLinear
from compiled_engine.model.layers import DecoderModel, Linear
from compiled_engine.model.moe import SparseMoE


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


class AllReduced(nn.Module):
    """A row-parallel product that DTensor does not run (a quantized one): `inner` on this rank's
    input features, then the sum of every rank's partial output, then the bias (taken from
    `inner`, which every rank holds whole, so that it is added once)."""

    def __init__(self, inner: QuantizedLinear, mesh: DeviceMesh) -> None:
        super().__init__()
        self.bias = inner.bias
        inner.bias = None
        self.inner = inner
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = funcol.all_reduce(self.inner(x), "sum", self.mesh)
        return out if self.bias is None else out + self.bias


class AllReducedExperts(nn.Module):
    """A mixture's experts, each holding this rank's share of its intermediate features (gate/up
    rows, down columns): `inner` over them, then the sum of every rank's partial output."""

    def __init__(self, inner: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.inner = inner
        self.mesh = mesh

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(self.inner(x, weights, ids), "sum", self.mesh)


COLUMN_PARALLEL = ("self_attn.qkv_proj", "mlp.gate_up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def _paths(model: DecoderModel, names: tuple[str, ...]) -> list[str]:
    """The products `names` of every layer a rank holds (a pipeline stage holds a slice of them);
    in a mixture-of-experts layer, its shared expert's MLP stands for the MLP (none: skipped)."""
    paths = []
    for i, layer in enumerate(model.layers):
        block = layer.mlp
        mlp = "mlp.shared_expert" if isinstance(block, SparseMoE) else "mlp"
        has_mlp = not isinstance(block, SparseMoE) or block.shared_expert is not None
        paths += [
            f"layers.{i}.{name.replace('mlp', mlp, 1)}" for name in names if has_mlp or not name.startswith("mlp")
        ]
    return paths


def tensor_parallel_plan(model: DecoderModel) -> dict[str, ParallelStyle]:
    """DTensor's styles for the dense products; the quantized ones are left to `parallelize`."""
    plan: dict[str, ParallelStyle] = {}
    for names, style in ((COLUMN_PARALLEL, ColwiseLinear), (ROW_PARALLEL, RowwiseLinear)):
        for path in _paths(model, names):
            if not isinstance(model.get_submodule(path), QuantizedLinear):
                plan[path] = style()
    return plan


def parallelize(model: DecoderModel, mesh: DeviceMesh) -> DecoderModel:
    parallelize_module(model, mesh, tensor_parallel_plan(model))
    for path in _paths(model, ROW_PARALLEL):
        module = model.get_submodule(path)
        if isinstance(module, QuantizedLinear):
            replace(model, path, AllReduced(module, mesh))
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, SparseMoE):
            replace(model, f"layers.{i}.mlp.experts", AllReducedExperts(layer.mlp.experts, mesh))
    return model
