"""SequenceText: a sequence's text as it grows, and the stop strings that end it. Text that could
still be the start of a stop string is held back, so a stop string is never shown, even in part,
and is found even when it spans several tokens."""

from __future__ import annotations

from collections.abc import Sequence

from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.tokenizer import IncrementalDetokenizer, Tokenizer


class SequenceText:
    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._detokenizer = (
            None
            if tokenizer is None
            else IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        )
        self._stops = params.stop
        self._min_tokens = params.min_tokens
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._num_tokens = 0
        self.text = ""

    def add(self, token_id: int) -> str | None:
        """Append a token's text; return the stop string it completed, if any (the text then
        ends just before it)."""
        self._num_tokens += 1
        if self._detokenizer is None:
            return None
        search_from = max(0, len(self.text) - self._hold)
        self.text += self._detokenizer.add(token_id)
        if not self._stops or self._num_tokens < self._min_tokens:
            return None
        found = [(i, stop) for stop in self._stops if (i := self.text.find(stop, search_from)) >= 0]
        if not found:
            return None
        index, stop = min(found)
        self.text = self.text[:index]
        return stop

    def flush(self) -> None:
        """The sequence ended without a stop string: release what the detokenizer held."""
        if self._detokenizer is not None:
            self.text += self._detokenizer.flush()

    def visible(self, finished: bool) -> str:
        if finished or not self._stops or self._hold == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]
