"""Sliding-window perplexity of the engine's model on a fixed text, and the bench's `perplexity` command.

Windows of `window` tokens start every `stride` tokens; each scores the tokens past the previous
window's end (the first scores all but its first token), each with the tokens before it in its window
as context. With stride < window every token but the text's first is scored once; with stride ==
window a window's first token has no context and is not scored. Each window runs through the
engine's own runner as the prefill of a fresh sequence on pages of the engine's pool, freed after it.

A format is a weight format of the model (`none`, `int8`, `int4`, `gguf`: its own GGUF's tensors)
or a GGUF file of the same model (a path ending in .gguf: each quantization llama.cpp makes, side
by side). `--baseline hf` scores the same windows with transformers on the same weights (a GGUF as
transformers dequantizes it), `--baseline llama-cpp` with llama.cpp on the same GGUF.

python -m compiled_engine.bench perplexity --formats none,int8,int4,gguf --window 1024 --stride 512
python -m compiled_engine.bench perplexity --formats m-Q4_K_M.gguf,m-Q6_K.gguf --baseline hf --max-tokens 4096
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
from compiled_engine.bench.hf_baseline import BaselineUnavailable, load_hf
from compiled_engine.bench.llama_cpp_baseline import load_llama_cpp
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine_options import add_engine_options, engine_config_from_args
from compiled_engine.executor.step import StepInputs
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.weights.gguf import gguf_file
from compiled_engine.weights.source import resolve_model_dir

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
    if engine.ranks is not None:
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
    unknown = [name for name in names if name not in FORMATS and not name.endswith(".gguf")]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"formats are a comma-separated list of {', '.join(FORMATS)} or .gguf files; got {value!r}"
        )
    missing = [name for name in names if name.endswith(".gguf") and not Path(name).is_file()]
    if missing:
        raise argparse.ArgumentTypeError(f"no such GGUF file: {', '.join(missing)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a format is listed twice in {value!r}")
    return names


def add_perplexity_command(commands: Any) -> argparse.ArgumentParser:
    """Declare `perplexity` on the bench's subcommands (`commands`: argparse's subparsers)."""
    sub: argparse.ArgumentParser = commands.add_parser(
        "perplexity", help="sliding-window perplexity of each weight format on the shipped text"
    )
    # Each format sets the quantization; the group size is this command's own option below.
    add_engine_options(sub, exclude={"quantization", "quantization_group_size", "data_parallel_size"})
    sub.add_argument(
        "--formats",
        type=_formats,
        default=list(FORMATS),
        help=f"comma-separated weight formats, the first the reference (default: {','.join(FORMATS)}; "
        "none = dense weights, gguf = the checkpoint's own, path.gguf = that GGUF file of the same model)",
    )
    sub.add_argument(
        "--baseline",
        choices=["none", "hf", "llama-cpp"],
        default="none",
        help="score the same windows with transformers on the same weights (hf: dense ones, or a GGUF as "
        "transformers dequantizes it) or with llama.cpp on the same GGUF (llama-cpp)",
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


@torch.inference_mode()
def hf_perplexity(model: Any, token_ids: list[int], window: int, stride: int) -> PerplexityResult:
    """`perplexity` of transformers' model over the same windows: each window one forward."""
    nll, scored = 0.0, 0
    spans = windows(len(token_ids), window, stride)
    for begin, first, end in spans:
        logits = model(torch.tensor([token_ids[begin:end]])).logits[0].float()
        nll += _scored_nll(logits, token_ids[begin:end], first - begin)
        scored += end - first
    return PerplexityResult(tokens_scored=scored, windows=len(spans), mean_nll=nll / scored)


def llama_cpp_perplexity(gguf: Path, token_ids: list[int], window: int, stride: int) -> PerplexityResult:
    """`perplexity` of llama.cpp on `gguf` over the same windows, from its logits of every token."""
    llm = load_llama_cpp(gguf, window, logits_all=True)
    nll, scored = 0.0, 0
    spans = windows(len(token_ids), window, stride)
    for begin, first, end in spans:
        llm.reset()
        llm.eval(token_ids[begin:end])
        logits = torch.from_numpy(llm.scores[: end - begin].copy()).float()
        nll += _scored_nll(logits, token_ids[begin:end], first - begin)
        scored += end - first
    return PerplexityResult(tokens_scored=scored, windows=len(spans), mean_nll=nll / scored)


def _scored_nll(logits: torch.Tensor, ids: list[int], first_scored: int) -> float:
    """Summed NLL of ids[first_scored:] from `logits` [len(ids), vocab] (row i predicts ids[i + 1])."""
    logprobs = torch.log_softmax(logits[first_scored - 1 : len(ids) - 1].double(), dim=-1)
    targets = torch.tensor(ids[first_scored:], dtype=torch.int64)
    return float(-logprobs.gather(1, targets[:, None]).sum())


def _baseline_perplexity(
    args: argparse.Namespace, model_dir: Path, quantization: str | None, token_ids: list[int]
) -> tuple[float | None, str | None]:
    """The baseline's perplexity on the weights this format runs, or (None, why not)."""
    if args.baseline == "none":
        return None, None
    gguf = gguf_file(model_dir)
    try:
        if quantization in ("int8", "int4"):
            raise BaselineUnavailable(f"{args.baseline} has no {quantization} format of its own")
        if args.baseline == "hf":
            on_gguf = quantization is None and gguf is not None
            model = load_hf(model_dir, torch.float32, torch.device("cpu"), gguf.name if gguf and on_gguf else None)
            return hf_perplexity(model, token_ids, args.window, args.stride).perplexity, None
        if quantization is not None or gguf is None:
            raise BaselineUnavailable("llama.cpp runs GGUF files only")
        return llama_cpp_perplexity(gguf, token_ids, args.window, args.stride).perplexity, None
    except BaselineUnavailable as exc:
        return None, str(exc)


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
    # Every GGUF file is checked before any runs: it must be the same model's (its vocabulary
    # encodes the text to the same ids), or the comparison means nothing.
    for name in args.formats:
        if (
            name.endswith(".gguf")
            and Tokenizer(resolve_model_dir(name)).encode(text.decode("utf-8"))[: len(token_ids)] != token_ids
        ):
            raise ValueError(f"{name} tokenizes the text differently from {args.model or 'the model'}: another model")
    for name in args.formats:
        quantization = FORMATS.get(name)  # None for a GGUF file: its own tensors
        group_size = args.perplexity_group_size if quantization in ("int8", "int4") else None
        model = {"model": name} if name.endswith(".gguf") else {}
        config = engine_config_from_args(args, quantization=quantization, quantization_group_size=group_size, **model)
        engine = LLMEngine(config)
        try:
            started = time.perf_counter()
            result = perplexity(engine, token_ids, args.window, args.stride)
            seconds = time.perf_counter() - started
            if not env:
                env = environment(engine.runner.device, engine.runner.dtype, engine.model_dir)
            weights = getattr(engine.runner, "weights_description", None)
            format_dir = engine.model_dir
        finally:
            _free(engine)
        baseline, why_not = _baseline_perplexity(args, format_dir, quantization, token_ids)
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
                "baseline_perplexity": baseline,
                "baseline_error": why_not,
            }
        )
        against = "" if baseline is None else f"; {args.baseline} {baseline:.4f} ({result.perplexity / baseline:.5f}x)"
        console.print(
            f"{name}: perplexity {result.perplexity:.4f} over {result.tokens_scored} tokens ({seconds:.1f} s){against}"
        )
        if why_not is not None:
            console.print(f"[yellow]{name}: baseline {args.baseline} did not run: {why_not}[/yellow]")
    reference = rows[0]["perplexity"]
    for row in rows:
        row["ratio"] = row["perplexity"] / reference
        row["within_tolerance"] = abs(row["ratio"] - 1) <= TOLERANCE
    table = Table(
        title=f"perplexity: {TEXT_PATH.name}, {len(token_ids)} tokens, window {args.window}, stride {args.stride} "
        f"({env.get('device')}, {env.get('dtype')})"
    )
    columns = ["format", "tokens scored", "perplexity", f"/ {Path(rows[0]['format']).name}", f"within {TOLERANCE:.0%}"]
    if args.baseline != "none":
        columns += [args.baseline, f"ours / {args.baseline}"]
    for column in columns:
        table.add_column(column)
    for i, row in enumerate(rows):
        verdict = "reference" if i == 0 else ("yes" if row["within_tolerance"] else "NO")
        cells = [Path(row["format"]).name, str(row["tokens_scored"]), f"{row['perplexity']:.4f}", f"{row['ratio']:.4f}"]
        cells.append(verdict)
        if args.baseline != "none":
            theirs = row["baseline_perplexity"]
            cells += ["-", "-"] if theirs is None else [f"{theirs:.4f}", f"{row['perplexity'] / theirs:.5f}"]
        table.add_row(*cells)
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
            "baseline": args.baseline,
            "tolerance": TOLERANCE,
        },
        "results": rows,
        "environment": env,
    }
