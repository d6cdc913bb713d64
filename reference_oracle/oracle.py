"""ReferenceOracle: greedy decoding with transformers in fp32 and eager attention."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reference_oracle.gguf_source import GGUFReading, read_gguf

TOP_K = 5


@dataclass
class GoldenResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    prefill_logits: torch.Tensor  # fp32 [vocab], after the last prompt token
    top_token_ids: list[list[int]] = field(default_factory=list)  # per generated token
    top_values: list[list[float]] = field(default_factory=list)


class ReferenceOracle:
    """transformers on a model directory, or on a GGUF file: `model_dir` a `.gguf` file, or a
    directory prepared from one (its `model.gguf` and no dense weights). From a GGUF, the config,
    tokenizer and weights are transformers' own reading of the file (gguf_source.py), never the
    directory's config.json or tokenizer files; `gguf.check` says where the directory's config.json
    disagrees with that reading."""

    def __init__(self, model_dir: str | Path) -> None:
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise RuntimeError(
                "the reference oracle needs transformers: pip install 'compiled_engine[convert]'"
            ) from exc
        self.model_dir = Path(model_dir)
        self.gguf: GGUFReading | None = None
        self.tokenizer: Any = None
        dense = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
        if self.model_dir.is_file() and self.model_dir.suffix.lower() == ".gguf":
            self.gguf, self.model = read_gguf(self.model_dir, None)
            self.tokenizer = self.gguf.tokenizer
            return
        if (self.model_dir / "model.gguf").is_file() and not any((self.model_dir / n).is_file() for n in dense):
            ours = self.model_dir if (self.model_dir / "config.json").is_file() else None
            self.gguf, self.model = read_gguf(self.model_dir / "model.gguf", ours)
            self.tokenizer = self.gguf.tokenizer
            return
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        if (self.model_dir / "tokenizer.json").is_file():
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)

    def encode(self, prompt: str, chat: bool) -> list[int]:
        if self.tokenizer is None:
            raise RuntimeError(f"{self.model_dir} has no tokenizer")
        if chat:
            encoded = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer(prompt)["input_ids"]]

    def eos_token_ids(self) -> frozenset[int]:
        if self.gguf is not None:
            return self.gguf.eos_token_ids
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            return frozenset()
        return frozenset([eos] if isinstance(eos, int) else eos)

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits at every position of `token_ids`, [len, vocab]."""
        return self.model(torch.tensor([token_ids])).logits[0].float()

    @torch.inference_mode()
    def greedy(
        self, prompt_token_ids: list[int], max_new_tokens: int, stop_token_ids: frozenset[int] = frozenset()
    ) -> GoldenResult:
        """transformers' own greedy `generate`, with the raw logits of every step kept."""
        out = self.model.generate(
            torch.tensor([prompt_token_ids]),
            attention_mask=torch.ones(1, len(prompt_token_ids), dtype=torch.int64),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(stop_token_ids) or None,
            pad_token_id=self.model.generation_config.pad_token_id or 0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        steps = [step[0].float() for step in out.logits]
        result = GoldenResult(
            list(prompt_token_ids),
            out.sequences[0, len(prompt_token_ids) :].tolist(),
            steps[0].clone(),
        )
        for logits in steps:
            top = logits.topk(TOP_K)
            result.top_token_ids.append(top.indices.tolist())
            result.top_values.append(top.values.tolist())
        return result
