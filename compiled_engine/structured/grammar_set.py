"""The engine's grammar set (engine/grammars.py) over llguidance: one compiler for the model's
tokenizer, built at first use, and each constrained sequence's matcher."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from compiled_engine.engine.feature_state import GrammarState
from compiled_engine.engine.sampling_params import StructuredOutputs
from compiled_engine.engine.sequence import FinishReason, Sequence
from compiled_engine.errors import RequestError
from compiled_engine.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)


class LLGuidanceGrammars:
    def __init__(self, tokenizer_file: Path | None, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        """`tokenizer_file`: the model's tokenizer.json (None: it has none, and constraints are
        refused); `vocab_size`: the width of its logits."""
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._compiler: GrammarCompiler | None = None

    def compiler(self) -> GrammarCompiler:
        """The grammars of this model's tokenizer (built at first use)."""
        if self._compiler is None:
            if self.tokenizer_file is None:
                raise RequestError("structured outputs need the model's tokenizer.json", param="structured_outputs")
            self._compiler = GrammarCompiler(self.tokenizer_file, self.vocab_size, self.eos_token_ids)
        return self._compiler

    def states(self, spec: StructuredOutputs, n: int) -> list[GrammarState]:
        compiler = self.compiler()
        return [compiler.matcher(spec) for _ in range(n)]

    async def prepare(self, spec: StructuredOutputs) -> None:
        await self.compiler().compile_async(spec)

    def masks(self, due: list[Sequence]) -> list[torch.Tensor | None] | None:
        if all(seq.grammar is None for seq in due):
            return None
        return [
            mask
            for seq in due
            for mask in (
                [None] * (1 + len(seq.draft_token_ids))
                if seq.grammar is None
                else seq.grammar.masks_along(seq.draft_token_ids)
            )
        ]

    def advance(self, seq: Sequence, token: int) -> FinishReason | None:
        if seq.grammar is None:
            return None
        if not seq.grammar.advance(token):  # the mask allows no such token: never expected
            logger.error("request %s: its grammar refused token %d; it is aborted", seq.request_id, token)
            return FinishReason.ABORT
        return FinishReason.STOP if seq.grammar.finished else None
