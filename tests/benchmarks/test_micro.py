"""Microbenchmarks of the engine's CPU-side hot paths on synthetic inputs. `make test` runs each
once as a plain test (benchmarks are disabled in pyproject); time them on request with

    .venv/bin/python -m pytest tests/benchmarks --benchmark-enable
"""

from __future__ import annotations

import itertools
import random

import torch
from pytest_benchmark.fixture import BenchmarkFixture

from compiled_engine.cache.block_manager import BlockManager
from compiled_engine.engine.sampler import Sampler, SamplingBatch
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.engine.scheduler import Scheduler
from compiled_engine.engine.sequence import Sequence

_ids = itertools.count()


def _running_scheduler(num_seqs: int) -> Scheduler:
    # Room for every sequence to grow through thousands of timed rounds without preemption.
    manager = BlockManager(num_pages=65536, page_size=16)
    scheduler = Scheduler(manager, max_num_seqs=num_seqs, max_num_batched_tokens=8192)
    rng = random.Random(0)
    for _ in range(num_seqs):
        prompt = [rng.randrange(50_000) for _ in range(rng.randint(50, 300))]
        scheduler.add(Sequence(next(_ids), prompt, SamplingParams(temperature=0, max_tokens=10_000)))
    while any(seq.is_prefilling for seq in scheduler.running) or scheduler.waiting:
        out = scheduler.schedule()
        for seq in scheduler.advance(out):
            seq.append_token(1)
    return scheduler


def test_scheduler_decode_step_256_sequences(benchmark: BenchmarkFixture) -> None:
    scheduler = _running_scheduler(256)

    def step() -> int:
        out = scheduler.schedule()
        for seq in scheduler.advance(out):
            seq.append_token(1)
        return len(out.scheduled)

    assert benchmark(step) == 256


def test_prefix_lookup_of_a_2048_token_prompt(benchmark: BenchmarkFixture) -> None:
    manager = BlockManager(num_pages=1024, page_size=16)
    prompt = list(range(2048))
    table: list[int] = []
    manager.grow(table, len(prompt))
    manager.register_full_pages(table, [], prompt, len(prompt), salt=0)
    pages, _ = benchmark(manager.match_prefix, prompt, 0)
    assert len(pages) == 127  # every full page but the one holding the last token


def test_page_allocation_and_release(benchmark: BenchmarkFixture) -> None:
    manager = BlockManager(num_pages=4096, page_size=16)

    def cycle() -> int:
        tables: list[list[int]] = [[] for _ in range(64)]
        for table in tables:
            manager.grow(table, 512)
        for table in tables:
            manager.free(table)
        return manager.num_free_pages

    assert benchmark(cycle) == 4096


def test_sampler_mixed_batch_of_64(benchmark: BenchmarkFixture) -> None:
    vocab, rows = 49152, 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
        SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.5),
    ]
    batch = SamplingBatch(
        params=[kinds[i % 3] for i in range(rows)],
        seeds=list(range(rows)),
        positions=[5] * rows,
        prompt_token_ids=[[1, 2, 3]] * rows,
        output_token_ids=[[4, 5, 6, 7, 8]] * rows,
        banned_token_ids=[[]] * rows,
    )
    out = benchmark(Sampler(), logits, batch)
    assert len(out.token_ids) == rows and all(0 <= t < vocab for t in out.token_ids)
