"""`verify`: run the engine and the transformers reference on the same prompts and report either
MATCH or the first divergence with both runs' top-5 logits at that step."""

from __future__ import annotations

import sys
from pathlib import Path

from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import GenerationResult, Generator
from compiled_engine.executor.runner import Runner
from compiled_engine.prompts import DEFAULT_PROMPTS, PromptSpec, load_prompts
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.weights.source import resolve_model_dir
from reference_oracle import GoldenResult, ReferenceOracle, first_divergence
from reference_oracle.gguf_source import compare_tokenizers


def _top5(tokenizer: Tokenizer, ids: list[int], values: list[float]) -> str:
    return ", ".join(f"{i} {tokenizer.decode([i], False)!r} {v:.4f}" for i, v in zip(ids, values, strict=True))


def report_divergence(
    tokenizer: Tokenizer, index: int, spec: PromptSpec, ours: GenerationResult, golden: GoldenResult
) -> str | None:
    """None when the two runs agree; otherwise a multi-line report of where they first part."""
    divergence = first_divergence(ours.token_ids, golden.token_ids)
    if divergence is None:
        return None
    step = divergence.step

    def describe(token: int | None) -> str:
        return "(stopped)" if token is None else f"{token} {tokenizer.decode([token], False)!r}"

    lines = [
        f"DIVERGENCE in prompt {index} ({'chat' if spec.chat else 'plain'}): {spec.text!r}",
        f"  step {step}: ours {describe(divergence.ours)}, oracle {describe(divergence.reference)}",
        f"  common prefix: {tokenizer.decode(ours.token_ids[:step])!r}",
    ]
    if step < len(ours.top_logits):
        top = ours.top_logits[step]
        lines.append(f"  our top-5:    {_top5(tokenizer, top.token_ids, top.values)}")
    if step < len(golden.top_token_ids):
        lines.append(f"  oracle top-5: {_top5(tokenizer, golden.top_token_ids[step], golden.top_values[step])}")
    return "\n".join(lines)


def check_gguf_reading(oracle: ReferenceOracle, tokenizer: Tokenizer) -> tuple[list[str], str]:
    """Where our preparation of a GGUF (config.json from our metadata reader, the tokenizer from
    our builder or the tokenizer.json beside the file, the stop ids) parts from transformers' own
    reading of the file, and a summary of what was compared."""
    assert oracle.gguf is not None and oracle.gguf.check is not None
    reading, config = oracle.gguf, oracle.gguf.check
    problems = [f"config {d}" for d in config.disagreements]
    ours_stop, their_stop = tokenizer.eos_token_ids, oracle.eos_token_ids()
    if ours_stop != their_stop:
        problems.append(f"stop token ids: ours {sorted(ours_stop)}, transformers {sorted(their_stop)}")
    encode_chat = tokenizer.encode_chat if tokenizer.chat_template_source is not None else None
    tokens = compare_tokenizers(reading.tokenizer, tokenizer.encode, encode_chat)
    problems += tokens.disagreements
    lines = [
        f"GGUF: our config and tokenizer agree with transformers' reading of {reading.path.resolve().name}: "
        f"{len(config.checked)} config fields ({', '.join(config.checked)}), the stop ids, "
        f"{len(tokens.compared)} probe texts{' and a conversation through the chat template' if tokens.chat_template else ''}"
    ]
    if tokens.unspellable:
        lines.append(f"  {len(tokens.unspellable)} probe texts not compared: the vocabulary cannot spell them")
    if config.taken:
        lines.append("  transformers reads no GGUF key for these; the oracle takes ours, unchecked:")
        lines += [f"    {taken}" for taken in config.taken]
    return problems, "\n".join(lines)


def verify(config: EngineConfig, prompts_file: Path | None, chat: bool, max_tokens: int) -> int:
    specs = list(DEFAULT_PROMPTS) if prompts_file is None else load_prompts(prompts_file, chat)
    model_dir = resolve_model_dir(config.model)
    tokenizer = Tokenizer(model_dir)
    oracle = ReferenceOracle(model_dir)
    if oracle.gguf is not None and oracle.gguf.check is not None:
        problems, summary = check_gguf_reading(oracle, tokenizer)
        if problems:
            print(f"GGUF CHECK FAILED: our reading of {oracle.gguf.path.resolve()} is not transformers' reading of it")
            print("\n".join(f"  {problem}" for problem in problems))
            print(f"{len(problems)} disagreements with transformers' reading of the GGUF", file=sys.stderr)
            return 1
        print(summary)
    runner = Runner(model_dir, config)
    prompt_ids = []
    for i, spec in enumerate(specs):
        encoded = tokenizer.encode_prompt(spec.text, spec.chat)
        reference = oracle.encode(spec.text, spec.chat)
        if encoded != reference:
            print(f"DIVERGENCE in prompt {i}: tokenization differs\n  ours   {encoded}\n  oracle {reference}")
            return 1
        prompt_ids.append(encoded)
    stop = tokenizer.eos_token_ids
    results = Generator(runner).generate(prompt_ids, max_tokens, stop, record_logits=True)
    max_logit_diff = 0.0
    failures = 0
    for i, (spec, ids, ours) in enumerate(zip(specs, prompt_ids, results, strict=True)):
        golden = oracle.greedy(ids, max_tokens, stop)
        assert ours.prefill_logits is not None
        diff = (ours.prefill_logits - golden.prefill_logits).abs().max().item()
        max_logit_diff = max(max_logit_diff, diff)
        report = report_divergence(tokenizer, i, spec, ours, golden)
        if report is not None:
            print(report)
            failures += 1
    tokens = sum(len(r.token_ids) for r in results)
    if failures:
        print(f"{failures} of {len(specs)} prompts diverged", file=sys.stderr)
        return 1
    print(
        f"MATCH: {len(specs)} prompts, {tokens} generated tokens identical; "
        f"max |prefill logit diff| = {max_logit_diff:.2e} (device {runner.device}, dtype "
        f"{str(runner.dtype).removeprefix('torch.')})"
    )
    return 0
