"""The kernel table: which kernel runs each linear product of the model.

A product is described by its weight's kind (dense, or a quantized format), the device it lives
on, whether it is a tensor-parallel shard (a DTensor) and whether the model runs compiled. The
first row that matches it names its kernel; `None` in a column matches anything. Each kernel is
a module built from the one the loader left holding the weight (`Linear` or `QuantizedLinear`),
over the same tensors.

GGUF's Q8_0 is the int8 format (groups of 32), its Q4_0 and Q4_1 the int4 format (groups of 32):
the quantized rows cover them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor

from compiled_engine.linear.packed_cpu import CpuLinear
from compiled_engine.linear.quantized import Int8ActivationsLinear, QuantizedLinear
from compiled_engine.model.layers import Linear


@dataclass(frozen=True)
class Product:
    """What the table knows of one linear product."""

    weight: str  # "dense", or the quantized format: "int8", "int4"
    device: str  # "cpu", "cuda", ...
    tensor_parallel: bool  # its weight is this rank's shard (a DTensor)
    compiled: bool  # the model runs compiled (executor/compilation.py), not eager
    activations: str = "fp32"  # the CPU activations asked for (--cpu-activations): "fp32" or "int8"

    @classmethod
    def of(cls, module: nn.Module, compiled: bool, activations: str = "fp32") -> Product | None:
        """The product `module` runs as loaded, or None when it is not a linear product."""
        if isinstance(module, QuantizedLinear):
            return cls(module.format, module.data.device.type, False, compiled, activations)
        if isinstance(module, Linear):
            weight = module.weight
            return cls("dense", weight.device.type, isinstance(weight, DTensor), compiled, activations)
        return None


@dataclass(frozen=True)
class Kernel:
    """A way to run a product: `build(held)` is the module that runs it, from the module that
    holds its weight as loaded."""

    name: str
    build: Callable[[nn.Module], nn.Module]


def _as_loaded(held: nn.Module) -> nn.Module:
    return held


def _packed_cpu(held: nn.Module) -> nn.Module:
    assert isinstance(held, Linear)
    return CpuLinear.from_linear(held)


def _quantized(native: bool) -> Callable[[nn.Module], nn.Module]:
    def build(held: nn.Module) -> nn.Module:
        assert isinstance(held, QuantizedLinear)
        return QuantizedLinear.kernel(held, native)

    return build


def _int8_activations(held: nn.Module) -> nn.Module:
    assert isinstance(held, QuantizedLinear)
    return Int8ActivationsLinear.from_held(held)


# F.linear on the weight as loaded (under tensor parallelism, DTensor's sharded product).
DENSE = Kernel("dense", _as_loaded)
# The weight packed for oneDNN (its one copy where it can be): up to four rows the native kernel
# over the packed copy, more rows oneDNN's GEMM (linear/packed_cpu.py).
PACKED_CPU = Kernel("packed CPU", _packed_cpu)
# The C++ operator straight from the quantized weight: up to 32 rows the direct kernels, more
# rows dequantize-then-GEMM (linear/quantized_op.py); with LoRA, product and delta in one operator.
QUANTIZED_NATIVE = Kernel("quantized native", _quantized(native=True))
# The same operator with x rounded to int8 in blocks of 32 for the direct kernel's integer dot
# products (--cpu-activations int8, lossy); weights in groups of 16 stay exact.
QUANTIZED_INT8_ACTIVATIONS = Kernel("quantized native, int8 activations", _int8_activations)
# The opaque dispatcher `compiled_engine::quantized_linear`: off the CPU, dequantize in torch and
# F.linear (the reference the native kernels are tested against).
QUANTIZED_REFERENCE = Kernel("quantized reference", _quantized(native=False))


@dataclass(frozen=True)
class Row:
    weight: str
    device: str | None
    tensor_parallel: bool | None
    compiled: bool | None
    activations: str | None
    kernel: Kernel

    def matches(self, product: Product) -> bool:
        wanted = (self.weight, self.device, self.tensor_parallel, self.compiled, self.activations)
        have = (product.weight, product.device, product.tensor_parallel, product.compiled, product.activations)
        return all(want is None or want == value for want, value in zip(wanted, have, strict=True))


# fmt: off
KERNELS: tuple[Row, ...] = (
    #   weight   device  tensor-parallel  compiled  activations  kernel
    Row("dense", "cpu",  False,           True,     None,        PACKED_CPU),
    Row("dense", None,   None,            None,     None,        DENSE),
    Row("int8",  "cpu",  False,           None,     "int8",      QUANTIZED_INT8_ACTIVATIONS),
    Row("int8",  "cpu",  False,           None,     None,        QUANTIZED_NATIVE),
    Row("int8",  None,   None,            None,     None,        QUANTIZED_REFERENCE),
    Row("int4",  "cpu",  False,           None,     "int8",      QUANTIZED_INT8_ACTIVATIONS),
    Row("int4",  "cpu",  False,           None,     None,        QUANTIZED_NATIVE),
    Row("int4",  None,   None,            None,     None,        QUANTIZED_REFERENCE),
)
# fmt: on


def kernel_for(product: Product) -> Kernel:
    """The kernel of the first row of KERNELS that matches `product`."""
    for row in KERNELS:
        if row.matches(product):
            return row.kernel
    raise LookupError(f"no kernel runs {product}")
