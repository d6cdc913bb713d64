"""A random-weight model directory in the shape of a real checkpoint, for the bench when the real
weights are out of reach (no model hub here): `python perf/random_model.py gemma3-270m OUT`.
The configs are the published ones' shapes; the weights are transformers' own random init, so
speed figures hold and text is noise."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3-270m": (
        "gemma3_text",
        dict(
            vocab_size=262144,
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            tie_word_embeddings=True,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
}


def write_random_model(shape: str, out: Path, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = SHAPES[shape]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_random_model(args.shape, args.out, args.seed))


if __name__ == "__main__":
    main()
