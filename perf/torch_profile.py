"""Profile the engine with torch.profiler (CPU, and CUDA when present): a batch of greedy
requests through LLMEngine after a warm-up; prints the top operators by self time and writes a
Chrome trace.

    .venv/bin/python perf/torch_profile.py --max-tokens 32
    .venv/bin/python perf/torch_profile.py --prompt-len 512 --max-tokens 17   # decode at 512 context
    .venv/bin/python perf/torch_profile.py --batch 16 --enforce-eager --trace eager.json

Only the steps after the prompts are in (decode steps) are profiled; the mean step time is printed,
and where it goes: inside the compiled graphs (the model's math and the attention operator they
call) against everything else, the host work of a step (Dynamo's guards and wrappers, building
inputs and the attention plan, sampling, detokenizing, outputs). The split is taken from the
profiled steps; the host figure is the unprofiled step time less the profiled time inside the
graphs, so the profiler's own overhead is not counted as host work.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine_options import add_engine_options, engine_config_from_args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="The three primary colors are")
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="random token prompts of this length instead of --prompt"
    )
    parser.add_argument("--batch", type=int, default=1, help="requests running together")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--trace", type=Path, default=Path("torch_trace.json"))
    parser.add_argument("--top", type=int, default=25)
    add_engine_options(parser, exclude=("max_num_seqs",))
    args = parser.parse_args()
    if args.kv_cache_memory_gib is None:
        args.kv_cache_memory_gib = 1.0
    engine = LLMEngine(engine_config_from_args(args, max_num_seqs=max(args.batch, 1)))

    rng = random.Random(0)
    vocab = engine.runner.model_config.vocab_size

    def prompt() -> str | list[int]:
        return [rng.randrange(10, vocab) for _ in range(args.prompt_len)] if args.prompt_len else args.prompt

    def start(max_tokens: int) -> None:
        for _ in range(args.batch):
            engine.add_request(prompt(), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while engine.scheduler.waiting or any(
            s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.scheduler.running
        ):
            engine.step()

    def finish() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    start(3)  # warm-up
    finish()
    start(args.max_tokens)
    plain_steps = 0
    began = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        plain_steps += 1
    plain_ms = 1000 * (time.perf_counter() - began) / max(plain_steps, 1)
    start(args.max_tokens)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    steps = 0
    began = time.perf_counter()
    with profile(activities=activities) as prof:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    print(
        f"{steps} decode steps of batch {args.batch}, {1000 * (time.perf_counter() - began) / max(steps, 1):.1f} ms per step (profiled)"
    )
    graphs_ms = inside_compiled_graphs_us(prof) / 1000 / max(steps, 1)
    attention_ms = (
        sum(e.cpu_time_total for e in prof.key_averages() if e.key == "compiled_engine::paged_attention")
        / 1000
        / max(steps, 1)
    )
    print(
        f"unprofiled: {plain_ms:.2f} ms per step; inside the compiled graphs {graphs_ms:.2f} ms "
        f"(attention {attention_ms:.2f} ms of it); host work {plain_ms - graphs_ms:.2f} ms per step"
    )
    sort_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_key, row_limit=args.top))
    prof.export_chrome_trace(str(args.trace))
    print(f"trace written to {args.trace}")


def inside_compiled_graphs_us(prof: profile) -> float:
    """CPU time inside Inductor's compiled graphs, counting only the outermost graph call where
    one graph calls another (a nested region)."""
    total = 0.0
    for event in prof.events():
        if not event.name.startswith("## Call CompiledFxGraph"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("## Call CompiledFxGraph"):
            parent = parent.cpu_parent
        if parent is None:
            total += event.cpu_time_total
    return total


if __name__ == "__main__":
    main()
