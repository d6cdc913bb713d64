"""`python -m compiled_engine` / `compiled-engine`: prepare, generate, verify."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from compiled_engine.engine_options import add_engine_options, engine_config_from_args
from compiled_engine.errors import CompiledEngineError, ModelSourceError
from compiled_engine.logs import LOG_FORMATS, configure_logging
from compiled_engine.server.common.reasoning import REASONING_PARSERS
from compiled_engine.server.common.tool_parsers import TOOL_CALL_PARSERS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compiled-engine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("prepare", help="build the embedded default model once (prints its directory last)")

    generate = commands.add_parser("generate", help="greedy continuation of one prompt")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None, help="this request's seed (default: one drawn at random)")
    # One request: its own --seed is the one that counts; one engine, no replicas.
    add_engine_options(generate, exclude={"seed", "data_parallel_size"})

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_serve_options(serve)
    add_engine_options(serve)

    verify = commands.add_parser("verify", help="compare greedy output with the transformers reference")
    verify.add_argument("--prompts", type=Path, default=None, help=".json list or one prompt per line")
    verify.add_argument("--chat", action="store_true", help="treat the prompts of a text file as chat messages")
    verify.add_argument("--max-tokens", type=int, default=64)
    add_engine_options(verify, exclude={"data_parallel_size"})
    return parser


def _add_serve_options(serve: argparse.ArgumentParser) -> None:
    """`serve`'s own options (the engine's are added beside them)."""
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require a bearer key on /v1/*; repeat for several tenants, each with its own prefix-cache "
        "salt (default: $COMPILED_ENGINE_API_KEY, comma-separated)",
    )
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-waiting-requests", type=int, default=256, help="beyond this, new requests get 429")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20)
    serve.add_argument("--shutdown-grace-s", type=float, default=30.0)
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters a request names as its model: name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\' (needs --enable-lora)',
    )
    serve.add_argument("--no-chat-page", action="store_true", help="do not serve the chat page at /")
    serve.add_argument(
        "--disable-log-requests", action="store_true", help="no log line per finished request (on by default)"
    )
    serve.add_argument("--log-prompts", action="store_true", help="the request log includes each prompt")
    serve.add_argument(
        "--log-format", choices=LOG_FORMATS, default="text", help="json: one JSON object a log line, for collectors"
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how the model writes tool calls under tool_choice auto (default: the family's format when its "
        "chat template renders tools, else hermes)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split the thinking (<think>...</think>) from the answer: reasoning_content in chat, "
        "reasoning items in Responses, thinking blocks in Messages",
    )
    serve.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish the prefix cache's changes as vLLM's KV events over ZMQ, in vLLM's schema: "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\' (docs/parallel.md)',
    )
    serve.add_argument(
        "--enable-runtime-lora-updates",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key)",
    )


def cmd_prepare(args: argparse.Namespace) -> int:
    from compiled_engine.weights.default_model import prepare_default_model

    model_dir = prepare_default_model()
    _build_native_kernels()
    print(model_dir)
    return 0


def _build_native_kernels() -> None:
    """Build the CPU kernels now, once per machine, so that the first start does not (each one
    that cannot be built says why, and the engine runs its fallback)."""
    import time

    from compiled_engine.attention.native_decode import load_native_decode, load_native_operator
    from compiled_engine.executor.frame_arena import install_frame_arena
    from compiled_engine.linear.lora_op import native_lora_kernel
    from compiled_engine.linear.packed_cpu import blocked_gemv_operator
    from compiled_engine.linear.quantized_op import cpu_kernels, native_operator
    from compiled_engine.native_build import KernelBuildError

    started = time.perf_counter()
    try:
        load_native_decode()
    except KernelBuildError as error:
        print(f"the CPU attention kernel cannot be built here: {error}", file=sys.stderr)
    load_native_operator()  # warns itself when it cannot be built
    cpu_kernels()  # warns itself when it cannot be built
    native_operator()
    native_lora_kernel()
    blocked_gemv_operator()
    install_frame_arena()
    print(f"native kernels ready ({time.perf_counter() - started:.1f} s)", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    from compiled_engine.engine.llm_engine import LLMEngine
    from compiled_engine.engine.outputs import RequestOutput
    from compiled_engine.engine.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    started = time.perf_counter()
    engine = LLMEngine(engine_config_from_args(args))
    model_load_ms = (time.perf_counter() - started) * 1000
    if engine.tokenizer is None:
        raise ModelSourceError(f"{engine.model_dir} has no tokenizer.json, so text prompts cannot be encoded")
    prompt_ids = engine.tokenizer.encode_prompt(args.prompt, args.chat)
    engine.add_request(prompt_ids, params)
    shown = 0
    final: RequestOutput | None = None
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():  # stream the text as it is generated
                sys.stdout.write(output.text[shown:])
                sys.stdout.flush()
                shown = len(output.text)
                final = output
    finally:
        engine.shutdown()
    print()
    assert final is not None and final.metrics is not None
    m = final.metrics
    ttft = m.ttft or 0.0
    decode_s = (m.e2e or 0.0) - ttft
    decoded = len(final.token_ids) - 1
    stats = {
        "model_load_ms": f"{model_load_ms:.1f}",
        "prefill_ms": f"{(ttft - (m.queue_time or 0.0)) * 1000:.1f}",
        "ttft_ms": f"{ttft * 1000:.1f}",
        "mean_tpot_ms": f"{(m.tpot or 0.0) * 1000:.2f}",
        "decode_tokens_per_s": f"{decoded / decode_s if decode_s > 0 else 0.0:.1f}",
        "prompt_tokens": str(len(prompt_ids)),
        "output_tokens": str(len(final.token_ids)),
        "finish_reason": str(final.finish_reason),
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
    }
    print(" ".join(f"{k}={v}" for k, v in stats.items()), file=sys.stderr)
    return 0


def _api_keys(flags: list[str] | None) -> tuple[str, ...]:
    raw = flags if flags is not None else os.environ.get("COMPILED_ENGINE_API_KEY", "").split(",")
    return tuple(key.strip() for key in raw if key.strip())


def cmd_serve(args: argparse.Namespace) -> int:
    from compiled_engine.server.launch import run_server
    from compiled_engine.serving.kv_events import KVEventsConfig

    return run_server(
        engine_config_from_args(args),
        args.host,
        args.port,
        _api_keys(args.api_key),
        args.served_model_name,
        args.max_waiting_requests,
        args.max_body_bytes,
        args.shutdown_grace_s,
        lora_modules(args.lora_modules or [], args.served_model_name),
        args.enable_runtime_lora_updates,
        not args.no_chat_page,
        not args.disable_log_requests,
        args.log_prompts,
        args.log_format,
        args.reasoning_parser,
        args.tool_call_parser,
        KVEventsConfig.parse(args.kv_events_config) if args.kv_events_config else None,
    )


def lora_modules(specs: list[str], served_model_name: str | None) -> dict[str, str]:
    """`--lora-modules` as name -> directory: `name=path`, or vLLM's JSON form, whose
    `base_model_name` must be the served model when given."""
    modules: dict[str, str] = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                entry = json.loads(spec)
                name, path = entry["name"], entry["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise SystemExit(f'--lora-modules: {spec!r} is not {{"name": ..., "path": ...}} ({error})') from error
            base = entry.get("base_model_name")
            if base is not None and served_model_name is not None and base != served_model_name:
                raise SystemExit(f"--lora-modules: {name!r} is for {base!r}, not the served {served_model_name!r}")
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise SystemExit(f"--lora-modules: {spec!r} is not name=path")
        if name in modules:
            raise SystemExit(f"--lora-modules: {name!r} is given twice")
        modules[name] = path
    return modules


def cmd_verify(args: argparse.Namespace) -> int:
    from compiled_engine.verify import verify

    return verify(engine_config_from_args(args), args.prompts, args.chat, args.max_tokens)


def _torchrun_worker_rank() -> int | None:
    """Under torchrun, the rank of this process when it is not rank 0."""
    from compiled_engine.executor.launch import under_torchrun

    rank = int(os.environ.get("RANK", "0"))
    return rank if under_torchrun() and rank > 0 else None


def _run_torchrun_worker(args: argparse.Namespace) -> int:
    """Ranks 1..N-1 under torchrun run the model's shard; rank 0 runs the command itself."""
    from compiled_engine.executor.pipeline import ParallelLayout
    from compiled_engine.executor.ranks import run_worker
    from compiled_engine.weights.source import resolve_model_dir

    rank = _torchrun_worker_rank()
    assert rank is not None
    config = engine_config_from_args(args)
    layout = ParallelLayout(rank, config.pipeline_parallel_size, config.tensor_parallel_size)
    run_worker(layout, "env://", str(resolve_model_dir(config.model)), config)
    return 0


COMMANDS = {"prepare": cmd_prepare, "generate": cmd_generate, "serve": cmd_serve, "verify": cmd_verify}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_format", "text"))
    ranks = getattr(args, "tensor_parallel_size", 1) * getattr(args, "pipeline_parallel_size", 1)
    if ranks > 1 and _torchrun_worker_rank() is not None:
        return _run_torchrun_worker(args)
    try:
        return COMMANDS[args.command](args)
    except (CompiledEngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
