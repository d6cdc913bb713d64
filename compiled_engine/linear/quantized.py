"""The modules that stand in for a model's Linear and Embedding when their weights are quantized.

The model file stays plain: these are put in from outside, by quantizing a loaded model
(linear/quantize.py) or by the GGUF loader (weights/gguf_loader.py). Each holds its weight's
tensors as buffers, so they move with the model and are graph inputs under torch.compile, and
hands them on as the one QuantizedWeight they are (`weight`). `QuantizedLinear` is also the
quantized kernel of the kernel table (linear/table.py): the native C++ operator
(`compiled_engine::quantized_linear_f32`) or the opaque dispatcher
`compiled_engine::quantized_linear` (linear/quantized_op.py), whose torch reference runs off the
CPU. With LoRA adapters it runs the product and their delta as one operator (`lora_forward`).
"""

from __future__ import annotations

import torch
from torch import nn

from compiled_engine.linear.crossover import UNMEASURED, RowCrossover
from compiled_engine.linear.lora_op import LoRAStores, quantized_lora_linear
from compiled_engine.linear.quantized_op import int8_activations_operator, native_operator, quantized_linear
from compiled_engine.linear.quantized_weight import QuantizedWeight


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

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight.of_tensors(self.data, self.scales, self.offsets, self.group_size)


class QuantizedLinear(_HoldsQuantizedWeight):
    """y = x @ W.T + bias with W a QuantizedWeight [out_features, in_features]."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, native: bool | None = None) -> None:
        """`native`: run the C++ operator (True), the dispatcher (False), or the C++ operator
        for a CPU weight only (None)."""
        super().__init__(weight)
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        # The C++ operator (built once per machine); None for the dispatcher, or when it cannot
        # be built.
        wanted = weight.device.type == "cpu" if native is None else native
        self.native = native_operator() if wanted else None
        # The row counts at which the native operator changes kernels: measured for this shape
        # when the model's kernels are installed (linear/install.py).
        self.crossover: RowCrossover = UNMEASURED

    @classmethod
    def kernel(cls, held: QuantizedLinear, native: bool) -> QuantizedLinear:
        """The product `held` holds, run natively or through the dispatcher (the same tensors)."""
        return cls(held.weight, held.bias, native)

    @property
    def fuses_lora(self) -> bool:
        """Whether `lora_forward` runs this product and its adapters' delta as one operator."""
        return self.native is not None

    def lora_forward(self, x: torch.Tensor, lora: LoRAStores) -> torch.Tensor:
        """This product plus each token's adapter delta, in one native call (linear/lora_op.py)."""
        return quantized_lora_linear(x, self.weight, self.bias, lora, self.crossover)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.weight, self.bias, self.native, self.crossover)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.format}, group_size={self.group_size}"


# Rows up to which the int8-activation products round x to int8 (the direct kernel's range:
# decode and speculative verification); more rows run exactly.
INT8_DIRECT_MAX_ROWS = 32


class Int8ActivationsLinear(QuantizedLinear):
    """The product with x rounded to int8 in blocks of 32 before the direct kernel's integer dot
    products (`--cpu-activations int8`: llama.cpp's numerics, lossy, opt-in); more rows than the
    direct kernel takes run exactly (the many-row kernel, or dequantize-then-GEMM). Its own class, so that a
    saved trace of the exact products is never replayed for it (the trace key names classes).
    Without LoRA: adapters take the exact fused operator (`fuses_lora`)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        if weight.group_size % 32 != 0:
            raise ValueError(
                f"int8 activations need weight groups of whole blocks of 32, not {weight.group_size} "
                "(run this format with --cpu-activations fp32)"
            )
        super().__init__(weight, bias, native=True)
        operator = int8_activations_operator()
        if operator is None:
            raise ValueError("int8 activations need the native quantized operator, which cannot be built here")
        self.int8_operator = operator
        self.crossover = RowCrossover(INT8_DIRECT_MAX_ROWS, INT8_DIRECT_MAX_ROWS)

    @classmethod
    def from_held(cls, held: QuantizedLinear) -> QuantizedLinear:
        """`held`'s product with int8 activations, or `held` run natively where its groups are
        not whole blocks of 32 (the k-quants' groups of 16), which stay exact."""
        if held.group_size % 32 != 0:
            return QuantizedLinear.kernel(held, native=True)
        return cls(held.weight, held.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.weight, self.bias, self.int8_operator, self.crossover)


class QuantizedEmbedding(_HoldsQuantizedWeight):
    """An embedding table kept quantized: a lookup dequantizes only the rows it reads (plain
    torch, which Inductor fuses). With tied embeddings it shares its tensors with the head."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__(weight)
        self.embedding_dim = weight.in_features
        self.num_embeddings = weight.out_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(input_ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.format}, group_size={self.group_size}"
