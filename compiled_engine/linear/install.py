"""The one ordered walk that decides how a loaded model's linear layers run, from outside the
model file, replacing modules on their parents (`setattr`) and nothing else:

1. every linear product (the layers' and the head) gets the kernel the table picks
   (linear/table.py);
2. a tied embedding whose table became the head's packed copy reads its rows from that copy
   (`BlockedEmbedding`; the dense table goes);
then the adapter install (executor/prepare.py's `AdapterInstall`; LoRA wraps each decoder layer's
products in its adapter slots, whatever their kernel: lora/layers.py).

The loaders come before it (they put each weight in the module of its form: `Linear`,
`QuantizedLinear`, `QuantizedEmbedding`; tensor parallelism shards the dense ones), and
compilation after it (executor/compilation.py wraps each decoder layer for its compiled code).
"""

from __future__ import annotations

from torch import nn

from compiled_engine.linear.packed_cpu import BlockedEmbedding, CpuLinear
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


def replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at module path `name` (for example "layers.0.mlp.down_proj")."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _tie_embedding(model: DecoderModel) -> None:
    head = model.lm_head
    if isinstance(head, CpuLinear) and head.blocked is not None:
        replace(model, "embed_tokens", BlockedEmbedding(head.blocked))
