"""`python -m compiled_engine` / `compiled-engine`: prepare, generate, verify."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from compiled_engine.cache.kv_cache import DEFAULT_PAGE_SIZE
from compiled_engine.config import DTYPES, EngineConfig
from compiled_engine.errors import CompiledEngineError


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local model directory or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="tokens per KV page")
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages (default: as many as --kv-cache-memory-gib holds)")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=None)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        max_model_len=args.max_model_len,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compiled-engine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("prepare", help="build the embedded default model once (prints its directory last)")

    generate = commands.add_parser("generate", help="greedy continuation of one prompt")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    generate.add_argument("--max-tokens", type=int, default=128)
    _add_engine_options(generate)

    verify = commands.add_parser("verify", help="compare greedy output with the transformers reference")
    verify.add_argument("--prompts", type=Path, default=None, help=".json list or one prompt per line")
    verify.add_argument("--chat", action="store_true", help="treat the prompts of a text file as chat messages")
    verify.add_argument("--max-tokens", type=int, default=64)
    _add_engine_options(verify)
    return parser


def cmd_prepare(args: argparse.Namespace) -> int:
    from compiled_engine.model.default_model import prepare_default_model

    print(prepare_default_model())
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from compiled_engine.engine.generator import Generator
    from compiled_engine.engine.model_runner import ModelRunner
    from compiled_engine.model.source import resolve_model_dir
    from compiled_engine.tokenizer import Tokenizer

    config = _engine_config(args)
    started = time.perf_counter()
    model_dir = resolve_model_dir(config.model)
    runner = ModelRunner(model_dir, config)
    tokenizer = Tokenizer(model_dir)
    model_load_ms = (time.perf_counter() - started) * 1000
    prompt_ids = tokenizer.encode_prompt(args.prompt, args.chat)
    generator = Generator(runner)
    [result] = generator.generate([prompt_ids], args.max_tokens, tokenizer.eos_token_ids)
    print(tokenizer.decode(result.token_ids))
    t = generator.last_timings
    stats = {
        "model_load_ms": f"{model_load_ms:.1f}",
        "prefill_ms": f"{t.prefill_ms:.1f}",
        "ttft_ms": f"{t.ttft_ms:.1f}",
        "mean_tpot_ms": f"{t.mean_tpot_ms:.2f}",
        "decode_tokens_per_s": f"{t.decode_tokens_per_s:.1f}",
        "prompt_tokens": str(len(prompt_ids)),
        "output_tokens": str(len(result.token_ids)),
        "finish_reason": str(result.finish_reason),
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
    }
    print(" ".join(f"{k}={v}" for k, v in stats.items()), file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from compiled_engine.verify import verify

    return verify(_engine_config(args), args.prompts, args.chat, args.max_tokens)


COMMANDS = {"prepare": cmd_prepare, "generate": cmd_generate, "verify": cmd_verify}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return COMMANDS[args.command](args)
    except (CompiledEngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
