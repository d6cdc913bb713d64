"""`bench structured`: JSON-schema-constrained decoding against free decoding, in the same run.

- decode: `batch` chat requests at once, all constrained by a JSON schema, and the same requests
  free, in rounds that alternate which runs first; the median time of a decode step while the whole batch runs, as output
  tokens/s (constrained outputs end when their JSON is complete, so whole runs do not compare);
- compile: a 20-field schema compiled cold (a schema not seen before: built and validated) and
  warm (the cache hit), and a request's own matcher made from it;
- mask: one sequence's allowed-token mask along a JSON output (llguidance's bitmask and its
  conversion to the sampler's bool row), the work added to each step per constrained sequence.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams, StructuredOutputs
from compiled_engine.structured.grammar_set import LLGuidanceGrammars

TOPICS = ["the sea", "mountains", "bread", "trains", "the moon", "coffee", "bees", "libraries"]
# Long enough to keep a batch decoding for a while: up to 40 short facts.
FACTS = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 20},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 40},
    },
    "required": ["topic", "facts"],
    "additionalProperties": False,
}


def wide_schema(fields: int, tag: str) -> dict[str, Any]:
    """An object of `fields` fields of mixed types (`tag` makes the schema text new)."""
    kinds = [
        {"type": "string", "maxLength": 30},
        {"type": "integer", "minimum": 0, "maximum": 10_000},
        {"type": "number"},
        {"type": "boolean"},
        {"enum": ["a", "b", "c"]},
        {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    ]
    properties = {f"{tag}_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _full_batch_steps(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    """Seconds of each step in which every request of the batch decoded (none prefilling or done)."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    times = []
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        full = len(running) == len(prompts) and not any(seq.is_prefilling for seq in running)
        started = time.perf_counter()
        engine.step()
        if full:
            times.append(time.perf_counter() - started)
    return times


def bench_structured_runs(engine: LLMEngine, batch: int, output_len: int, rounds: int) -> dict[str, Any]:
    if engine.tokenizer is None:
        raise ValueError("bench structured needs a model with a tokenizer and chat template")
    prompts = [
        engine.tokenizer.encode_chat(
            [{"role": "user", "content": f"List facts about {TOPICS[i % len(TOPICS)]} as JSON."}], True
        )
        for i in range(batch)
    ]
    constrained = SamplingParams(
        temperature=0, max_tokens=output_len, structured_outputs=StructuredOutputs.of({"json": FACTS})
    )
    free = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    _full_batch_steps(
        engine,
        prompts[:2],
        SamplingParams(temperature=0, max_tokens=4, structured_outputs=constrained.structured_outputs),
    )
    free_steps: list[float] = []
    constrained_steps: list[float] = []
    for round_index in range(rounds):  # which goes first alternates, so that drift falls on both
        order = [(free, free_steps), (constrained, constrained_steps)]
        for params, steps in order if round_index % 2 == 0 else order[::-1]:
            steps += _full_batch_steps(engine, prompts, params)
    if not free_steps or not constrained_steps:
        raise ValueError("no step ran the whole batch: raise --output-len")
    free_rate = batch / statistics.median(free_steps)
    constrained_rate = batch / statistics.median(constrained_steps)

    assert isinstance(engine.grammars, LLGuidanceGrammars)
    compiler = engine.grammars.compiler()
    cold, warm, matchers = [], [], []
    for round_index in range(rounds):
        spec = StructuredOutputs.of({"json": wide_schema(20, f"r{round_index}")})
        started = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        compiler.compile(spec)
        warm.append(time.perf_counter() - started)
        started = time.perf_counter()
        compiler.matcher(spec)
        matchers.append(time.perf_counter() - started)

    matcher = compiler.matcher(constrained.structured_outputs)  # type: ignore[arg-type]
    text = '{"topic": "bees", "facts": ["Bees make honey.", "Bees dance to tell where flowers are.", "A hive has one queen."]}'
    masks = []
    for token in engine.tokenizer.encode(text, add_special_tokens=False):
        started = time.perf_counter()
        matcher.allowed()
        masks.append(time.perf_counter() - started)
        matcher.advance(token)
    return {
        "free_tokens_per_s": free_rate,
        "constrained_tokens_per_s": constrained_rate,
        "ratio": constrained_rate / free_rate,
        "free_steps": len(free_steps),
        "constrained_steps": len(constrained_steps),
        "compile_cold_ms": statistics.median(cold) * 1000,
        "compile_warm_ms": statistics.median(warm) * 1000,
        "matcher_ms": statistics.median(matchers) * 1000,
        "mask_us": statistics.median(masks) * 1e6,
        "mask_steps": len(masks),
    }
