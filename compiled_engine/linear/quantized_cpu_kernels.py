"""The CPU kernels for quantized weights: `kernels/quant_matmul.c`, built and cached by
compiled_engine/native_build.py and called through ctypes.

`matmul(x, weight, bias)` runs the product straight from the quantized weight (each weight read
once, converted in registers, fp32 accumulation); `dequantize(weight)` writes the dense fp32
matrix, which many-row products hand to the fp32 GEMM. Both check their inputs before the
kernel sees a pointer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from compiled_engine.linear.quantized_weight import QuantizedWeight
from compiled_engine.native_build import NativeLibrary

LIBRARY = NativeLibrary(Path(__file__).with_name("kernels") / "quant_matmul.c", "CPU quantized-weight kernels")
LANES = 8  # int8 groups are whole vectors of 8 weights


def unsupported_reason(weight: QuantizedWeight) -> str | None:
    """Why the kernels cannot take `weight`, or None if they can."""
    if weight.device.type != "cpu":
        return f"the weight is on {weight.device}"
    if weight.format == "int8" and weight.group_size % LANES != 0:
        return f"int8 groups of {weight.group_size} weights are not whole vectors of {LANES}"
    if not all(t.is_contiguous() for t in (weight.data, weight.scales)):
        return "the weight's tensors are not contiguous"
    if weight.offsets is not None and not weight.offsets.is_contiguous():
        return "the weight's offsets are not contiguous"
    return None


@dataclass(frozen=True)
class QuantKernels:
    int4_matmul: Callable[..., int]
    int8_matmul: Callable[..., int]
    int4_dequantize: Callable[..., int]
    int8_dequantize: Callable[..., int]
    quant_gemm: Callable[..., int]

    def matmul(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] fp32 on the CPU -> x @ weight.T + bias, [rows, out] fp32."""
        reason = unsupported_reason(weight)
        if reason is not None:
            raise ValueError(f"quantized matmul: {reason}")
        return self.matmul_unchecked(x, weight, bias)

    def matmul_unchecked(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """`matmul` for a weight already checked by `unsupported_reason` (the per-forward path:
        it checks only what changes from call to call, x and the bias)."""
        data, scales, offsets, group_size = weight.data, weight.scales, weight.offsets, weight.group_size
        out_features, in_features = weight.shape
        int4 = weight.format == "int4"  # else int8, with or without offsets
        if int4 and offsets is None:
            raise ValueError("quantized matmul: int4 weights need offsets")
        if x.dim() != 2 or x.shape[1] != in_features or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(
                f"quantized matmul: x must be float32 [rows, {in_features}] on the CPU, got {x.dtype} "
                f"{list(x.shape)} on {x.device}"
            )
        rows = x.shape[0]
        if rows < 1:
            raise ValueError("quantized matmul: x has no rows")
        if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.float32):
            raise ValueError(f"quantized matmul: bias must be float32 [{out_features}]")
        x = x.contiguous()
        y = torch.empty(rows, out_features)
        bias_ptr = None if bias is None else bias.data_ptr()
        threads = torch.get_num_threads()
        offsets_ptr = None if offsets is None else offsets.data_ptr()
        if int4:
            status = self.int4_matmul(
                x.data_ptr(), rows, in_features, data.data_ptr(), scales.data_ptr(), offsets_ptr,
                out_features, group_size, bias_ptr, y.data_ptr(), threads,
            )  # fmt: skip
        else:
            status = self.int8_matmul(
                x.data_ptr(), rows, in_features, data.data_ptr(), scales.data_ptr(), offsets_ptr, out_features,
                group_size, bias_ptr, y.data_ptr(), threads,
            )  # fmt: skip
        if status != 0:
            raise ValueError(f"quantized matmul: the kernel refused [{out_features}, {in_features}] (status {status})")
        return y

    def gemm_unchecked(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """The same product by the many-row kernel (a strip of the weight dequantized once for
        every row), for a weight already checked by `unsupported_reason` and fp32 x [rows, in]."""
        out_features, in_features = weight.shape
        x = x.contiguous()
        y = torch.empty(x.shape[0], out_features)
        status = self.quant_gemm(
            x.data_ptr(), x.shape[0], in_features, weight.data.data_ptr(), weight.format == "int4",
            weight.scales.data_ptr(), None if weight.offsets is None else weight.offsets.data_ptr(), out_features,
            weight.group_size, None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"quantized gemm: the kernel refused [{out_features}, {in_features}] (status {status})")
        return y

    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        """The dense fp32 [out, in] weight."""
        reason = unsupported_reason(weight)
        if reason is not None:
            raise ValueError(f"quantized dequantize: {reason}")
        return self.dequantize_unchecked(weight)

    def dequantize_unchecked(self, weight: QuantizedWeight) -> torch.Tensor:
        """`dequantize` for a weight already checked by `unsupported_reason`."""
        data, scales, offsets, group_size = weight.data, weight.scales, weight.offsets, weight.group_size
        out_features, in_features = weight.shape
        int4 = weight.format == "int4"
        out = torch.empty(out_features, in_features)
        threads = torch.get_num_threads()
        if int4:
            if offsets is None:
                raise ValueError("quantized dequantize: int4 weights need offsets")
            status = self.int4_dequantize(
                data.data_ptr(), scales.data_ptr(), offsets.data_ptr(), out_features, in_features, group_size,
                out.data_ptr(), threads,
            )  # fmt: skip
        else:
            offsets_ptr = None if offsets is None else offsets.data_ptr()
            status = self.int8_dequantize(
                data.data_ptr(), scales.data_ptr(), offsets_ptr, out_features, in_features, group_size,
                out.data_ptr(), threads,
            )  # fmt: skip
        if status != 0:
            raise ValueError(f"quantized dequantize: the kernel refused [{out_features}, {in_features}]")
        return out


@cache
def load_quant_kernels() -> QuantKernels:
    """Build (once per machine) and load the kernels; raises KernelBuildError when it cannot."""
    return bind_quant_kernels(LIBRARY.load())


def bind_quant_kernels(library: ctypes.CDLL) -> QuantKernels:
    """The kernels of a loaded build of quant_matmul.c (the engine's, or one the tests build with
    other instruction sets)."""
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    signatures = {
        "int4_matmul_f32": [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, f32],
        "int8_matmul_f32": [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, f32],
        "int4_dequantize_f32": [ptr, ptr, ptr, i64, i64, i64, ptr, f32],
        "int8_dequantize_f32": [ptr, ptr, ptr, i64, i64, i64, ptr, f32],
        "quant_gemm_f32": [ptr, i64, i64, ptr, f32, ptr, ptr, i64, i64, ptr, ptr, f32],
    }
    functions = []
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int
        functions.append(function)
    return QuantKernels(*functions)
