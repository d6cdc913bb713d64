"""`python -m compiled_engine.bench latency|offline`: our figures, a same-run baseline, a ceiling.

    python -m compiled_engine.bench latency --prompt-len 512 --output-len 128 --baseline hf --json out.json
    python -m compiled_engine.bench offline --num-seqs 32 --input-len 100 1024 --output-len 100 1024 --baseline hf
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from compiled_engine.bench.bandwidth import measure_read_bandwidth
from compiled_engine.bench.environment import environment
from compiled_engine.bench.hf_baseline import BaselineUnavailable, hf_generate_seconds, load_hf
from compiled_engine.bench.runs import Workload, random_workload, run_hf, run_ours, weight_bytes
from compiled_engine.config import DTYPES, EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.errors import CompiledEngineError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m compiled_engine.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("latency", "offline"):
        sub = commands.add_parser(name)
        sub.add_argument("--model", default=None)
        sub.add_argument("--device", choices=["cpu", "cuda"], default=None)
        sub.add_argument("--dtype", choices=sorted(DTYPES), default=None)
        sub.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
        sub.add_argument("--baseline", choices=["none", "hf"], default="none")
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--json", type=Path, default=None, help="write every figure and the environment here")
    latency = commands.choices["latency"]
    latency.add_argument("--prompt-len", type=int, default=512)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--repeats", type=int, default=3)
    offline = commands.choices["offline"]
    offline.add_argument("--num-seqs", type=int, default=256)
    offline.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    offline.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    offline.add_argument("--max-num-seqs", type=int, default=256)
    offline.add_argument("--hf-batch-size", type=int, default=32)
    return parser


def _engine(args: argparse.Namespace, **options: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, kv_cache_memory_gib=args.kv_cache_memory_gib, **options))


def _baseline(args: argparse.Namespace, engine: LLMEngine) -> tuple[Any, str | None]:
    if args.baseline != "hf":
        return None, None
    try:
        return load_hf(engine.model_dir, engine.runner.dtype, engine.runner.device), None
    except BaselineUnavailable as exc:
        return None, str(exc)


def _print_comparison(
    console: Console, title: str, result: dict[str, Any], rows: tuple[tuple[str, str], ...], extra: tuple[str, str]
) -> None:
    """Ours beside the baseline, one row per figure, then one row of ours alone."""
    table = Table(title=title)
    for column in ("", "ours", "hf", "ours / hf"):
        table.add_column(column)
    ours, hf, ratios = result["ours"], result.get("hf", {}), result.get("ratio_vs_hf", {})
    for key, label in rows:
        ratio = ratios.get(key)
        table.add_row(label, f"{ours[key]:.1f}", f"{hf[key]:.1f}" if key in hf else "-", f"{ratio:.2f}x" if ratio else "-")
    table.add_row(extra[0], extra[1], "-", "-")
    console.print(table)
    if "error" in hf:
        console.print(f"[yellow]baseline hf did not run: {hf['error']}[/yellow]")


def bench_latency(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    engine = _engine(args, enable_prefix_caching=False)  # every repeat must compute its prompt
    vocab = engine.runner.model_config.vocab_size
    prompt_len, output_len = args.prompt_len, args.output_len
    prefill = random_workload(vocab, 1, (prompt_len, prompt_len), (1, 1), args.seed)
    decode = random_workload(vocab, 1, (prompt_len, prompt_len), (output_len, output_len), args.seed + 1)
    run_ours(engine, random_workload(vocab, 1, (8, 8), (2, 2), args.seed + 2))  # warm-up
    ttfts = [run_ours(engine, prefill)["ttft_s"][0] for _ in range(args.repeats)]
    tpots = [run_ours(engine, decode)["tpot_s"][0] for _ in range(args.repeats)]
    ceiling = measure_read_bandwidth(engine.runner.device)
    weights = weight_bytes(engine)
    ttft, tpot = statistics.median(ttfts), statistics.median(tpots)
    ours = {
        "ttft_s": ttft, "prefill_tokens_per_s": prompt_len / ttft,
        "decode_ms_per_token": tpot * 1000, "decode_tokens_per_s": 1 / tpot,
        "weight_bytes": weights, "effective_bandwidth_bytes_per_s": weights / tpot,
        "bandwidth_fraction": weights / tpot / ceiling,
    }
    result: dict[str, Any] = {"ours": ours}
    model, why = _baseline(args, engine)
    if model is not None:
        device = engine.runner.device
        hf_generate_seconds(model, prefill.prompts, 2, device)  # warm-up
        hf_prefill = statistics.median(hf_generate_seconds(model, prefill.prompts, 1, device) for _ in range(args.repeats))
        hf_total = statistics.median(hf_generate_seconds(model, decode.prompts, output_len, device) for _ in range(args.repeats))
        hf_tpot = (hf_total - hf_prefill) / max(output_len - 1, 1)
        result["hf"] = {
            "ttft_s": hf_prefill, "prefill_tokens_per_s": prompt_len / hf_prefill,
            "decode_ms_per_token": hf_tpot * 1000, "decode_tokens_per_s": 1 / hf_tpot,
        }
        result["ratio_vs_hf"] = {k: ours[k] / result["hf"][k] for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
    elif why:
        result["hf"] = {"error": why}
    _print_comparison(
        console, f"latency: prompt {prompt_len}, output {output_len}, batch 1", result,
        (("prefill_tokens_per_s", "prefill tokens/s"), ("decode_tokens_per_s", "decode tokens/s"), ("decode_ms_per_token", "decode ms/token")),
        ("weight bandwidth", f"{ours['effective_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s ({ours['bandwidth_fraction']:.0%} of {ceiling / 1e9:.1f} measured)"),
    )
    return {"benchmark": "latency", "workload": {"prompt_len": prompt_len, "output_len": output_len, "repeats": args.repeats, "seed": args.seed}, "bandwidth_ceiling_bytes_per_s": ceiling, "results": result, "environment": environment(engine.runner.device, engine.runner.dtype, engine.model_dir)}


def bench_offline(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    engine = _engine(args, max_num_seqs=args.max_num_seqs)
    workload: Workload = random_workload(engine.runner.model_config.vocab_size, args.num_seqs, tuple(args.input_len), tuple(args.output_len), args.seed)
    run_ours(engine, random_workload(engine.runner.model_config.vocab_size, 1, (8, 8), (2, 2), args.seed + 1))  # warm-up
    ours_run = run_ours(engine, workload)
    ceiling = measure_read_bandwidth(engine.runner.device)
    seconds = ours_run["seconds"]
    ours = {
        "seconds": seconds, "steps": ours_run["steps"],
        "output_tokens_per_s": workload.output_tokens / seconds,
        "total_tokens_per_s": (workload.prompt_tokens + workload.output_tokens) / seconds,
        "bytes_read": ours_run["bytes_read"],
        "bandwidth_fraction": ours_run["bytes_read"] / seconds / ceiling,
    }
    result: dict[str, Any] = {"ours": ours}
    model, why = _baseline(args, engine)
    if model is not None:
        hf_run = run_hf(model, workload, args.hf_batch_size, engine.runner.device)
        result["hf"] = {
            "seconds": hf_run["seconds"],
            "output_tokens_per_s": workload.output_tokens / hf_run["seconds"],
            "total_tokens_per_s": (workload.prompt_tokens + workload.output_tokens) / hf_run["seconds"],
            "batch_size": args.hf_batch_size,
        }
        result["ratio_vs_hf"] = {k: ours[k] / result["hf"][k] for k in ("output_tokens_per_s", "total_tokens_per_s")}
    elif why:
        result["hf"] = {"error": why}
    _print_comparison(
        console, f"offline: {args.num_seqs} requests, input {args.input_len}, output {args.output_len}", result,
        (("output_tokens_per_s", "output tokens/s"), ("total_tokens_per_s", "total tokens/s")),
        ("bandwidth used", f"{ours['bandwidth_fraction']:.0%} of {ceiling / 1e9:.1f} GB/s measured"),
    )
    workload_info = {"num_seqs": args.num_seqs, "input_len": args.input_len, "output_len": args.output_len, "prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens, "seed": args.seed, "ignore_eos": True}
    return {"benchmark": "offline", "workload": workload_info, "bandwidth_ceiling_bytes_per_s": ceiling, "results": result, "environment": environment(engine.runner.device, engine.runner.dtype, engine.model_dir)}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(stderr=False)
    try:
        report = bench_latency(args, console) if args.command == "latency" else bench_offline(args, console)
    except (CompiledEngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
