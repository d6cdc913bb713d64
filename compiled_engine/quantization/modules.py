"""The modules that stand in for a model's Linear and Embedding when their weights are quantized.

The model file stays plain: these are swapped in from outside (quantization/apply.py), by
quantizing a loaded model or by the GGUF loader. Each holds its weight's tensors as buffers, so
they move with the model and are graph inputs under torch.compile, and runs its product through
the opaque operator `compiled_engine::quantized_linear` (quantization/ops.py).
"""

from __future__ import annotations

import torch
from torch import nn

from compiled_engine.quantization.ops import native_operator, quantized_linear
from compiled_engine.quantization.weights import QuantizedWeight, dequantize_tensors


class _HoldsQuantizedWeight(nn.Module):
    """A module holding one QuantizedWeight as buffers (`data`, `scales`, `offsets`)."""

    data: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.format = weight.format
        self.group_size = weight.group_size
        self.register_buffer("data", weight.data)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("offsets", weight.offsets)
        self._width = weight.in_features

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.format, self.data, self.scales, self.offsets, self.group_size, self._width)


class QuantizedLinear(_HoldsQuantizedWeight):
    """y = x @ W.T + bias with W a QuantizedWeight [out_features, in_features]."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight)
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        # The C++ operator for CPU weights (built once per machine); None elsewhere or when it
        # cannot be built.
        self.native = native_operator() if weight.device.type == "cpu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.data, self.scales, self.offsets, self.bias, self.group_size, self.native)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.format}, group_size={self.group_size}"


class QuantizedEmbedding(_HoldsQuantizedWeight):
    """An embedding table kept quantized: a lookup dequantizes only the rows it reads (plain
    torch, which Inductor fuses). With tied embeddings it shares its tensors with the head."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__(weight)
        self.embedding_dim = weight.in_features
        self.num_embeddings = weight.out_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return dequantize_tensors(self.data, self.scales, self.offsets, self.group_size, input_ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.format}, group_size={self.group_size}"
