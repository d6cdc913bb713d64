"""`compiled_engine::quantized_linear`: the product with a quantized weight, as one operator that
torch.compile keeps opaque (its weights stay graph inputs, and Inductor does not try to fuse the
dequantization, which it vectorises poorly here: shared/facts in docs/benchmarks.md).

Which way it runs:
- on the CPU with fp32 activations and the native kernels built: a row or a few straight from
  the quantized weight (decode), more rows through the many-row kernel (a strip dequantized once
  for every row: batched decode), and hundreds of rows (prefill) by dequantizing the whole weight
  for the fp32 GEMM, where the product's arithmetic dwarfs the conversion; where each way stops
  leading is measured per shape (linear/crossover.py);
- anywhere else (another device, another dtype, no compiler): the reference, dequantize in
  torch and F.linear. That is also the slow twin the tests hold the kernels to.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from compiled_engine.linear.crossover import UNMEASURED, RowCrossover
from compiled_engine.linear.quantized_cpu_kernels import LIBRARY, QuantKernels, load_quant_kernels
from compiled_engine.linear.quantized_weight import QuantizedWeight, unpack_int4
from compiled_engine.native_build import KernelBuildError, TorchOperatorLibrary

logger = logging.getLogger(__name__)


NATIVE_OPERATOR = TorchOperatorLibrary(
    Path(__file__).with_name("kernels") / "quant_op.cpp", LIBRARY.source, "native quantized-linear operator"
)


@cache
def native_operator() -> torch._ops.OpOverload | None:
    """`compiled_engine::quantized_linear_f32`, the same product as a C++ operator (one
    dispatcher call, no Python, inside a compiled graph), or None with one warning when it
    cannot be built: the ctypes path below then runs the same kernels."""
    try:
        NATIVE_OPERATOR.load()
    except KernelBuildError as error:
        logger.warning("quantized products call their kernels from Python (slower per call), because %s", error)
        return None
    _register_native_fake()
    op: torch._ops.OpOverload = torch.ops.compiled_engine.quantized_linear_f32.default
    return op


def _native_fake(x: torch.Tensor, data: torch.Tensor, *shapeless: Any) -> torch.Tensor:
    # the output's shape is x's rows by the weight's: the other arguments do not change it
    return x.new_empty(x.shape[0], data.shape[0])


@cache
def cpu_kernels() -> QuantKernels | None:
    """The native kernels, or None (with one warning saying why) when they cannot be built."""
    try:
        return load_quant_kernels()
    except KernelBuildError as error:
        logger.warning("quantized weights run the torch reference path (slow), because %s", error)
        return None


def reference_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The meaning of the product: dequantize in torch, then F.linear."""
    return F.linear(x, weight.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))


ACTIVATION_BLOCK = 32  # activations rounded to int8 share one scale per block of this many


def int8_activations_reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The meaning of the int8-activation product (`quantized_linear_q8x_f32`'s direct rows), in
    torch: each row of x [rows, in] rounded to int8 in blocks of 32 (scale d = max|x| / 127,
    halves to even), each block's integer dot product with the integer weights scaled by
    d times its group's weight scale, plus offset_g times the exact sum of x over the group."""
    rows, width = x.shape
    out, group_size, offsets = weight.out_features, weight.group_size, weight.offsets
    blocks = x.float().reshape(rows, width // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # Divisions of two tensors: `127.0 / amax` would be 127 times amax's reciprocal, rounded twice,
    # not the kernel's one rounding.
    steps = torch.full_like(amax, 127.0)
    d = amax / steps
    inverse = torch.where(amax > 0, steps / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inverse)  # halves to even, as the kernel's nearbyintf
    q = (unpack_int4(weight.data) if weight.format == "int4" else weight.data).to(torch.float64)
    q = q.reshape(out, width // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    dots = torch.einsum("rbk,obk->rob", xq.double(), q)  # exact integers
    block_scales = weight.scales.repeat_interleave(group_size // ACTIVATION_BLOCK, dim=1)  # [out, blocks]
    y = (dots * (d.squeeze(-1)[:, None, :] * block_scales[None]).double()).sum(-1)
    if offsets is not None:
        sums = x.double().reshape(rows, width // group_size, group_size).sum(-1)
        y = y + sums @ offsets.double().T
    if bias is not None:
        y = y + bias.double()
    return y.float()


torch.library.define(
    "compiled_engine::quantized_linear",
    "(Tensor x, Tensor data, Tensor scales, Tensor? offsets, Tensor? bias, int group_size) -> Tensor",
)


def run_quantized_linear(
    x: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    weight = QuantizedWeight.of_tensors(data, scales, offsets, group_size)
    if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] > 0:
        kernels = cpu_kernels()
        if kernels is not None:
            way = UNMEASURED.way(x.shape[0])
            if way == "direct":
                return kernels.matmul_unchecked(x, weight, bias)
            if way == "gemm":
                return kernels.gemm_unchecked(x, weight, bias)
            return F.linear(x, kernels.dequantize_unchecked(weight), bias)
    rows = x.reshape(-1, x.shape[-1])
    return reference_linear(rows, weight, bias).reshape(*x.shape[:-1], weight.out_features)


torch.library.impl("compiled_engine::quantized_linear", "CompositeExplicitAutograd")(run_quantized_linear)


@torch.library.register_fake("compiled_engine::quantized_linear")
def _quantized_linear_fake(x: torch.Tensor, data: torch.Tensor, *shapeless: Any) -> torch.Tensor:
    # the output's shape is x's rows by the weight's: the other arguments do not change it
    return x.new_empty(*x.shape[:-1], data.shape[0])


def quantized_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    native: torch._ops.OpOverload | None = None,
    crossover: RowCrossover = UNMEASURED,
) -> torch.Tensor:
    """x @ weight.T + bias. `native`: a C++ operator (`native_operator()`, or
    `int8_activations_operator()`), taken for 2-D fp32 activations on the CPU, with the row
    counts at which it changes kernels. The operators take the weight's tensors: this is where
    it is unpacked."""
    data, scales, offsets, group_size = weight.data, weight.scales, weight.offsets, weight.group_size
    if native is not None and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu":
        return native(x, data, scales, offsets, bias, group_size, crossover.direct_max_rows, crossover.gemm_max_rows)
    return torch.ops.compiled_engine.quantized_linear(x, data, scales, offsets, bias, group_size)


def _register_native_fake() -> None:
    """The C++ operators' shape function, once their schemas exist (after native_operator())."""
    torch.library.register_fake("compiled_engine::quantized_linear_f32")(_native_fake)
    torch.library.register_fake("compiled_engine::quantized_linear_q8x_f32")(_native_fake)


def int8_activations_operator() -> torch._ops.OpOverload | None:
    """`compiled_engine::quantized_linear_q8x_f32`: the native product with x rounded to int8 in
    blocks of 32 (llama.cpp's activation numerics; lossy, opt-in) for the direct kernel's rows,
    exact beyond; None when the native operator cannot be built."""
    if native_operator() is None:
        return None
    op: torch._ops.OpOverload = torch.ops.compiled_engine.quantized_linear_q8x_f32.default
    return op
