"""Prompt-lookup drafts: no model, only the sequence's own tokens.

If the sequence's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) occurred
earlier in its prompt or output, the tokens that followed their latest earlier occurrence are the
draft. When that occurrence ends close to the end, the continuation runs on into the draft itself
(a loop of period d keeps repeating). Code edits, quotes and summaries repeat their input, so
there the draft is often right.
"""

from __future__ import annotations


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of `max_n` down to `min_n` tokens; [] when none occurred."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        # latest start first; a match must end before the suffix starts
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == suffix:
                draft: list[int] = []
                for i in range(start + n, start + n + k):
                    draft.append(tokens[i] if i < length else draft[i - length])
                return draft
    return []
