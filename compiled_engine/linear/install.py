"""The one ordered walk that decides how a loaded model's linear layers run, from outside the
model file, replacing modules on their parents (`setattr`) and nothing else:

1. every linear product (the layers' and the head) gets the kernel the table picks
   (linear/table.py);
2. a tied embedding whose table became the head's packed copy reads its rows from that copy
   (`BlockedEmbedding`; the dense table goes);
3. each native quantized product learns the row counts at which it changes kernels, measured
   once per shape on this machine (linear/crossover.py);
then the adapter install (executor/prepare.py's `AdapterInstall`; LoRA wraps each decoder layer's
products in its adapter slots, whatever their kernel: lora/layers.py).

The loaders come before it (they put each weight in the module of its form: `Linear`,
`QuantizedLinear`, `QuantizedEmbedding`; tensor parallelism shards the dense ones), and
compilation after it (executor/compilation.py wraps each decoder layer for its compiled code).
"""

from __future__ import annotations

from dataclasses import replace as replaced

from torch import nn

from compiled_engine.linear.crossover import crossovers_for
from compiled_engine.linear.packed_cpu import BlockedEmbedding, CpuLinear
from compiled_engine.linear.quantized import INT8_DIRECT_MAX_ROWS, Int8ActivationsLinear, QuantizedLinear
from compiled_engine.linear.quantized_op import cpu_kernels
from compiled_engine.linear.table import Product, kernel_for
from compiled_engine.model.layers import DecoderModel


def install_kernels(model: DecoderModel, compiled: bool, activations: str = "fp32") -> None:
    """Run the walk on `model` (loaded, and sharded under tensor parallelism), for a model run
    compiled or eager, with the CPU activations asked for ("fp32", or "int8" for the quantized
    products)."""
    tied = model.lm_head.weight is model.embed_tokens.weight
    for name, module in list(model.named_modules()):
        product = Product.of(module, compiled, activations)
        if product is None:
            continue
        kernel = kernel_for(product).build(module)
        if kernel is not module:
            replace(model, name, kernel)
    if tied:
        _tie_embedding(model)
    _measure_crossovers(model)


def replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at module path `name` (for example "layers.0.mlp.down_proj")."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _tie_embedding(model: DecoderModel) -> None:
    head = model.lm_head
    if isinstance(head, CpuLinear) and head.blocked is not None:
        replace(model, "embed_tokens", BlockedEmbedding(head.blocked))


def _measure_crossovers(model: DecoderModel) -> None:
    products = [
        module
        for module in model.modules()
        if isinstance(module, QuantizedLinear) and module.native is not None and module.data.device.type == "cpu"
    ]
    kernels = cpu_kernels()
    if not products or kernels is None:
        return
    for product, crossover in zip(products, crossovers_for([p.weight for p in products], kernels), strict=True):
        if isinstance(product, Int8ActivationsLinear):  # its direct kernel's range is its numerics'
            gemm_max_rows = max(crossover.gemm_max_rows, INT8_DIRECT_MAX_ROWS)
            crossover = replaced(crossover, direct_max_rows=INT8_DIRECT_MAX_ROWS, gemm_max_rows=gemm_max_rows)
        product.crossover = crossover
