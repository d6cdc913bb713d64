"""Which slice of the model one tensor-parallel rank holds: plain arithmetic on head counts,
shared by the model (local sizes), the loader (what to read) and the sharding plan.

Query heads and the MLP's intermediate features (each expert's, in a mixture) are split evenly. KV heads are split when there
are at least as many as ranks; with fewer, each KV head is replicated on the ranks whose query
heads read it (rank r holds KV head r * kv_heads // size).
"""

from __future__ import annotations

from dataclasses import dataclass

from compiled_engine.errors import ModelConfigError
from compiled_engine.model.config import ModelConfig


@dataclass(frozen=True)
class TPShard:
    rank: int = 0
    size: int = 1

    def check(self, config: ModelConfig) -> None:
        """A ModelConfigError, before any weight is read, unless `config` splits evenly."""
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.size}")
        problems = []
        if config.num_heads % self.size:
            problems.append(f"num_attention_heads={config.num_heads}")
        kv = config.num_kv_heads
        if (kv % self.size) if kv >= self.size else (self.size % kv):
            problems.append(f"num_key_value_heads={kv}")
        if config.intermediate_size % self.size:
            problems.append(f"intermediate_size={config.intermediate_size}")
        if config.moe is not None:  # every expert's intermediate features split too
            for name, width in (
                ("expert", config.moe.intermediate_size),
                ("shared expert", config.moe.shared_intermediate_size),
            ):
                if width % self.size:
                    problems.append(f"the {name} intermediate size {width}")
        if problems:
            raise ModelConfigError(
                f"--tensor-parallel-size {self.size} must divide {', '.join(problems)} "
                f"(KV heads may also be fewer than ranks if they divide the rank count)"
            )

    def heads(self, config: ModelConfig) -> tuple[int, int]:
        """(first query head, count) of this rank."""
        count = config.num_heads // self.size
        return self.rank * count, count

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        """(first KV head, count) of this rank."""
        kv = config.num_kv_heads
        if kv >= self.size:
            count = kv // self.size
            return self.rank * count, count
        return self.rank * kv // self.size, 1

    def intermediate(self, config: ModelConfig) -> tuple[int, int]:
        return self.split(config.intermediate_size)

    def split(self, width: int) -> tuple[int, int]:
        """(first, count) of this rank's even share of `width` features (an expert's intermediate)."""
        count = width // self.size
        return self.rank * count, count


NO_SHARD = TPShard()  # the whole model on one rank
