"""Sliding-window perplexity of the engine's model on a fixed text, and the bench's `perplexity` command.

Windows of `window` tokens start every `stride` tokens; each scores the tokens past the previous
window's end (the first scores all but its first token), each with the tokens before it in its window
as context. With stride < window every token but the text's first is scored once; with stride ==
window a window's first token has no context and is not scored. Each window runs through the
engine's own runner as the prefill of a fresh sequence on pages of the engine's pool, freed after it.

python -m compiled_engine.bench perplexity --formats none,int8,int4,gguf --window 1024 --stride 512
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from compiled_engine.bench.environment import environment
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.step_inputs import StepInputs
from compiled_engine.engine_options import add_engine_options, engine_config_from_args
from compiled_engine.model.source import resolve_model_dir
from compiled_engine.tokenizer import Tokenizer

TEXT_PATH = Path(__file__).parent / "data" / "alice_in_wonderland.txt"
# Each format's EngineConfig.quantization; "gguf" is the checkpoint's own weights (a GGUF's
# quantized tensors as they are).
FORMATS: dict[str, str | None] = {"none": "none", "int8": "int8", "int4": "int4", "gguf": None}
TOLERANCE = 0.01  # a format passes when its perplexity is within 1% of the first format's


@dataclass(frozen=True)
class PerplexityResult:
    tokens_scored: int
    windows: int
    mean_nll: float  # nats per scored token

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, first scored, end) of each window: it runs tokens [begin, end) and scores the
    tokens [first scored, end), each predicted from the tokens before it in the window."""
    spans = []
    previous_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        spans.append((begin, max(previous_end, begin + 1), end))
        previous_end = end
        if end == num_tokens:
            break
    return spans


def check_window(window: int, stride: int) -> None:
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be between 1 and the window ({window}), got {stride}")


@torch.inference_mode()
def _window_nll(engine: LLMEngine, ids: list[int], first_scored: int) -> float:
    """The summed NLL of ids[first_scored:] given the tokens before each, from one prefill of a
    fresh sequence (in chunks of at most max_num_batched_tokens, as the scheduler would run it)."""
    runner = engine.runner
    chunk = engine.config.max_num_batched_tokens
    table: list[int] = []
    engine.block_manager.grow(table, len(ids))
    total = torch.zeros((), dtype=torch.float64, device=runner.device)
    try:
        for start in range(0, len(ids), chunk):
            end = min(start + chunk, len(ids))
            rows = range(max(start, first_scored - 1), min(end, len(ids) - 1))  # rows whose next token is scored
            inputs = StepInputs(ids[start:end], list(range(start, end)), [end - start], [end], [table])
            hidden = runner.hidden_states(inputs)
            if not rows:
                continue
            logits = runner.forward.logits(hidden[rows.start - start : rows.stop - start])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor(ids[rows.start + 1 : rows.stop + 1], dtype=torch.int64, device=runner.device)
            total -= logprobs.gather(1, targets[:, None]).sum(dtype=torch.float64)
    finally:
        engine.block_manager.free(table)
    return float(total.item())


def perplexity(engine: LLMEngine, token_ids: list[int], window: int, stride: int) -> PerplexityResult:
    """Sliding-window perplexity of `token_ids` under the engine's model (see the module docstring)."""
    check_window(window, stride)
    if len(token_ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(token_ids)}")
    if window > engine.max_model_len:
        raise ValueError(f"window of {window} tokens exceeds the engine's max_model_len of {engine.max_model_len}")
    if engine.tensor_parallel is not None:
        raise ValueError("perplexity runs on a single-process engine (tensor_parallel_size 1)")
    vocab = engine.runner.model_config.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the model's vocabulary of {vocab}")
    spans = windows(len(token_ids), window, stride)
    nll = sum(_window_nll(engine, token_ids[begin:end], scored - begin) for begin, scored, end in spans)
    scored = sum(end - first for _, first, end in spans)
    return PerplexityResult(tokens_scored=scored, windows=len(spans), mean_nll=nll / scored)


# -- the bench command ----------------------------------------------------------------------------


def _formats(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in FORMATS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"formats are a comma-separated list of {', '.join(FORMATS)}; got {value!r}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a format is listed twice in {value!r}")
    return names


def add_perplexity_command(commands: Any) -> argparse.ArgumentParser:
    """Declare `perplexity` on the bench's subcommands (`commands`: argparse's subparsers)."""
    sub: argparse.ArgumentParser = commands.add_parser(
        "perplexity", help="sliding-window perplexity of each weight format on the shipped text"
    )
    # Each format sets the quantization; the group size is this command's own option below.
    add_engine_options(sub, exclude={"quantization", "quantization_group_size"})
    sub.add_argument(
        "--formats",
        type=_formats,
        default=list(FORMATS),
        help=f"comma-separated weight formats, the first the reference (default: {','.join(FORMATS)}; "
        "none = dense weights, gguf = the checkpoint's own)",
    )
    sub.add_argument("--window", type=int, default=1024, metavar="N", help="tokens per window (default: 1024)")
    sub.add_argument("--stride", type=int, default=512, metavar="N", help="tokens between window starts (default: 512)")
    sub.add_argument("--max-tokens", type=int, default=None, metavar="N", help="score only the text's first N tokens")
    sub.add_argument(
        "--quantization-group-size",
        dest="perplexity_group_size",
        type=int,
        default=None,
        metavar="N",
        help="weights per scale for the int8 and int4 formats (default: per channel for int8, 32 for int4)",
    )
    sub.add_argument("--json", type=Path, default=None, help="write every figure and the environment here")
    sub.set_defaults(plot=None)
    return sub


def _free(engine: LLMEngine) -> None:
    engine.shutdown()
    device = engine.runner.device
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_perplexity(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    check_window(args.window, args.stride)
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    model_dir = resolve_model_dir(args.model)
    text = TEXT_PATH.read_bytes()
    token_ids = Tokenizer(model_dir).encode(text.decode("utf-8"))
    if args.max_tokens is not None:
        token_ids = token_ids[: args.max_tokens]
    rows: list[dict[str, Any]] = []
    env: dict[str, Any] = {}
    for name in args.formats:
        quantization = FORMATS[name]
        group_size = args.perplexity_group_size if quantization in ("int8", "int4") else None
        engine = LLMEngine(engine_config_from_args(args, quantization=quantization, quantization_group_size=group_size))
        try:
            started = time.perf_counter()
            result = perplexity(engine, token_ids, args.window, args.stride)
            seconds = time.perf_counter() - started
            if not env:
                env = environment(engine.runner.device, engine.runner.dtype, engine.model_dir)
            weights = getattr(engine.runner, "weights_description", None)
        finally:
            _free(engine)
        rows.append(
            {
                "format": name,
                "quantization": quantization,
                "weights": weights,
                "tokens_scored": result.tokens_scored,
                "windows": result.windows,
                "mean_nll": result.mean_nll,
                "perplexity": result.perplexity,
                "seconds": seconds,
            }
        )
        console.print(
            f"{name}: perplexity {result.perplexity:.4f} over {result.tokens_scored} tokens ({seconds:.1f} s)"
        )
    reference = rows[0]["perplexity"]
    for row in rows:
        row["ratio"] = row["perplexity"] / reference
        row["within_tolerance"] = abs(row["ratio"] - 1) <= TOLERANCE
    table = Table(
        title=f"perplexity: {TEXT_PATH.name}, {len(token_ids)} tokens, window {args.window}, stride {args.stride} "
        f"({env.get('device')}, {env.get('dtype')})"
    )
    for column in ("format", "tokens scored", "perplexity", f"/ {rows[0]['format']}", f"within {TOLERANCE:.0%}"):
        table.add_column(column)
    for i, row in enumerate(rows):
        verdict = "reference" if i == 0 else ("yes" if row["within_tolerance"] else "NO")
        table.add_row(
            row["format"], str(row["tokens_scored"]), f"{row['perplexity']:.4f}", f"{row['ratio']:.4f}", verdict
        )
    console.print(table)
    return {
        "benchmark": "perplexity",
        "workload": {
            "text": TEXT_PATH.name,
            "text_sha256": hashlib.sha256(text).hexdigest(),
            "tokens": len(token_ids),
            "window": args.window,
            "stride": args.stride,
            "max_tokens": args.max_tokens,
            "formats": args.formats,
            "tolerance": TOLERANCE,
        },
        "results": rows,
        "environment": env,
    }
