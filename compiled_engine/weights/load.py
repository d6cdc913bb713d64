"""Which weights the runner loads, and in which form: the one place that reads the engine's
quantization options.

- A model directory with a GGUF (`model.gguf`: the default model, or a user's `.gguf` prepared by
  weights/gguf_dir.py) runs the GGUF's own quantized tensors (under tensor parallelism, each rank
  its slices of them) unless `quantization` says otherwise;
  with "none" it runs dense weights (its safetensors if the directory has them, else the GGUF
  dequantized); with int8/int4, dense weights quantized at load.
- A safetensors checkpoint is dense unless `quantization` is int8 or int4.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.linear.quantize import QuantizationScheme, quantize_model
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.layers import DecoderModel
from compiled_engine.model.shard import NO_SHARD, TPShard
from compiled_engine.weights.gguf import gguf_file
from compiled_engine.weights.gguf_loader import load_gguf_model
from compiled_engine.weights.safetensors_loader import INDEX_FILE, SINGLE_FILE, load_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedWeights:
    model: DecoderModel
    description: str  # for the log and the bench: "GGUF Q4_1/Q8_0", "int4 (group 32) at load", "dense float32"


def load_weights(
    model_dir: Path,
    model_config: ModelConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    shard: TPShard = NO_SHARD,
    layers: range | None = None,
) -> LoadedWeights:
    """The model's weights as `config` asks, on `device`: `shard`'s slices of them (tensor
    parallelism) and, with `layers`, only those decoder layers (a pipeline stage's)."""
    gguf = gguf_file(model_dir)
    quantization = config.quantization
    if shard.size > 1 and quantization in ("int8", "int4"):
        raise ValueError(
            f"--quantization {quantization} does not run with tensor parallelism yet: pass "
            "--quantization none or --tensor-parallel-size 1"
        )
    has_dense = (model_dir / SINGLE_FILE).is_file() or (model_dir / INDEX_FILE).is_file()
    if device.type != "cpu" and gguf is not None and quantization is None:
        # The quantized kernels are CPU code; elsewhere the reference path would dequantize every
        # weight at every product.
        logger.info("on %s the GGUF runs dequantized: the quantized kernels are CPU-only so far", device.type)
        quantization = "none"
    if device.type != "cpu" and quantization in ("int8", "int4"):
        logger.warning(
            "--quantization %s on %s runs the torch reference path (each product dequantizes its weight)",
            quantization,
            device.type,
        )
    if gguf is not None and quantization is None:
        model = load_gguf_model(gguf, model_config, dtype, device, shard=shard, layers=layers)
        return LoadedWeights(model, f"GGUF {gguf.name}, its quantized tensors as they are")
    if gguf is not None and not has_dense:
        model = load_gguf_model(gguf, model_config, dtype, device, dequantize=True, shard=shard, layers=layers)
        source = f"GGUF {gguf.name} dequantized to {str(dtype).removeprefix('torch.')}"
    else:
        model = load_model(model_dir, model_config, dtype, device, shard, layers)
        source = f"dense {str(dtype).removeprefix('torch.')}"
    if quantization in ("int8", "int4"):
        scheme = QuantizationScheme(quantization, config.quantization_group_size, config.quantize_head)
        quantize_model(model, scheme)
        group = (
            "per channel"
            if scheme.group_size is None and quantization == "int8"
            else f"group {scheme.group_size or 32}"
        )
        head = ", head int8 group 32" if scheme.head else ", head dense"
        return LoadedWeights(model, f"{quantization} ({group}{head}) quantized at load from {source}")
    return LoadedWeights(model, source)
