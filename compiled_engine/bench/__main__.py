"""`python -m compiled_engine.bench latency|offline|serve|perplexity|lora|spec|structured`: our figures, a same-run baseline, a ceiling.

python -m compiled_engine.bench latency --prompt-len 512 --output-len 128 --baseline hf --json out.json
python -m compiled_engine.bench offline --num-seqs 32 --input-len 100 1024 --output-len 100 1024 --baseline hf
python -m compiled_engine.bench offline --num-seqs 32 --input-len 100 300 --output-len 128 128 --baseline vllm --vllm ~/vllm-venv/bin/python
python -m compiled_engine.bench serve --concurrency 1 4 16 --baseline hf --plot serve.png
python -m compiled_engine.bench serve --base-url http://127.0.0.1:8000 --request-rate 2 8 inf
python -m compiled_engine.bench serve --concurrency 1 16 --repeated-prompts --baseline llama-server
python -m compiled_engine.bench serve --concurrency 1 16 --baseline vllm --vllm ~/vllm-venv/bin/python
python -m compiled_engine.bench perplexity --formats none,int8,int4,gguf --window 1024 --stride 512
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from compiled_engine.bench.bandwidth import measure_read_bandwidth
from compiled_engine.bench.environment import environment
from compiled_engine.bench.hf_baseline import BaselineUnavailable, hf_generate_seconds, load_hf
from compiled_engine.bench.llama_cpp_baseline import (
    llama_cpp_decode_seconds,
    llama_cpp_prefill_seconds,
    load_llama_cpp,
)
from compiled_engine.bench.llama_server_baseline import find_llama_server, llama_server
from compiled_engine.bench.lora import bench_lora_runs
from compiled_engine.bench.perplexity import add_perplexity_command, bench_perplexity
from compiled_engine.bench.plots import PlotUnavailable, check_plotting, write_plot
from compiled_engine.bench.runs import run_hf, run_hf_as_server, run_ours, weight_bytes
from compiled_engine.bench.serving import run_load, summarize
from compiled_engine.bench.speculative import bench_speculative_runs
from compiled_engine.bench.structured import bench_structured_runs
from compiled_engine.bench.vllm_baseline import (
    START_TIMEOUT_S,
    find_vllm_python,
    vllm_offline_latency,
    vllm_offline_throughput,
    vllm_server,
)
from compiled_engine.bench.workload import Workload, random_workload
from compiled_engine.config import DTYPES
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine_options import add_engine_options, engine_config_from_args
from compiled_engine.errors import CompiledEngineError
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.serving.client import EngineClient
from compiled_engine.serving.handle import ThreadHandle
from compiled_engine.serving.replica import replica_handles
from compiled_engine.weights.gguf import gguf_file
from compiled_engine.weights.source import resolve_model_dir


def _add_report_options(sub: argparse.ArgumentParser, plot: bool) -> None:
    """--json, and --plot for the benchmarks plots.py draws."""
    sub.add_argument("--json", type=Path, default=None, help="write every figure and the environment here")
    if plot:
        sub.add_argument(
            "--plot", type=Path, default=None, help="draw ours vs the baseline into this PNG (needs matplotlib)"
        )
    else:
        sub.set_defaults(plot=None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m compiled_engine.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("latency", "offline", "serve"):
        sub = commands.add_parser(name)
        # latency turns prefix caching off itself; --seed is the workload's (below); only serve
        # runs data-parallel replicas (behind its front end)
        excluded = {"seed", "enable_prefix_caching"} if name == "latency" else {"seed"}
        add_engine_options(sub, exclude=excluded if name == "serve" else {*excluded, "data_parallel_size"})
        extra = {
            "latency": ["llama-cpp", "vllm"],
            "offline": ["vllm"],
            "serve": ["llama-server", "vllm", "one-engine"],
        }[name]
        sub.add_argument(
            "--baseline",
            choices=["none", "hf", *extra],
            default="none",
            help="the same workload in the same run through transformers (hf); for latency, "
            "llama.cpp on the same GGUF (llama-cpp) or vLLM's offline LLM on the same model directory and "
            "dtype (vllm); for offline, vLLM's offline LLM as for latency (vllm); for serve, llama.cpp's "
            "server on the same GGUF (llama-server), "
            "vLLM's server on the same model directory and dtype (vllm), "
            "or, with --data-parallel-size, one engine on all the cores (one-engine)",
        )
        sub.add_argument("--seed", type=int, default=0, help="seed of the random workload")
        _add_report_options(sub, plot=True)
    latency = commands.choices["latency"]
    latency.add_argument("--prompt-len", type=int, default=512)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--repeats", type=int, default=3)
    offline = commands.choices["offline"]
    offline.add_argument("--num-seqs", type=int, default=256)
    offline.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    offline.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    offline.add_argument("--hf-batch-size", type=int, default=32)
    serve = commands.choices["serve"]
    serve.add_argument(
        "--base-url",
        default=None,
        help="an OpenAI-compatible server to drive instead of ours; --model names its model (prompts use its vocabulary)",
    )
    serve.add_argument("--api-key", default=None, help="bearer key for --base-url")
    serve.add_argument("--num-prompts", type=int, default=64, help="requests per sweep point")
    serve.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    serve.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    load = serve.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help="closed loop: this many requests in flight (a sweep; default 1 4 16 64)",
    )
    load.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=None,
        help="open loop: Poisson arrivals per second (a sweep; inf = all at once)",
    )
    serve.add_argument(
        "--max-concurrency", type=int, default=None, help="with --request-rate: cap on requests in flight"
    )
    serve.add_argument(
        "--repeated-prompts",
        action="store_true",
        help="after each load point's fresh prompts, send the same prompts again (a warm prompt cache)",
    )
    serve.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="the llama-server binary for --baseline llama-server (default: $LLAMA_SERVER, then the PATH's)",
    )
    for name in ("latency", "offline", "serve"):
        commands.choices[name].add_argument(
            "--vllm",
            default=None,
            metavar="PATH",
            help="the python of a vLLM environment (or its folder) for --baseline vllm (default: $VLLM)",
        )
    add_perplexity_command(commands)
    lora = commands.add_parser("lora", help="adapters beside the base model, in the same run")
    add_engine_options(
        lora, exclude={"seed", "enable_lora", "max_loras", "enable_prefix_caching", "data_parallel_size"}
    )
    lora.add_argument("--lora-rank", type=int, default=16)
    lora.add_argument("--num-adapters", type=int, default=4, help="distinct adapters in the batch")
    lora.add_argument("--batch", type=int, default=32)
    lora.add_argument("--prompt-len", type=int, default=128)
    lora.add_argument("--output-len", type=int, default=64)
    lora.add_argument("--seed", type=int, default=0)
    lora.add_argument(
        "--rounds", type=_at_least_one, default=3, help="alternated measurements of each figure (medians)"
    )
    _add_report_options(lora, plot=False)
    spec = commands.add_parser("spec", help="speculative decoding on against off, in the same run")
    add_engine_options(spec, exclude={"seed", "enable_prefix_caching"})
    spec.add_argument("--num-requests", type=int, default=4, help="requests of each one-at-a-time workload")
    spec.add_argument("--concurrency", type=int, default=16, help="repetitive requests run at once")
    spec.add_argument("--output-len", type=int, default=128)
    spec.add_argument("--seed", type=int, default=0)
    _add_report_options(spec, plot=False)
    structured = commands.add_parser("structured", help="JSON-schema-constrained decoding against free, same run")
    add_engine_options(structured, exclude={"seed", "enable_prefix_caching"})
    structured.add_argument("--batch", type=_at_least_one, default=8, help="requests decoding at once")
    structured.add_argument("--output-len", type=_at_least_one, default=64)
    structured.add_argument("--rounds", type=_at_least_one, default=3, help="alternated rounds of each figure")
    _add_report_options(structured, plot=False)
    return parser


DEFAULT_SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


def _check_args(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len"):
        bounds = getattr(args, name, None)
        if not isinstance(bounds, list):
            continue
        low, high = bounds
        if not 1 <= low <= high:
            raise ValueError(f"--{name.replace('_', '-')} MIN MAX needs 1 <= MIN <= MAX, got {low} {high}")
    config = engine_config_from_args(args)  # EngineConfig's own checks, before any work
    if getattr(args, "baseline", None) == "one-engine" and config.data_parallel_size == 1:
        raise ValueError(
            "--baseline one-engine compares data-parallel replicas with one engine: give --data-parallel-size"
        )
    for name in ("num_seqs", "num_prompts", "prompt_len", "output_len", "repeats", "hf_batch_size", "num_requests"):
        value = getattr(args, name, 1)
        if isinstance(value, int) and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    concurrency = getattr(args, "concurrency", None)
    for value in [concurrency] if isinstance(concurrency, int) else concurrency or ():
        if value < 1:
            raise ValueError(f"--concurrency values must be at least 1, got {value}")
    for rate in getattr(args, "request_rate", None) or ():
        if not rate > 0:
            raise ValueError(f"--request-rate values must be positive (or inf), got {rate}")


@contextmanager
def _progress(console: Console, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on a terminal; silent when the output is a file or a pipe."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _engine(args: argparse.Namespace, **overrides: Any) -> LLMEngine:
    return LLMEngine(engine_config_from_args(args, **overrides))


def _engine_info(engine: LLMEngine | None) -> dict[str, Any]:
    if engine is None:
        return {}
    runner = engine.runner
    return {
        "compiled": runner.forward.compiled,
        "cuda_graphs": runner.graphs is not None,
        "compile_seconds": runner.compile_seconds,
        "attention_backend": runner.backend.name,
    }


def _report(benchmark: str, workload: dict[str, Any], results: Any, engine: LLMEngine, **extra: Any) -> dict[str, Any]:
    """What `--json` writes of one benchmark run on `engine`."""
    return {
        "benchmark": benchmark,
        "workload": workload,
        **extra,
        "results": results,
        "environment": environment(engine.runner.device, engine.runner.dtype, engine.model_dir),
        "engine": _engine_info(engine),
    }


def _baseline(args: argparse.Namespace, engine: LLMEngine) -> tuple[Any, str | None]:
    if args.baseline != "hf":
        return None, None
    try:
        return load_hf(engine.model_dir, engine.runner.dtype, engine.runner.device), None
    except BaselineUnavailable as exc:
        return None, str(exc)


def _print_comparison(
    console: Console,
    title: str,
    result: dict[str, Any],
    rows: tuple[tuple[str, str], ...],
    extra: tuple[str, str],
    baseline: str = "hf",
) -> None:
    """Ours beside the baseline (its figures under result[baseline]), one row per figure, then
    one row of ours alone."""
    table = Table(title=title)
    name = baseline.replace("_", "-")
    for column in ("", "ours", name, f"ours / {name}"):
        table.add_column(column)
    ours, hf, ratios = result["ours"], result.get(baseline, {}), result.get(f"ratio_vs_{baseline}", {})
    for key, label in rows:
        ratio = ratios.get(key)
        table.add_row(
            label, f"{ours[key]:.1f}", f"{hf[key]:.1f}" if key in hf else "-", f"{ratio:.2f}x" if ratio else "-"
        )
    table.add_row(extra[0], extra[1], "-", "-")
    console.print(table)
    if "error" in hf:
        console.print(f"[yellow]baseline {name} did not run: {escape(hf['error'])}[/yellow]")


RATIO_KEYS = ("prefill_tokens_per_s", "decode_tokens_per_s")


def _latency_figures(prompt_len: int, ttft: float, tpot: float) -> dict[str, float]:
    """The latency figures of one side from its time to first token and per output token (s)."""
    return {
        "ttft_s": ttft,
        "prefill_tokens_per_s": prompt_len / ttft,
        "decode_ms_per_token": tpot * 1000,
        "decode_tokens_per_s": 1 / tpot,
    }


def _llama_cpp_latency(
    engine: LLMEngine,
    ours: dict[str, float],
    prefill_prompt: list[int],
    decode_prompt: list[int],
    output_len: int,
    repeats: int,
) -> dict[str, Any]:
    """The latency figures of llama.cpp on the engine's own GGUF, keyed as the hf baseline's."""
    try:
        llm = load_llama_cpp(gguf_file(engine.model_dir), len(decode_prompt) + output_len + 8)
    except BaselineUnavailable as exc:
        return {"llama_cpp": {"error": str(exc)}}
    llama_cpp_prefill_seconds(llm, prefill_prompt[:8])  # warm-up
    prefill = statistics.median(llama_cpp_prefill_seconds(llm, prefill_prompt) for _ in range(repeats))
    tpot = statistics.median(llama_cpp_decode_seconds(llm, decode_prompt, output_len) for _ in range(repeats))
    figures = _latency_figures(len(prefill_prompt), prefill, tpot)
    ratios = {k: ours_figure / figures[k] for k, ours_figure in ours.items() if k in RATIO_KEYS}
    return {"llama_cpp": figures, "ratio_vs_llama_cpp": ratios}


def _vllm_latency(
    args: argparse.Namespace,
    where: tuple[Path, torch.dtype],
    ours: dict[str, float],
    prefill_prompt: list[int],
    decode_prompt: list[int],
) -> dict[str, Any]:
    """The latency figures of vLLM's offline LLM on the engine's model directory (`where`: it and
    the engine's dtype) with our prompt token ids, keyed as the llama-cpp baseline's."""
    model_dir, dtype = where
    try:
        python = find_vllm_python(args.vllm)
        ttft, tpot = vllm_offline_latency(
            python,
            model_dir,
            dtype,
            torch.get_num_threads(),
            prefill_prompt,
            decode_prompt,
            args.output_len,
            args.repeats,
            seed=args.seed,
            enforce_eager=bool(args.enforce_eager),
        )
    except BaselineUnavailable as exc:
        return {"vllm": {"error": str(exc)}}
    figures = _latency_figures(len(prefill_prompt), ttft, tpot)
    ratios = {k: ours_figure / figures[k] for k, ours_figure in ours.items() if k in RATIO_KEYS}
    return {"vllm": figures, "ratio_vs_vllm": ratios}


def bench_latency(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    engine = _engine(args, enable_prefix_caching=False)  # every repeat must compute its prompt
    vocab = engine.runner.model_config.vocab_size
    prompt_len, output_len = args.prompt_len, args.output_len
    prefill = random_workload(vocab, 1, (prompt_len, prompt_len), (1, 1), args.seed)
    decode = random_workload(vocab, 1, (prompt_len, prompt_len), (output_len, output_len), args.seed + 1)
    run_ours(engine, random_workload(vocab, 1, (8, 8), (2, 2), args.seed + 2))  # warm-up
    ttfts = [run_ours(engine, prefill)["ttft_s"][0] for _ in range(args.repeats)]
    tpots = [run_ours(engine, decode)["tpot_s"][0] for _ in range(args.repeats)]
    memory = engine_memory(engine)  # before the bandwidth measurement allocates its own buffer
    ceiling = measure_read_bandwidth(engine.runner.device)
    weights = weight_bytes(engine)
    ttft, tpot = statistics.median(ttfts), statistics.median(tpots)
    ours = {
        **_latency_figures(prompt_len, ttft, tpot),
        "weight_bytes": weights,
        "effective_bandwidth_bytes_per_s": weights / tpot,
        "bandwidth_fraction": weights / tpot / ceiling,
        **memory,
    }
    result: dict[str, Any] = {"ours": ours}
    workload = {"prompt_len": prompt_len, "output_len": output_len, "repeats": args.repeats, "seed": args.seed}
    report = _report("latency", workload, result, engine, bandwidth_ceiling_bytes_per_s=ceiling)
    if args.baseline == "vllm":
        where = (engine.model_dir, engine.runner.dtype)
        engine.shutdown()
        del engine  # ours gives back its weights and KV cache before vLLM loads its own
        gc.collect()
        result.update(_vllm_latency(args, where, ours, prefill.prompts[0], decode.prompts[0]))
        model, why = None, None
    elif args.baseline == "llama-cpp":
        result.update(_llama_cpp_latency(engine, ours, prefill.prompts[0], decode.prompts[0], output_len, args.repeats))
        model, why = None, None
    else:
        model, why = _baseline(args, engine)
    if model is not None:
        device = engine.runner.device
        hf_generate_seconds(model, prefill.prompts, 2, device)  # warm-up
        hf_prefill = statistics.median(
            hf_generate_seconds(model, prefill.prompts, 1, device) for _ in range(args.repeats)
        )
        hf_total = statistics.median(
            hf_generate_seconds(model, decode.prompts, output_len, device) for _ in range(args.repeats)
        )
        hf_tpot = (hf_total - hf_prefill) / max(output_len - 1, 1)
        result["hf"] = _latency_figures(prompt_len, hf_prefill, hf_tpot)
        result["ratio_vs_hf"] = {k: ours[k] / result["hf"][k] for k in RATIO_KEYS}
    elif why:
        result["hf"] = {"error": why}
    _print_comparison(
        console,
        f"latency: prompt {prompt_len}, output {output_len}, batch 1",
        result,
        (
            ("prefill_tokens_per_s", "prefill tokens/s"),
            ("decode_tokens_per_s", "decode tokens/s"),
            ("decode_ms_per_token", "decode ms/token"),
        ),
        (
            "weight bandwidth",
            f"{ours['effective_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s ({ours['bandwidth_fraction']:.0%} of {ceiling / 1e9:.1f} measured)",
        ),
        baseline=args.baseline.replace("-", "_") if args.baseline in ("llama-cpp", "vllm") else "hf",
    )
    return report


OFFLINE_RATIO_KEYS = ("output_tokens_per_s", "total_tokens_per_s")


def _throughput_figures(workload: Workload, seconds: float) -> dict[str, float]:
    """The throughput figures of one side from its seconds for the whole workload."""
    return {
        "seconds": seconds,
        "output_tokens_per_s": workload.output_tokens / seconds,
        "total_tokens_per_s": (workload.prompt_tokens + workload.output_tokens) / seconds,
    }


@dataclass(frozen=True)
class OfflineRoom:
    """What our engine ran the offline workload on and with, for vLLM to get the same: the model
    directory, the dtype, the sequences at once, the KV cache's bytes, whether prefix caching was on."""

    model_dir: Path
    dtype: torch.dtype
    max_num_seqs: int
    kv_cache_bytes: int
    enable_prefix_caching: bool


def _vllm_offline(
    args: argparse.Namespace, room: OfflineRoom, ours: dict[str, Any], workload: Workload
) -> dict[str, Any]:
    """The throughput figures of vLLM's offline LLM on the same workload (our prompt token ids and
    output lengths) with the same room, keyed as ours. It may run 20 times as long as ours took,
    beyond its start-up, before it counts as hung."""
    try:
        python = find_vllm_python(args.vllm)
        seconds = vllm_offline_throughput(
            python,
            room.model_dir,
            room.dtype,
            torch.get_num_threads(),
            workload.prompts,
            workload.output_lens,
            room.max_num_seqs,
            room.kv_cache_bytes,
            room.enable_prefix_caching,
            seed=args.seed,
            enforce_eager=bool(args.enforce_eager),
            timeout_s=START_TIMEOUT_S + 20 * ours["seconds"],
        )
    except BaselineUnavailable as exc:
        return {"vllm": {"error": str(exc)}}
    figures = _throughput_figures(workload, seconds)
    return {"vllm": figures, "ratio_vs_vllm": {k: ours[k] / figures[k] for k in OFFLINE_RATIO_KEYS}}


def bench_offline(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    engine = _engine(args)
    vocab = engine.runner.model_config.vocab_size
    workload = random_workload(vocab, args.num_seqs, tuple(args.input_len), tuple(args.output_len), args.seed)
    run_ours(engine, random_workload(vocab, 1, (8, 8), (2, 2), args.seed + 1))  # warm-up
    with _progress(console, "ours", workload.output_tokens) as advance:
        ours_run = run_ours(engine, workload, advance)
    memory = engine_memory(engine)  # before the bandwidth measurement allocates its own buffer
    ceiling = measure_read_bandwidth(engine.runner.device)
    seconds = ours_run["seconds"]
    ours = {
        **_throughput_figures(workload, seconds),
        "steps": ours_run["steps"],
        "bytes_read": ours_run["bytes_read"],
        "bandwidth_fraction": ours_run["bytes_read"] / seconds / ceiling,
        **memory,
    }
    result: dict[str, Any] = {"ours": ours}
    workload_info = {
        "num_seqs": args.num_seqs,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": workload.output_tokens,
        "seed": args.seed,
        "ignore_eos": True,
    }
    report = _report("offline", workload_info, result, engine, bandwidth_ceiling_bytes_per_s=ceiling)
    if args.baseline == "vllm":
        room = OfflineRoom(
            engine.model_dir,
            engine.runner.dtype,
            engine.config.max_num_seqs,
            engine.kv_cache_bytes,
            engine.config.enable_prefix_caching,
        )
        engine.shutdown()
        del engine  # ours gives back its weights and KV cache before vLLM loads its own
        gc.collect()
        result.update(_vllm_offline(args, room, ours, workload))
        model, why = None, None
    else:
        model, why = _baseline(args, engine)
    if model is not None:
        hf_run = run_hf(model, workload, args.hf_batch_size, engine.runner.device)
        result["hf"] = {**_throughput_figures(workload, hf_run["seconds"]), "batch_size": args.hf_batch_size}
        result["ratio_vs_hf"] = {k: ours[k] / result["hf"][k] for k in OFFLINE_RATIO_KEYS}
    elif why:
        result["hf"] = {"error": why}
    _print_comparison(
        console,
        f"offline: {args.num_seqs} requests, input {args.input_len}, output {args.output_len}",
        result,
        (("output_tokens_per_s", "output tokens/s"), ("total_tokens_per_s", "total tokens/s")),
        ("bandwidth used", f"{ours['bandwidth_fraction']:.0%} of {ceiling / 1e9:.1f} GB/s measured"),
        baseline="vllm" if args.baseline == "vllm" else "hf",
    )
    return report


def _serve_row(table: Table, load: str, prompts: str, side: str, r: dict[str, Any]) -> None:
    def ms(figures: dict[str, float], key: str) -> str:
        return f"{figures[key] * 1000:.0f}" if key in figures else "-"

    table.add_row(
        load,
        prompts,
        side,
        f"{r['completed']}/{r['completed'] + r['errors']}",
        f"{r['request_throughput']:.2f}",
        f"{r['output_tokens_per_s']:.1f}",
        ms(r["ttft_s"], "p50"),
        ms(r["ttft_s"], "p99"),
        ms(r["itl_s"], "p50"),
        ms(r["tpot_s"], "p50"),
        ms(r["e2e_s"], "p50"),
        ms(r["e2e_s"], "p99"),
    )


@dataclass(frozen=True)
class ServePoint:
    """One point of the serving sweep: a load, and whether its prompts are new to the server or
    the ones it was just sent (each load gets its own prompts)."""

    load: float
    prompts: str  # "fresh" or "repeated"
    workload: Workload


def _serve_points(args: argparse.Namespace, vocab: int, loads: list[float]) -> list[ServePoint]:
    points = []
    for i, load in enumerate(loads):
        seed = args.seed + 1000 * i
        workload = random_workload(vocab, args.num_prompts, tuple(args.input_len), tuple(args.output_len), seed)
        points.append(ServePoint(load, "fresh", workload))
        if args.repeated_prompts:
            points.append(ServePoint(load, "repeated", workload))
    return points


def _drive(
    base_url: str, points: list[ServePoint], args: argparse.Namespace, console: Console, side: str, vocab: int
) -> list[dict[str, Any]]:
    """Every point's load against one server, in order, after a short warm-up request."""
    sweep = "request_rate" if args.request_rate is not None else "concurrency"
    warm = random_workload(vocab, 1, (8, 8), (2, 2), args.seed + 1)
    asyncio.run(run_load(base_url, warm, concurrency=1, api_key=args.api_key))
    figures = []
    for point in points:
        concurrency = int(point.load) if sweep == "concurrency" else args.max_concurrency
        rate = point.load if sweep == "request_rate" else None
        label = f"{side}, {sweep} {point.load:g}, {point.prompts} prompts"
        with _progress(console, label, len(point.workload.prompts)) as advance:
            records, seconds = asyncio.run(
                run_load(
                    base_url,
                    point.workload,
                    concurrency=concurrency,
                    request_rate=rate,
                    seed=args.seed,
                    api_key=args.api_key,
                    on_done=lambda _: advance(1),
                )
            )
        figures.append(summarize(records, seconds))
    return figures


def _llama_server_figures(
    args: argparse.Namespace, model_dir: Path, points: list[ServePoint], console: Console, vocab: int
) -> list[dict[str, Any]] | str:
    """llama-server's figures for every point on the model's GGUF, or why it could not run."""
    try:
        binary = find_llama_server(args.llama_server)
        parallel = _max_in_flight(args, points)
        context = args.input_len[1] + args.output_len[1] + 16
        with llama_server(binary, gguf_file(model_dir), torch.get_num_threads(), parallel, context) as url:
            return _drive(url, points, args, console, "llama-server", vocab)
    except BaselineUnavailable as exc:
        return str(exc)


def _max_in_flight(args: argparse.Namespace, points: list[ServePoint]) -> int:
    """The most requests a point of the sweep has in flight (an open loop without a cap: 64)."""
    return max(int(p.load) if args.request_rate is None else (args.max_concurrency or 64) for p in points)


def _vllm_figures(
    args: argparse.Namespace,
    model_dir: Path,
    dtype: torch.dtype,
    points: list[ServePoint],
    console: Console,
    vocab: int,
) -> list[dict[str, Any]] | str:
    """vLLM's figures for every point on the model's own directory, or why it could not run."""
    try:
        python = find_vllm_python(args.vllm)
        context = args.input_len[1] + args.output_len[1] + 16
        threads = torch.get_num_threads()
        with vllm_server(python, model_dir, dtype, threads, _max_in_flight(args, points), context, "bench") as url:
            return _drive(url, points, args, console, "vllm", vocab)
    except BaselineUnavailable as exc:
        return str(exc)


def bench_serve(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    model_dir = resolve_model_dir(args.model)
    vocab = config_from_model_dir(model_dir).vocab_size
    sweep_name = "request_rate" if args.request_rate is not None else "concurrency"
    loads: list[float] = (
        list(args.request_rate) if args.request_rate is not None else list(args.concurrency or [1, 4, 16, 64])
    )
    plan = _serve_points(args, vocab, loads)
    config = engine_config_from_args(args)
    client: EngineClient | None = None
    engine = None
    if not args.base_url and config.data_parallel_size > 1:
        front_end = EngineClient(replica_handles(config), max_waiting_requests=4096)
        front_end.start()
        client = front_end
    elif not args.base_url:  # built on its loop thread, which runs all its steps (see ThreadHandle)
        async_engine = EngineClient([ThreadHandle(lambda: _engine(args))], max_waiting_requests=4096)
        async_engine.start()
        client, engine = async_engine, async_engine.engine
    from compiled_engine.server.launch import serve_in_background  # the server stack only where it serves

    server = serve_in_background(client) if client is not None else nullcontext(args.base_url.rstrip("/"))
    with server as base_url:  # ours stops here, before any baseline takes the cores
        ours = _drive(base_url, plan, args, console, "ours" if args.base_url is None else "server", vocab)
    points: list[dict[str, Any]] = [
        {"load": p.load, "prompts": p.prompts, "ours": figures} for p, figures in zip(plan, ours, strict=True)
    ]
    device = engine.runner.device if engine is not None else config.resolved_device()
    dtype = engine.runner.dtype if engine is not None else DTYPES[args.dtype or "float32"]
    baseline = args.baseline.replace("-", "_")
    if args.baseline == "one-engine":
        single = EngineClient([ThreadHandle(lambda: _engine(args, data_parallel_size=1))], max_waiting_requests=4096)
        single.start()
        with serve_in_background(single) as single_url:
            alone = _drive(single_url, plan, args, console, "one engine", vocab)
        for point, figures in zip(points, alone, strict=True):
            point["one_engine"] = figures
    if args.baseline == "hf":
        model: Any = None
        if sweep_name != "concurrency":
            why: str | None = "the hf baseline is a static-batching server: it runs with --concurrency sweeps only"
        else:
            try:
                model, why = load_hf(model_dir, dtype, device), None
            except BaselineUnavailable as exc:
                why = str(exc)
        for step, point in zip(plan, points, strict=True):
            if why is None:
                records, seconds = run_hf_as_server(model, step.workload, int(point["load"]), device)
                point["hf"] = summarize(records, seconds)
            else:
                point["hf"] = {"error": why}
    elif args.baseline == "llama-server":
        theirs = _llama_server_figures(args, model_dir, plan, console, vocab)
        for i, point in enumerate(points):
            point["llama_server"] = {"error": theirs} if isinstance(theirs, str) else theirs[i]
    elif args.baseline == "vllm":
        theirs = _vllm_figures(args, model_dir, dtype, plan, console, vocab)
        for i, point in enumerate(points):
            point["vllm"] = {"error": theirs} if isinstance(theirs, str) else theirs[i]
    for point in points:
        other = point.get(baseline, {})
        if "output_tokens_per_s" in other:
            point[f"ratio_vs_{baseline}"] = {
                k: point["ours"][k] / other[k] if other[k] else float("inf")
                for k in ("output_tokens_per_s", "request_throughput")
            }
    table = Table(
        title=f"serve: {args.num_prompts} requests per point, input {args.input_len}, output {args.output_len}"
        + (f" ({args.base_url})" if args.base_url else "")
    )
    for column in (
        sweep_name,
        "prompts",
        "",
        "ok",
        "req/s",
        "out tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "TPOT p50 ms",
        "E2E p50 ms",
        "E2E p99 ms",
    ):
        table.add_column(column)
    for point in points:
        load = f"{point['load']:g}"
        _serve_row(table, load, point["prompts"], "ours" if args.base_url is None else "server", point["ours"])
        if "output_tokens_per_s" in point.get(baseline, {}):
            _serve_row(table, "", "", args.baseline, point[baseline])
    console.print(table)
    for point in points:
        for side in ("ours", baseline):
            if point.get(side, {}).get("errors"):
                console.print(
                    f"[red]{side}: {point[side]['errors']} requests failed at {sweep_name} {point['load']:g}: "
                    f"{escape(str(point[side]['error_examples']))}[/red]"
                )
    if points and "error" in points[0].get(baseline, {}):
        console.print(f"[yellow]baseline {args.baseline} did not run: {escape(points[0][baseline]['error'])}[/yellow]")
    workload_info = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prompt_tokens": [p.workload.prompt_tokens for p in plan],
        "output_tokens": [p.workload.output_tokens for p in plan],
        "repeated_prompts": args.repeated_prompts,
        "sweep": sweep_name,
        "loads": loads,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "ignore_eos": True,
        "server": args.base_url or "ours, in-process on loopback",
        "data_parallel_size": config.data_parallel_size,
    }
    env = environment(device if client is not None else None, dtype if client is not None else None, model_dir)
    return {
        "benchmark": "serve",
        "workload": workload_info,
        "results": points,
        "environment": env,
        "engine": _engine_info(engine),
    }


def _strict_json(value: Any) -> Any:
    """JSON has no infinity: an unbounded request rate is written as the string "inf"."""
    if isinstance(value, float) and value == float("inf"):
        return "inf"
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict_json(v) for v in value]
    return value


def bench_lora(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    # prefix caching off: every run must compute its prompts, with and without adapters
    plain = _engine(args, enable_prefix_caching=False)
    lora = _engine(
        args, enable_prefix_caching=False, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.lora_rank
    )
    figures = bench_lora_runs(
        plain,
        lora,
        args.lora_rank,
        args.num_adapters,
        args.batch,
        args.prompt_len,
        args.output_len,
        args.seed,
        args.rounds,
    )
    table = Table(
        title=f"lora: rank {args.lora_rank}, all seven products, prompt {args.prompt_len}, output {args.output_len}"
        f" (medians of {args.rounds} alternated rounds)"
    )
    for column in ("", "base model", "with adapters", "ratio"):
        table.add_column(column)
    table.add_row(
        "batch-1 decode tokens/s",
        f"{figures['base_batch1']:.1f}",
        f"{figures['adapter_batch1']:.1f}",
        f"{figures['ratio_batch1']:.2f}x",
    )
    table.add_row(
        f"batch {args.batch}, {args.num_adapters} adapters, output tokens/s",
        f"{figures['base_batch_output_tokens_per_s']:.1f}",
        f"{figures['adapters_batch_output_tokens_per_s']:.1f}",
        f"{figures['ratio_batch']:.2f}x",
    )
    table.add_row(
        "base request on the engine with slots, batch 1", f"{figures['slots_batch1_base_request']:.1f}", "", ""
    )
    table.add_row("loading one adapter", "", f"{figures['load_seconds'] * 1000:.0f} ms", "")
    console.print(table)
    workload = {
        "lora_rank": args.lora_rank,
        "num_adapters": args.num_adapters,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "rounds": args.rounds,
    }
    return _report("lora", workload, figures, lora)


def bench_spec(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    speculative = args.speculative_config or DEFAULT_SPECULATIVE
    # prefix caching off: both engines compute every prompt
    plain = _engine(args, enable_prefix_caching=False, speculative_config=None)
    spec = _engine(args, enable_prefix_caching=False, speculative_config=speculative)
    figures = bench_speculative_runs(plain, spec, args.num_requests, args.concurrency, args.output_len, args.seed)
    table = Table(title=f"spec: {speculative}, output {args.output_len}")
    for column in ("output tokens/s", "off", "on", "ratio", "acceptance", "mean length"):
        table.add_column(column)
    labels = {
        "repetitive": "repetitive, one at a time",
        "random": "random tokens, one at a time",
        "concurrent": f"repetitive, {args.concurrency} at once",
    }
    for name, label in labels.items():
        table.add_row(
            label,
            f"{figures[f'{name}_off']:.1f}",
            f"{figures[f'{name}_on']:.1f}",
            f"{figures[f'{name}_ratio']:.2f}x",
            f"{figures[f'{name}_acceptance_rate']:.0%}",
            f"{figures[f'{name}_mean_acceptance_length']:.2f}",
        )
    console.print(table)
    console.print(f"accepted drafts by position: {figures['accepted_per_position']}")
    workload = {
        "speculative_config": speculative,
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "output_len": args.output_len,
        "seed": args.seed,
    }
    return _report("spec", workload, figures, spec)


def bench_structured(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    # prefix caching off: each round computes its prompts, constrained or not
    engine = _engine(args, enable_prefix_caching=False)
    figures = bench_structured_runs(engine, args.batch, args.output_len, args.rounds)
    table = Table(title=f"structured: batch {args.batch}, output up to {args.output_len}, {args.rounds} rounds")
    for column in ("", "free", "JSON schema", "ratio"):
        table.add_column(column)
    table.add_row(
        f"batch-{args.batch} decode tokens/s (median step)",
        f"{figures['free_tokens_per_s']:.1f}",
        f"{figures['constrained_tokens_per_s']:.1f}",
        f"{figures['ratio']:.2f}x",
    )
    table.add_row(
        "compile, 20-field schema: cold / cache hit",
        "",
        f"{figures['compile_cold_ms']:.2f} / {figures['compile_warm_ms']:.3f} ms",
        "",
    )
    table.add_row("a request's matcher from the compiled schema", "", f"{figures['matcher_ms']:.2f} ms", "")
    table.add_row("mask per constrained sequence and step", "", f"{figures['mask_us']:.0f} us", "")
    console.print(table)
    workload = {"batch": args.batch, "output_len": args.output_len, "rounds": args.rounds}
    return _report("structured", workload, figures, engine)


BENCHMARKS = {
    "latency": bench_latency,
    "offline": bench_offline,
    "serve": bench_serve,
    "perplexity": bench_perplexity,
    "lora": bench_lora,
    "spec": bench_spec,
    "structured": bench_structured,
}


def engine_memory(engine: LLMEngine) -> dict[str, int]:
    """The engine's memory after a run: the process's resident bytes now (the engine built and
    warm, before the bandwidth measurement), its weights' and its KV cache's."""
    resident = 0
    try:
        with open("/proc/self/status") as status:
            resident = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):  # not Linux
        pass
    return {
        "resident_bytes": resident,
        "engine_weight_bytes": engine.weight_bytes,
        "kv_cache_bytes": engine.kv_cache_bytes,
    }


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(stderr=False)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        _check_args(args)
        if args.plot is not None:
            if args.plot.suffix.lower() != ".png":
                raise ValueError(f"--plot writes a PNG; give a file name ending in .png, not {args.plot.name!r}")
            check_plotting()  # before a long run, not after it
        report = BENCHMARKS[args.command](args, console)
        report["peak_rss_bytes"] = peak_rss_bytes()
    except (CompiledEngineError, ValueError, httpx.HTTPError, PlotUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json is not None:
        args.json.write_text(json.dumps(_strict_json(report), indent=2, allow_nan=False) + "\n")
        console.print(f"results written to {args.json}")
    if args.plot is not None:
        write_plot(report, args.plot)
        console.print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
