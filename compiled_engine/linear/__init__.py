"""Which code runs a linear layer. The model files hold plain `Linear` modules (model/layers.py);
everything else about a linear layer is here:

- `table.py`: the kernel table, which kernel runs each product (dense, packed CPU, quantized);
- `install.py`: the one ordered walk that installs the picked kernels (`install_kernels`);
- `packed_cpu.py`: fp32 weights packed once for oneDNN and the native kernel (`CpuLinear`);
- `quantized_weight.py`: the `QuantizedWeight` type (the int8 and int4 formats);
- `quantize.py`: quantizing at load (`quantize_model`) and installing quantized weights;
- `quantized.py`, `quantized_op.py`, `quantized_cpu_kernels.py`: the quantized modules, their
  operator and its CPU kernels;
- `lora_op.py`: LoRA's operators (lora/layers.py holds the adapter slots around them);
- `tensor_parallel.py`: the tensor-parallel plan (`parallelize`);
- `kernels/`: the C and C++ sources of the native kernels.
"""
