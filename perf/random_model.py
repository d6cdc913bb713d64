"""Write a random-weight model with the shapes of a real one, for benchmarks on machines that
cannot download weights (the accelerator machine has no network).

    python perf/random_model.py llama3-8b /tmp/llama3-8b --dtype bfloat16
    python perf/random_model.py qwen3-0.6b /tmp/qwen3-0.6b

Needs transformers (the `convert` extra). Weights are drawn small enough that activations stay
finite; the text such a model writes means nothing, its speed is the point.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def write_random_model(shape: str, out: Path, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--device", default="cpu", help="where to draw the weights (cuda is much faster for 8B)")
    args = parser.parse_args()
    print(write_random_model(args.shape, args.out, getattr(torch, args.dtype), args.device))


if __name__ == "__main__":
    main()
