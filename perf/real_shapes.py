"""Random-weight Hugging Face directories with the exact shapes of Llama-3.2-1B, Qwen3-1.7B and
Qwen3-4B, and a mixture of experts of Granite-3.1-1B-A400M's sizes, for speed work where the real checkpoints are out of reach (no model hub here):

    python perf/real_shapes.py OUT_DIR [--only NAME ...]

writes OUT_DIR/<name>/ (config.json, bf16 safetensors, a tokenizer) and skips a directory that is
already complete. Speed does not depend on the weight values: every product, the KV cache and the
head have the real sizes. The tokenizer is the default model's (SmolLM2, 49152 tokens), since the
real ones are not reachable either; the config keeps the real vocabulary size, so the embedding and
the head have their real row counts (the rows past the tokenizer's are never fed in, but the head
reads them all, which is what a step's cost needs). Special token ids are the tokenizer's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _qwen3(**sizes: int) -> dict[str, Any]:
    """A Qwen3 dense config: the sizes given, and what the 1.7B and 4B files share."""
    return dict(
        **sizes,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


# Published config.json values, field by field, of:
#   meta-llama/Llama-3.2-1B  (huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json)
#   Qwen/Qwen3-1.7B          (huggingface.co/Qwen/Qwen3-1.7B/blob/main/config.json)
#   Qwen/Qwen3-4B            (huggingface.co/Qwen/Qwen3-4B/blob/main/config.json)
# rope_theta / rope_scaling of those files are written here as transformers 5's rope_parameters.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "qwen3-1.7b": (
        "qwen3",
        _qwen3(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16),
    ),
    "qwen3-4b": (
        "qwen3",
        _qwen3(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
    ),
    # A mixture of experts of Granite-3.1-1B-A400M's sizes (ibm-granite/granite-3.1-1b-a400m-base:
    # 24 layers, hidden 1024, 16 heads, 8 KV heads, 32 experts of width 512, top 8, tied head) as a
    # Qwen3-MoE network, which llama.cpp's converter and the engine both read: 1.3B parameters,
    # about 0.43B of them active a token.
    "moe-1b-a400m": (
        "qwen3_moe",
        dict(
            hidden_size=1024,
            intermediate_size=512,
            moe_intermediate_size=512,
            num_experts=32,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=49152,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
}

# Small enough that 36 random layers keep the activations finite in bf16; it is also the real
# configs' initializer_range, which transformers' init reads.
INIT_STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def default_tokenizer_dir() -> Path:
    from compiled_engine.weights.default_model import default_model_dir

    source = default_model_dir()
    if not (source / "tokenizer.json").is_file():
        sys.exit(f"real_shapes.py: no tokenizer in {source}; run `python -m compiled_engine prepare` first")
    return source


def is_complete(out: Path) -> bool:
    """A directory this script finished: it writes `complete.json` last."""
    return (out / "complete.json").is_file()


def write_random_model(name: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Builds `name`'s shape with random bf16 weights and saves it with the tokenizer of
    `tokenizer_dir` into `out` (replaced when incomplete)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from compiled_engine.weights.default_model import BOS_TOKEN_ID, EOS_TOKEN_ID

    model_type, fields = SHAPES[name]
    config = AutoConfig.for_model(
        model_type,
        **fields,
        initializer_range=INIT_STD,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
    )
    if out.exists():
        shutil.rmtree(out)
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    torch.manual_seed(seed)
    started = time.perf_counter()
    # Built directly in bf16: one copy of the weights (8 GB for the 4B shape), never an fp32 one.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(partial, safe_serialization=True)
    del model
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy2(tokenizer_dir / file, partial / file)
    (partial / "complete.json").write_text(json.dumps({"shape": name, "parameters": params, "seed": seed}) + "\n")
    partial.rename(out)
    print(f"{name}: {params / 1e9:.3f}B parameters in {time.perf_counter() - started:.0f} s -> {out}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", nargs="+", choices=sorted(SHAPES), help="build these shapes only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer_dir = default_tokenizer_dir()
    for name in args.only or list(SHAPES):
        target = args.out / name
        if is_complete(target):
            print(f"{name}: already complete, skipped -> {target}")
            continue
        write_random_model(name, target, tokenizer_dir, args.seed)


if __name__ == "__main__":
    main()
