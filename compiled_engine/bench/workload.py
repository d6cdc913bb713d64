"""The requests a benchmark sends: random token prompts and output lengths, seeded."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(
    vocab: int, num_seqs: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(*input_len))] for _ in range(num_seqs)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_seqs)])
