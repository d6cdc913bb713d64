"""`bench spec`: speculative decoding on against off, in the same run.

Three workloads, each run by an engine without speculation and one with `--speculative-config`
(alternated, so the machine's drift hits both):
- repetitive: chat requests that ask the model to repeat a piece of code with one change, one
  at a time (batch-1 decode), where prompt lookup finds most of the answer in the prompt;
- random: the random-token prompts of the offline bench (nothing to look up), one at a time;
- concurrent: the repetitive requests all at once, `--concurrency` of them.
Output tokens per second for each, and the speculative engine's acceptance over the run.
"""

from __future__ import annotations

from typing import Any

from compiled_engine.bench.runs import run_ours
from compiled_engine.bench.workload import Workload, random_workload
from compiled_engine.engine.llm_engine import LLMEngine

CODE = [
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
    "    return 2 * (width + height)\n\n\ndef is_square(width, height):\n    return width == height\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count += 1\n        return self.count\n\n    def reset(self):\n        self.count = 0\n",
    "def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
    "        elif i % 3 == 0:\n            print('Fizz')\n        elif i % 5 == 0:\n            print('Buzz')\n"
    "        else:\n            print(i)\n",
    "def mean(values):\n    return sum(values) / len(values)\n\n\ndef variance(values):\n"
    "    m = mean(values)\n    return sum((v - m) ** 2 for v in values) / len(values)\n",
]
CHANGES = ["rename the first function", "add a docstring to each function", "use four-space indents", "add type hints"]


def repetitive_workload(engine: LLMEngine, num_requests: int, output_len: int) -> Workload:
    """Chat prompts asking for code repeated with one change (the default model's template)."""
    if engine.tokenizer is None:
        raise ValueError("the repetitive workload needs a model with a tokenizer and chat template")
    prompts = []
    for i in range(num_requests):
        code, change = CODE[i % len(CODE)], CHANGES[(i // len(CODE)) % len(CHANGES)]
        message = f"Repeat this code exactly, but {change}:\n\n```python\n{code}```"
        prompts.append(engine.tokenizer.encode_chat([{"role": "user", "content": message}], True))
    return Workload(prompts, [output_len] * num_requests)


def _one_at_a_time(engine: LLMEngine, workload: Workload) -> float:
    """Output tokens per second, the requests run one after another."""
    seconds, tokens = 0.0, 0
    for prompt, output_len in zip(workload.prompts, workload.output_lens, strict=True):
        run = run_ours(engine, Workload([prompt], [output_len]))
        seconds += run["seconds"]
        tokens += run["output_tokens"]
    return tokens / seconds


def _all_at_once(engine: LLMEngine, workload: Workload) -> float:
    run = run_ours(engine, workload)
    return float(run["output_tokens"] / run["seconds"])


def bench_speculative_runs(
    plain: LLMEngine, spec: LLMEngine, num_requests: int, concurrency: int, output_len: int, seed: int
) -> dict[str, Any]:
    """The figures of `bench spec`: `plain` without speculation, `spec` with it."""
    vocab = plain.runner.model_config.vocab_size
    repetitive = repetitive_workload(plain, num_requests, output_len)
    concurrent = repetitive_workload(plain, concurrency, output_len)
    random_prompts = random_workload(vocab, num_requests, (128, 128), (output_len, output_len), seed)
    warm_up = random_workload(vocab, 2, (8, 8), (4, 4), seed + 1)
    for engine in (plain, spec):
        run_ours(engine, warm_up)
    figures: dict[str, Any] = {}
    runs = [
        ("repetitive", repetitive, _one_at_a_time),
        ("random", random_prompts, _one_at_a_time),
        ("concurrent", concurrent, _all_at_once),
    ]
    for name, workload, run in runs:
        before = spec.drafter.snapshot()
        figures[f"{name}_off"] = run(plain, workload)
        figures[f"{name}_on"] = run(spec, workload)
        after = spec.drafter.snapshot()
        assert before is not None and after is not None  # the engine speculates
        drafted = after.draft_tokens - before.draft_tokens
        accepted = after.accepted_tokens - before.accepted_tokens
        drafts = after.drafts - before.drafts
        figures[f"{name}_ratio"] = figures[f"{name}_on"] / figures[f"{name}_off"]
        figures[f"{name}_acceptance_rate"] = accepted / drafted if drafted else 0.0
        figures[f"{name}_mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
        figures[f"{name}_draft_tokens"] = drafted
    final = spec.drafter.snapshot()
    assert final is not None
    figures["accepted_per_position"] = list(final.accepted_at)
    return figures
