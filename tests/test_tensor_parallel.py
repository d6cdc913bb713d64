"""Tensor parallelism on CPU with gloo: TP = N against TP = 1 (same greedy ids, close logprobs),
KV heads split and replicated, each rank reading only its slices, uneven head counts refused
before anything starts, and a dead or hung rank failing the engine instead of hanging it.

Engines with N > 1 run in a spawned child process (rank 0), which spawns its own workers, so
the test process never joins a process group."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.errors import ModelConfigError
from compiled_engine.model.registry import config_from_dict, config_from_model_dir
from compiled_engine.model.shard import TPShard
from compiled_engine.weights.safetensors_loader import load_model

PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [200, 201]]


def _generate(config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    engine = LLMEngine(config)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        ids = [engine.add_request(p, params) for p in prompts]
        done: dict[str, tuple[list[int], list[float]]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    c = out.outputs[0]
                    assert c.logprobs is not None
                    done[out.request_id] = (c.token_ids, [lp.logprob for lp in c.logprobs])
        return [done[i] for i in ids]
    finally:
        engine.shutdown()


def _child(queue: Any, config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> None:
    try:
        queue.put(("ok", _generate(config, prompts, max_tokens)))
    except BaseException as exc:  # hand any failure to the test
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def _drafts_child(queue: Any, config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> None:
    """`_child`, plus the draft and accepted token counts of the engine's speculation."""
    try:
        engine = LLMEngine(config)
        try:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            ids = [engine.add_request(p, params) for p in prompts]
            done: dict[str, list[int]] = {}
            for _ in range(100 * max_tokens * len(prompts)):  # a cap, so that a regression fails
                if not engine.has_unfinished_requests():
                    break
                done.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
            stats = engine.speculative_stats
            assert stats is not None
            queue.put(("ok", ([done[i] for i in ids], stats.draft_tokens, stats.accepted_tokens)))
        finally:
            engine.shutdown()
    except BaseException as exc:  # hand any failure to the test
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def _in_child(
    config: EngineConfig,
    prompts: list[list[int]],
    max_tokens: int,
    timeout_s: float = 600,
    target: Callable[..., None] = _child,
) -> Any:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=target, args=(queue, config, prompts, max_tokens))
    child.start()
    try:
        status, value = queue.get(timeout=timeout_s)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert status == "ok", value
    return value


def _assert_same(tp: list[tuple[list[int], list[float]]], single: list[tuple[list[int], list[float]]]) -> None:
    for (ids_n, lps_n), (ids_1, lps_1) in zip(tp, single, strict=True):
        assert ids_n == ids_1
        torch.testing.assert_close(torch.tensor(lps_n), torch.tensor(lps_1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("model_type", "size", "overrides"),
    [
        # The quick tier runs one; the full tier the others.
        pytest.param("qwen3", 2, {}, marks=pytest.mark.full),  # 4 query heads, 2 KV heads: one KV head per rank
        ("llama", 4, {}),  # 4 query heads, 2 KV heads on 4 ranks: each KV head on two ranks
        pytest.param("llama", 2, {"attention_bias": True}, marks=pytest.mark.full),  # sharded biases, replicated o bias
        pytest.param("qwen2", 2, {}, marks=pytest.mark.full),  # sharded q/k/v biases, no o_proj bias
        # Gemma 2: four norms, GeGLU, windows of 4 on alternate layers, soft-capped logits.
        pytest.param(
            "gemma2",
            2,
            {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4}
            | {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
            marks=pytest.mark.full,
        ),
    ],
)
def test_tp_matches_single_process_on_tiny_models(
    model_type: str, size: int, overrides: dict[str, Any], tiny_model_factory: Callable[..., Path]
) -> None:
    model_dir = str(tiny_model_factory(model_type, **overrides))
    base = EngineConfig(model=model_dir, kv_cache_memory_gib=0.01, enforce_eager=True, max_num_batched_tokens=8)
    single = _generate(base, PROMPTS, 6)
    parallel = _in_child(EngineConfig(**{**_fields(base), "tensor_parallel_size": size}), PROMPTS, 6)
    _assert_same(parallel, single)


@pytest.mark.full
def test_compiled_tp_matches_eager_single_process(tiny_model_factory: Callable[..., Path]) -> None:
    """The DTensor layers compile with fullgraph=True (the all-reduces are traced as functional
    collectives; a graph break would raise) and agree with plain eager on one process."""
    model_dir = str(tiny_model_factory("qwen3"))
    base = EngineConfig(model=model_dir, kv_cache_memory_gib=0.01, enforce_eager=True, max_num_batched_tokens=8)
    compiled = _in_child(
        EngineConfig(**{**_fields(base), "tensor_parallel_size": 2, "enforce_eager": False}), PROMPTS, 6
    )
    _assert_same(compiled, _generate(base, PROMPTS, 6))


@pytest.mark.full
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_under_tp_keeps_the_single_process_greedy_ids(
    method: str, tiny_model_factory: Callable[..., Path]
) -> None:
    """Drafts verified on two ranks: every rank runs the same verify steps and the same
    rollbacks, and the greedy ids stay those of one process without speculation. The random
    model rejects every prompt-lookup draft, so that run covers verify steps and rollbacks; the
    draft model (the target itself, unsharded on rank 0) is accepted, so that run covers whole
    accepted runs."""
    model_dir = str(tiny_model_factory("llama"))
    base = EngineConfig(model=model_dir, kv_cache_memory_gib=0.01, enforce_eager=True, max_num_batched_tokens=8)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], *PROMPTS]  # the first gives drafts from its own prompt
    single = [ids for ids, _ in _generate(base, prompts, 40)]
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft_model":
        speculative = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3}
    tp = {"tensor_parallel_size": 2, "speculative_config": json.dumps(speculative)}
    ids, drafted, accepted = _in_child(EngineConfig(**{**_fields(base), **tp}), prompts, 40, target=_drafts_child)
    assert ids == single
    if method == "ngram":
        assert drafted > accepted, (drafted, accepted)  # drafts verified and rolled back
    else:
        assert accepted > 0.9 * drafted > 0, (drafted, accepted)  # whole runs accepted


@pytest.mark.full
def test_default_model_tp3_matches_tp1(default_model_dir: Path) -> None:
    """The default model has 9 query and 3 KV heads, so it splits 3 ways (not 2). Each rank keeps
    its slices of the GGUF's quantized tensors (Q4_1 rows and whole groups of columns, Q8_0)."""
    from compiled_engine.prompts import DEFAULT_PROMPTS
    from compiled_engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model_dir)
    prompts = [tokenizer.encode_prompt(p.text, p.chat) for p in DEFAULT_PROMPTS[:2]]
    base = EngineConfig(kv_cache_memory_gib=0.05, enforce_eager=True)
    _assert_same(
        _in_child(EngineConfig(**{**_fields(base), "tensor_parallel_size": 3}), prompts, 8), _generate(base, prompts, 8)
    )


KQUANTS = Path(__file__).parent / "fixtures" / "gguf_kquants" / "model"


def _with_attention_biases(source: Path, target: Path) -> Path:
    """A copy of a llama GGUF with random F32 q/k/v and o biases added (a llama model with
    attention_bias, whose o bias a row-parallel product must add once)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(target), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            item = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=item)
    rng = np.random.default_rng(0)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
        name, _, suffix = tensor.name.rpartition(".")
        if suffix == "weight" and name.rsplit(".", 1)[-1] in ("attn_q", "attn_k", "attn_v", "attn_output"):
            rows = int(tensor.shape[1])  # gguf's shape lists the row width first
            writer.add_tensor(f"{name}.bias", (0.5 * rng.standard_normal(rows)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@pytest.mark.parametrize(
    "biases", [False, pytest.param(True, marks=pytest.mark.full)], ids=["plain", "attention-biases"]
)
def test_a_k_quant_gguf_shards_its_quantized_products(biases: bool, private_models: Path, tmp_path: Path) -> None:
    """A llama.cpp Q4_K_M file (Q5_0, Q8_0, Q4_K and Q6_K products) at TP = 2: every rank runs its
    slices kept quantized (the row-parallel ones summed by a functional all-reduce, the o bias
    added once after it), with one process's greedy ids and logprobs. (The all-reduce is a
    functional collective like DTensor's, whose compiled TP test is
    test_compiled_tp_matches_eager_single_process.)"""
    model = str(KQUANTS / "model-Q4_K_M.gguf")
    if biases:
        model = str(_with_attention_biases(Path(model), tmp_path / "biased.gguf"))
    prompts = [[5, 17, 42, 90, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [60, 61]]
    base = EngineConfig(model=model, kv_cache_memory_gib=0.01, enforce_eager=True, max_num_batched_tokens=8)
    single = _generate(base, prompts, 6)
    _assert_same(_in_child(EngineConfig(**{**_fields(base), "tensor_parallel_size": 2}), prompts, 6), single)


def _fields(config: EngineConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__struct_fields__}


def test_uneven_head_counts_are_refused_before_anything_starts(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from compiled_engine.executor import ranks

    def must_not_run(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rank was started or a weight read before the head counts were checked")

    monkeypatch.setattr(ranks.RankGroup, "start", must_not_run)
    monkeypatch.setattr(ranks, "Runner", must_not_run)
    model_dir = str(tiny_model_factory("llama"))  # 4 query heads, 2 KV heads, intermediate 128
    with pytest.raises(
        ModelConfigError, match=r"--tensor-parallel-size 3 must divide num_attention_heads=4, num_key_value_heads=2"
    ):
        LLMEngine(EngineConfig(model=model_dir, tensor_parallel_size=3, enforce_eager=True))
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)


def test_kv_heads_split_or_replicated() -> None:
    config = config_from_dict(
        dict(
            model_type="llama",
            vocab_size=32,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=16,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
        )
    )
    assert [TPShard(r, 2).kv_heads(config) for r in range(2)] == [(0, 1), (1, 1)]
    assert [TPShard(r, 4).kv_heads(config) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    # rank r's query heads read exactly its KV head (group of 4 query heads per KV head)
    for r in range(4):
        first, count = TPShard(r, 4).heads(config)
        assert {h // 4 for h in range(first, first + count)} == {TPShard(r, 4).kv_heads(config)[0]}
    assert TPShard(1, 2).intermediate(config) == (32, 32)


def test_each_rank_reads_only_its_slices(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("qwen3")
    config = config_from_model_dir(model_dir)
    whole = load_model(model_dir, config, torch.float32, torch.device("cpu"))
    halves = [load_model(model_dir, config, torch.float32, torch.device("cpu"), TPShard(r, 2)) for r in range(2)]

    def sharded_bytes(model: torch.nn.Module) -> int:
        return sum(
            p.numel() * p.element_size()
            for n, p in model.named_parameters()
            if n.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight"))
        )

    assert sharded_bytes(halves[0]) == sharded_bytes(halves[1]) == sharded_bytes(whole) // 2
    # the two ranks' slices put side by side are the whole weight
    q, kv = config.q_size // 2, config.kv_size // 2
    w0, w1, w = (m.layers[0].self_attn.qkv_proj.weight for m in (*halves, whole))
    assert torch.equal(torch.cat([w0[:q], w1[:q]]), w[: config.q_size])
    assert torch.equal(torch.cat([w0[q : q + kv], w1[q : q + kv]]), w[config.q_size : config.q_size + config.kv_size])
    d0, d1, d = (m.layers[1].mlp.down_proj.weight for m in (*halves, whole))
    assert torch.equal(torch.cat([d0, d1], 1), d)


def _dead_worker_child(queue: Any, model_dir: str, how: str, parallel: dict[str, int] | None = None) -> None:
    """`parallel`: the engine's ranks (default: tensor_parallel_size 2)."""
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            enforce_eager=True,
            kv_cache_memory_gib=0.01,
            distributed_timeout_s=5,
            **(parallel or {"tensor_parallel_size": 2}),
        )
    )
    assert engine.ranks is not None
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    worker = engine.ranks.workers[0]
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    if how == "killed":
        worker.join(timeout=10)
    try:
        for _ in range(50):
            engine.step()
        queue.put("no error")
    except Exception as exc:
        queue.put(f"{type(exc).__name__}: {exc}")
    finally:
        if how == "hung":
            os.kill(worker.pid, signal.SIGKILL)


def dead_worker_message(model_dir: str, how: str, parallel: dict[str, int] | None = None) -> str:
    """What an engine (in a child process) raised after one of its workers was killed or hung."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_dead_worker_child, args=(queue, model_dir, how, parallel))
    child.start()
    try:
        message: str = queue.get(timeout=180)  # not forever: the collective timeout is 5 s
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    return message


def _idle_child(queue: Any, config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> None:
    """Generate, idle for two collective timeouts, generate again."""
    try:
        engine = LLMEngine(config)
        try:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            runs = []
            for pause_s in (0.0, 2 * config.distributed_timeout_s):
                time.sleep(pause_s)
                engine.add_request(prompts[0], params)
                outputs = []
                while engine.has_unfinished_requests():
                    outputs += [out.outputs[0].token_ids for out in engine.step() if out.finished]
                runs.append(outputs)
            queue.put(("ok", runs))
        finally:
            engine.shutdown()
    except BaseException as exc:  # hand any failure to the test
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.full
@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_an_engine_that_idles_past_the_collective_timeout_keeps_its_ranks(
    parallel: dict[str, int], tiny_model_factory: Callable[..., Path]
) -> None:
    """The other ranks wait for the next step inside a collective: rank 0 keeps them from
    reaching its timeout while no step comes. (The timeout also bounds the ranks' start, so it
    is not made shorter: a slow machine must still start them.)"""
    config = EngineConfig(
        model=str(tiny_model_factory("llama")), enforce_eager=True, distributed_timeout_s=12.0, **parallel
    )
    first, second = _in_child(config, [PROMPTS[0]], 4, timeout_s=120, target=_idle_child)
    assert len(first[0]) == 4 and second == first


@pytest.mark.parametrize("how", ["killed", pytest.param("hung", marks=pytest.mark.full)])
def test_a_dead_or_hung_worker_fails_the_engine_instead_of_hanging(
    how: str, tiny_model_factory: Callable[..., Path]
) -> None:
    message = dead_worker_message(str(tiny_model_factory("qwen3")), how)
    assert message != "no error"
    if how == "killed":
        assert "EngineDeadError" in message and "rank-1" in message


class StandInWorker:
    """A worker process stand-in that records how it was stopped."""

    def __init__(self, name: str, alive: bool) -> None:
        self.name, self.alive, self.exitcode = name, alive, None if alive else -9
        self.joined: list[float | None] = []
        self.killed = False

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float | None = None) -> None:
        self.joined.append(timeout)

    def kill(self) -> None:
        self.killed, self.alive = True, False


@pytest.mark.parametrize("lost", [False, True])
def test_stopping_a_group_waits_for_its_workers_unless_one_is_lost(lost: bool) -> None:
    """All alive: each worker gets the grace period to leave after rank 0's stop message (and is
    killed if it stays). One lost: the others wait in a collective that cannot complete, so they
    are killed at once, and the stop message, which would wait for the lost rank, is not sent."""
    from compiled_engine.executor.launch import RankGroup
    from compiled_engine.executor.pipeline import ParallelLayout

    workers = [StandInWorker("tp-rank-1", alive=not lost), StandInWorker("tp-rank-2", alive=True)]
    group = RankGroup(ParallelLayout(0, 1, 3), None, workers)  # type: ignore[arg-type]  # no mesh needed to stop
    assert group.all_alive() == (not lost)
    stopped: list[bool] = []
    engine = LLMEngine.__new__(LLMEngine)  # only what shutdown touches
    engine.ranks = group
    engine.runner = type("Runner", (), {"stop_workers": lambda self, stop_ranks: stopped.append(stop_ranks)})()  # type: ignore[assignment]
    engine.shutdown()
    assert engine.ranks is None
    assert stopped == [not lost]
    survivor = workers[1]
    assert survivor.joined[0] == (0.0 if lost else 10.0)
    assert survivor.killed  # the stand-in never leaves by itself


@pytest.mark.full
def test_server_with_a_lost_worker_reports_not_ready_and_exits_non_zero(tmp_path: Path) -> None:
    import httpx

    from tests.server_process import running_server

    with running_server(
        tmp_path,
        "--tensor-parallel-size",
        "3",
        "--device",
        "cpu",
        "--kv-cache-memory-gib",
        "0.05",
        "--distributed-timeout-s",
        "10",
    ) as server:
        # children of any of the server's threads (the engine loop thread starts the ranks)
        children = [
            pid
            for task in Path(f"/proc/{server.process.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()
        ]
        # the spawned ranks (not multiprocessing's resource tracker)
        workers = [int(pid) for pid in children if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(workers) == 2, children
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200
        os.kill(workers[0], signal.SIGKILL)
        saw_not_ready = False
        deadline = time.monotonic() + 30
        while server.process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                saw_not_ready |= httpx.get(f"{server.url}/ready", timeout=1).status_code == 503
            time.sleep(0.2)
        assert server.process.poll() == 1, server.log_text()[-2000:]
        assert saw_not_ready
        assert "engine rank rank-" in server.log_text()


def test_each_cpu_rank_takes_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from compiled_engine.executor import threads

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _: set(range(6)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert threads.threads_per_process(EngineConfig(device="cpu", tensor_parallel_size=3)) == 2
    assert threads.threads_per_process(EngineConfig(device="cpu", tensor_parallel_size=4)) == 1
    assert threads.threads_per_process(EngineConfig(device="cpu")) is None  # one process: torch's own
    assert threads.threads_per_process(EngineConfig(device="cpu", tensor_parallel_size=3, cpu_threads=5)) == 5
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: two of the ranks on this machine
    assert threads.threads_per_process(EngineConfig(device="cpu", tensor_parallel_size=4)) == 3
    with pytest.raises(ValueError, match="cpu_threads must be at least 1"):
        EngineConfig(cpu_threads=0)


def test_phi3_refuses_tensor_parallelism_before_reading_weights(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory("phi3", pad_token_id=0)
    config = config_from_model_dir(model_dir)
    with pytest.raises(ModelConfigError, match=r"--tensor-parallel-size 2: not supported for phi3: its checkpoint"):
        load_model(model_dir, config, torch.float32, torch.device("cpu"), TPShard(0, 2))
    load_model(model_dir, config, torch.float32, torch.device("cpu"), TPShard(0, 1))  # one rank loads


@pytest.mark.full
@pytest.mark.parametrize("kv_cache_dtype", ["float16", "fp8_e4m3"])
def test_tp_keeps_the_single_process_ids_on_a_small_kv_cache(
    kv_cache_dtype: str, tiny_model_factory: Callable[..., Path]
) -> None:
    """Each rank stores its KV heads' pages in the same type: TP = 2 gives TP = 1's ids over the
    same small cache."""
    model_dir = str(tiny_model_factory("llama"))
    base = EngineConfig(
        model=model_dir,
        kv_cache_memory_gib=0.01,
        enforce_eager=True,
        max_num_batched_tokens=8,
        kv_cache_dtype=kv_cache_dtype,
    )
    single = _generate(base, PROMPTS, 6)
    _assert_same(_in_child(EngineConfig(**{**_fields(base), "tensor_parallel_size": 2}), PROMPTS, 6), single)
