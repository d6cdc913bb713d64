"""The compiled path (torch.compile, regional, token count dynamic) against its slow twin, eager:
same logits on mixed prefill + decode batches, same greedy ids through the engine, one graph per
shape class and no recompilation as batch composition changes."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from compiled_engine.attention import op as attention_op
from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.cache_paths import CACHE_ENV, INDUCTOR_CACHE_ENV
from compiled_engine.config import ENFORCE_EAGER_ENV, EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.executor.compilation import (
    CompiledForward,
    use_compile_cache,
)
from compiled_engine.executor.precompiled import PrecompiledFunction, artifact_dir, call_signature, model_signature
from compiled_engine.executor.runner import Runner
from compiled_engine.executor.step import StepInputs
from compiled_engine.linear import packed_cpu as packed_linear
from compiled_engine.linear.packed_cpu import CpuLinear
from compiled_engine.prompts import DEFAULT_PROMPTS
from compiled_engine.weights.gguf import read_gguf_header, tensor_bytes
from tests.onednn_layout import packs_as_one_copy
from tests.server_process import running_server

PROMPTS = [p.text for p in DEFAULT_PROMPTS]

CPU = torch.device("cpu")


def _runner(model_dir: Path, compiled: bool, quantization: str | None = None, compile_cache: bool = False) -> Runner:
    """compile_cache False (most tests here): plain torch.compile, traced in this process, so
    Dynamo's counters see every graph; the saved traces have tests of their own below."""
    config = EngineConfig(
        model=str(model_dir),
        enforce_eager=not compiled,
        kv_cache_memory_gib=0.02,
        quantization=quantization,
        compile_cache=compile_cache,
    )
    return Runner(model_dir, config)


def _batches(vocab: int) -> list[list[tuple[int, int, int, list[int]]]]:
    """Steps of (sequence, cached tokens, new tokens, page table): prefills, then decodes mixed
    with a chunk of a longer prompt and a fresh prompt, then decode-only, then one token alone."""
    tables = {0: [0, 1], 1: [2, 3, 4], 2: [5, 6], 3: [7]}
    return [
        [(0, 0, 20, tables[0]), (1, 0, 7, tables[1])],
        [(0, 20, 1, tables[0]), (1, 7, 13, tables[1]), (2, 0, 9, tables[2])],
        [(0, 21, 1, tables[0]), (1, 20, 1, tables[1]), (2, 9, 1, tables[2])],
        [(3, 0, 1, tables[3])],
        [(1, 21, 12, tables[1])],
    ]


@torch.inference_mode()
def _run_steps(runner: Runner, tokens: dict[int, list[int]]) -> list[torch.Tensor]:
    outs = []
    for step in _batches(runner.model_config.vocab_size):
        ids: list[int] = []
        positions: list[int] = []
        for seq, cached, new, _ in step:
            ids += tokens[seq][cached : cached + new]
            positions += range(cached, cached + new)
        inputs = StepInputs(
            ids, positions, [new for _, _, new, _ in step], [c + n for _, c, n, _ in step], [t for *_, t in step]
        )
        logits = runner.execute(inputs).rows
        assert logits is not None
        outs.append(logits)
    return outs


@pytest.mark.parametrize("model_type", ["llama", pytest.param("qwen3", marks=pytest.mark.full)])
def test_compiled_logits_match_eager_on_mixed_batches_without_recompiling(
    model_type: str, tiny_model_factory: Callable[..., Path]
) -> None:
    model_dir = tiny_model_factory(model_type, max_position_embeddings=64)
    gen = torch.Generator().manual_seed(0)
    tokens = {s: torch.randint(3, 320, (40,), generator=gen).tolist() for s in range(4)}
    eager_runner = _runner(model_dir, compiled=False)
    head_once = packs_as_one_copy(eager_runner.model.lm_head.weight)  # what oneDNN does here
    eager = _run_steps(eager_runner, tokens)

    torch._dynamo.reset()
    counters.clear()
    runner = _runner(model_dir, compiled=True)
    after_warm_up = counters["stats"]["unique_graphs"]
    # the whole forward: one graph for many tokens (dynamic), one for a single token; the head's
    # one-row product runs the native kernel over its packed copy, uncompiled, or, where its
    # weight keeps two copies on this machine, a graph of its own
    head = set() if head_once else {"head"}
    assert runner.forward.entries().keys() == {"layer", "one-token forward", *head}
    assert after_warm_up == 2 + len(head)
    compiled = _run_steps(runner, tokens)
    assert counters["stats"]["unique_graphs"] == after_warm_up, "batch composition caused a recompilation"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    for e, c in zip(eager, compiled, strict=True):
        torch.testing.assert_close(c, e, atol=2e-4, rtol=1e-4)
        assert torch.equal(c.argmax(-1), e.argmax(-1))


def test_compiled_quantized_model_matches_eager_without_recompiling(tiny_model_factory: Callable[..., Path]) -> None:
    """int4 weights (and the int8 head): the opaque quantized operator inside the whole-forward
    one-token graph and the per-layer graphs, against the same operator run eagerly."""
    model_dir = tiny_model_factory("qwen3", max_position_embeddings=64)
    gen = torch.Generator().manual_seed(1)
    tokens = {s: torch.randint(3, 320, (40,), generator=gen).tolist() for s in range(4)}
    eager = _run_steps(_runner(model_dir, compiled=False, quantization="int4"), tokens)
    torch._dynamo.reset()
    counters.clear()
    runner = _runner(model_dir, compiled=True, quantization="int4")
    after_warm_up = counters["stats"]["unique_graphs"]
    compiled = _run_steps(runner, tokens)
    assert counters["stats"]["unique_graphs"] == after_warm_up, "batch composition caused a recompilation"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    for e, c in zip(eager, compiled, strict=True):
        torch.testing.assert_close(c, e, atol=2e-4, rtol=1e-4)
        assert torch.equal(c.argmax(-1), e.argmax(-1))


def test_compiled_engine_greedy_ids_equal_eager_for_the_default_model(default_model_dir: Path) -> None:
    """The default model through the whole engine: prompts of different lengths arriving while
    others decode, in small prefill chunks, so batches mix prefill and decode."""

    def generate(compiled: bool) -> list[list[int]]:
        engine = LLMEngine(EngineConfig(enforce_eager=not compiled, kv_cache_memory_gib=0.1, max_num_batched_tokens=24))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
        outputs: dict[str, list[int]] = {}
        late = list(PROMPTS[2:5])
        while engine.has_unfinished_requests() or late:
            if late:
                ids.append(engine.add_request(late.pop(0), params))
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
        return [outputs[i] for i in ids]

    torch._dynamo.reset()
    assert generate(compiled=True) == generate(compiled=False)


def test_enforce_eager_switches_compilation_off(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_model_factory("llama")
    assert not _runner(model_dir, compiled=False).forward.compiled
    monkeypatch.setenv(ENFORCE_EAGER_ENV, "1")
    assert EngineConfig().resolved_enforce_eager()
    assert not EngineConfig(enforce_eager=False).resolved_enforce_eager()  # explicit wins
    monkeypatch.setenv(ENFORCE_EAGER_ENV, "0")
    assert not EngineConfig().resolved_enforce_eager()  # compiled is the default


def test_compile_cache_lives_under_the_engine_cache_unless_the_user_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    assert use_compile_cache(tmp_path / "inductor") == tmp_path / "inductor"
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "inductor") and (tmp_path / "inductor").is_dir()
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert use_compile_cache(tmp_path / "other") == tmp_path / "mine"
    assert not (tmp_path / "other").exists()
    # what importing torch._dynamo writes there is Inductor's default, not the user's choice
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, default_cache_dir())
    assert use_compile_cache(tmp_path / "ours") == tmp_path / "ours"
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "ours")


def test_the_default_compiled_server_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_model_dir: Path
) -> None:
    """`serve` as users start it: compiled (the engine loop thread runs the compiled layers)."""
    monkeypatch.setenv(ENFORCE_EAGER_ENV, "0")
    with running_server(tmp_path, "--kv-cache-memory-gib", "0.05") as server:
        assert "torch.compile: model compiled" in server.log_text()
        question = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        }
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=question, timeout=120).json()
        assert "Paris" in reply["choices"][0]["message"]["content"]
        body = {"prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0}
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120) as stream:
            chunks = [line[5:].strip() for line in stream.iter_lines() if line.startswith("data:")]
        streamed = "".join(
            json.loads(c)["choices"][0]["text"] for c in chunks if c != "[DONE]" and json.loads(c)["choices"]
        )
        assert streamed == whole


@pytest.mark.parametrize("bias", [False, True])
def test_compiled_one_token_product_equals_f_linear(bias: bool) -> None:
    """A one-token product compiles to a multiply-and-sum over weight rows (CpuLinear), the
    many-token graph to F.linear; both must give F.linear's result."""
    torch.manual_seed(0)
    linear = CpuLinear(96, 80, bias=bias)  # not packed: the many-token graph is F.linear
    torch.nn.init.normal_(linear.weight)
    if linear.bias is not None:
        torch.nn.init.normal_(linear.bias)
    compiled = torch.compile(linear.forward, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        for rows in (1, 5):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(compiled(x), F.linear(x, linear.weight, linear.bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("one_copy", [pytest.param(True, marks=pytest.mark.full), False])
def test_the_head_of_one_row_equals_eager(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, one_copy: bool
) -> None:
    """One copy: the head's one-row product runs the native kernel over the packed copy, with no
    graph of its own. Without the kernel (two copies) it is compiled on its own."""
    model_dir = tiny_model_factory("llama", max_position_embeddings=64)
    eager_head = _runner(model_dir, compiled=False).model.lm_head.weight
    if not one_copy:
        monkeypatch.setattr(packed_linear, "blocked_gemv_operator", lambda: None)
    held_once = one_copy and packs_as_one_copy(eager_head)  # as this machine's oneDNN lays it out
    runner = _runner(model_dir, compiled=True)
    forward = runner.forward
    assert isinstance(forward, CompiledForward)
    assert (forward.one_row_head is None) == held_once
    assert (runner.model.lm_head.blocked is not None) == held_once
    for rows in (1, 3):
        hidden = torch.randn(rows, runner.model.config.hidden_size)
        with torch.inference_mode():
            torch.testing.assert_close(forward.logits(hidden), F.linear(hidden, eager_head), atol=1e-4, rtol=1e-5)


@torch.inference_mode()
def test_a_compiled_decode_step_is_one_compiled_entry_and_one_attention_plan(
    tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lean step: one Dynamo entry for the whole forward (the head's one-row product runs the
    native kernel over its packed copy, outside any graph), not one per layer; the backend
    prepares one plan per forward and every layer attends by that same plan (on the CPU, installed
    once in the native operator, which the layers then call without Python)."""
    model_dir = tiny_model_factory("llama", max_position_embeddings=64, num_hidden_layers=3)
    runner = _runner(model_dir, compiled=True)
    head_once = isinstance(runner.forward, CompiledForward) and runner.forward.one_row_head is None
    backend = runner.backend
    prepared: list[object] = []
    attended: list[object] = []
    prepare, forward = backend.prepare, backend.forward

    def recording_prepare(metadata: AttentionMetadata, kv_cache: torch.Tensor) -> object:
        prepared.append(prepare(metadata, kv_cache))
        return prepared[-1]

    def recording_forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: object,
        scale: float,
        window: int = 0,
        soft_cap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attended.append(plan)
        return forward(q, k, v, kv_cache, plan, scale, window, soft_cap, sinks)

    installed: list[object] = []
    install = attention_op.install_plan

    def recording_install(plan: object) -> None:
        installed.append(plan)
        install(plan)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "prepare", recording_prepare)
    monkeypatch.setattr(backend, "forward", recording_forward)
    monkeypatch.setattr(attention_op, "install_plan", recording_install)
    runner.execute(StepInputs(list(range(3, 8)), list(range(5)), [5], [5], [[0]]))  # the prompt
    with torch.profiler.profile() as prof:
        logits = runner.execute(StepInputs([9], [5], [1], [6], [[0]])).rows
    assert logits is not None and logits.shape == (1, runner.model_config.vocab_size)
    entries = [e for e in prof.events() if e.name.startswith("Torch-Compiled Region")]
    # the forward, and the head's one-row graph where this machine keeps its weight in two copies
    assert len(entries) == (1 if head_once else 2), [e.name for e in entries]
    assert len(prepared) == 2
    if getattr(backend, "native_operator", False):
        # The CPU backend's native operator: each forward installs its plan once, and no layer
        # call comes back to Python.
        natives = [plan.native for plan in prepared]  # type: ignore[attr-defined]
        assert attended == [] and installed == [natives[0], None, natives[1], None]
    else:
        assert attended == [prepared[0]] * 3 + [prepared[1]] * 3


# -- saved traces (executor/precompiled.py) ---------------------------------------------------------


def _eager_run(
    tiny_model_factory: Callable[..., Path], model_type: str, seed: int
) -> tuple[Path, dict[int, list[int]], list[torch.Tensor]]:
    """A tiny model, random tokens for four sequences, and the eager logits of `_batches`."""
    model_dir = tiny_model_factory(model_type, max_position_embeddings=64)
    gen = torch.Generator().manual_seed(seed)
    tokens = {s: torch.randint(3, 320, (40,), generator=gen).tolist() for s in range(4)}
    return model_dir, tokens, _run_steps(_runner(model_dir, compiled=False), tokens)


def _entry_sources(runner: Runner) -> dict[str, str]:
    assert isinstance(runner.forward, CompiledForward)
    return {name: entry.source for name, entry in runner.forward.entries().items()}


def test_a_saved_trace_loads_at_the_next_start_without_tracing_and_matches_eager(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model_dir, tokens, eager = _eager_run(tiny_model_factory, "qwen3", seed=2)

    torch._dynamo.reset()
    first = _runner(model_dir, compiled=True, compile_cache=True)
    assert set(_entry_sources(first).values()) == {"compiled and saved"}
    # the layer, the one-token forward (and the head's one-row graph where its weight keeps two copies)
    assert len(list((tmp_path / "compiled").rglob("*.bin"))) == len(_entry_sources(first)) >= 2
    first_logits = _run_steps(first, tokens)

    torch._dynamo.reset()
    counters.clear()
    second = _runner(model_dir, compiled=True, compile_cache=True)  # a later start
    assert set(_entry_sources(second).values()) == {"loaded"}
    second_logits = _run_steps(second, tokens)
    assert counters["stats"]["unique_graphs"] == 0, "a saved entry was traced again"
    for e, a, b in zip(eager, first_logits, second_logits, strict=True):
        assert torch.equal(a, b)  # the same compiled code
        torch.testing.assert_close(b, e, atol=2e-4, rtol=1e-4)
        assert torch.equal(b.argmax(-1), e.argmax(-1))


@pytest.mark.full
def test_a_gguf_of_mixed_types_saves_one_trace_per_kind_of_layer_and_loads_them_all(private_cache: Path) -> None:
    """llama.cpp's Q4_K_M of a small model: layer 0's down_proj is Q4_K (int4), layer 1's Q6_K
    (int8, groups of 16), so the layers are two kinds with a compiled entry and a saved trace
    each. The next start loads both and traces nothing; the logits equal eager's."""
    from compiled_engine.weights.gguf_dir import prepare_gguf_dir

    model_dir = prepare_gguf_dir(Path(__file__).parent / "fixtures" / "gguf_kquants" / "model" / "model-Q4_K_M.gguf")
    gen = torch.Generator().manual_seed(4)
    tokens = {s: torch.randint(3, 96, (40,), generator=gen).tolist() for s in range(4)}
    eager = _run_steps(_runner(model_dir, compiled=False), tokens)

    torch._dynamo.reset()
    first = _runner(model_dir, compiled=True, compile_cache=True)
    sources = _entry_sources(first)
    assert {"layer", "layer, weights #2", "one-token forward"} <= sources.keys()
    assert set(sources.values()) == {"compiled and saved"}
    first_logits = _run_steps(first, tokens)

    torch._dynamo.reset()
    counters.clear()
    second = _runner(model_dir, compiled=True, compile_cache=True)
    assert set(_entry_sources(second).values()) == {"loaded"}
    second_logits = _run_steps(second, tokens)
    assert counters["stats"]["unique_graphs"] == 0, "a saved entry was traced again"
    for e, a, b in zip(eager, first_logits, second_logits, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(b, e, atol=2e-4, rtol=1e-4)


def _assert_own_logits(
    runner: Runner, tokens: dict[int, list[int]], own: list[torch.Tensor], other: list[torch.Tensor]
) -> None:
    """The runner's logits on `_batches` are its own model's eager ones, far from the other model's."""
    for got, want, elsewhere in zip(_run_steps(runner, tokens), own, other, strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert (got - elsewhere).abs().max() > 0.1


@pytest.mark.full
@pytest.mark.parametrize("beside_the_first", [False, True], ids=["a later start", "beside the first"])
def test_a_checkpoint_of_the_same_shapes_gets_its_own_logits_from_the_first_ones_traces(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, beside_the_first: bool
) -> None:
    """Saved traces are keyed by the model's structure and configuration, not by its weights
    (model_runner.py), so another checkpoint of the same shapes (another seed) loads the first
    one's traces, at a later start or in the same process while the first still runs. Its
    weights are the traces' inputs: it gives its own eager logits, not the first model's."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    first_dir, tokens, first_eager = _eager_run(tiny_model_factory, "llama", seed=5)
    second_dir = tiny_model_factory("llama", seed=1, max_position_embeddings=64)
    second_eager = _run_steps(_runner(second_dir, compiled=False), tokens)

    torch._dynamo.reset()
    first = _runner(first_dir, compiled=True, compile_cache=True)
    assert set(_entry_sources(first).values()) == {"compiled and saved"}
    saved = sorted((tmp_path / "compiled").rglob("*.bin"))

    if not beside_the_first:
        torch._dynamo.reset()
    counters.clear()
    second = _runner(second_dir, compiled=True, compile_cache=True)
    # The same directory and files: what this test is about (were the key ever to take the
    # weights, the second model would compile its own and this would no longer test reuse).
    assert sorted((tmp_path / "compiled").rglob("*.bin")) == saved
    assert set(_entry_sources(second).values()) == {"loaded"}
    assert counters["stats"]["unique_graphs"] == 0, "a saved entry was traced again"
    _assert_own_logits(second, tokens, second_eager, first_eager)
    if beside_the_first:
        _assert_own_logits(first, tokens, first_eager, second_eager)


def _rows_reversed(source: Path, target: Path) -> Path:
    """A copy of the GGUF file `source` whose matrices hold their rows in reverse order: the same
    metadata, block types and shapes, other weights (a row is whole blocks, so still valid ones)."""
    header = read_gguf_header(source)
    data = bytearray(source.read_bytes())
    for info in header.tensors.values():
        if len(info.shape) == 2:
            end = info.offset + tensor_bytes(info)
            rows = torch.frombuffer(data[info.offset : end], dtype=torch.uint8).reshape(info.shape[0], -1)
            data[info.offset : end] = rows.flip(0).numpy().tobytes()
    target.write_bytes(data)
    return target


@pytest.mark.full
def test_a_gguf_of_the_same_types_gets_its_own_logits_from_another_files_traces(
    private_cache: Path, tmp_path: Path
) -> None:
    """Two Q4_K_M files of one model's shapes and block types (the second the first with every
    matrix's rows reversed): the second loads the traces the first saved, and runs its own weights."""
    from compiled_engine.weights.gguf_dir import prepare_gguf_dir

    source = Path(__file__).parent / "fixtures" / "gguf_kquants" / "model" / "model-Q4_K_M.gguf"
    first_dir = prepare_gguf_dir(source)
    second_dir = prepare_gguf_dir(_rows_reversed(source, tmp_path / "reversed-Q4_K_M.gguf"))
    gen = torch.Generator().manual_seed(6)
    tokens = {s: torch.randint(3, 96, (40,), generator=gen).tolist() for s in range(4)}
    first_eager = _run_steps(_runner(first_dir, compiled=False), tokens)
    second_eager = _run_steps(_runner(second_dir, compiled=False), tokens)

    torch._dynamo.reset()
    first = _runner(first_dir, compiled=True, compile_cache=True)
    assert set(_entry_sources(first).values()) == {"compiled and saved"}
    torch._dynamo.reset()
    counters.clear()
    second = _runner(second_dir, compiled=True, compile_cache=True)
    assert set(_entry_sources(second).values()) == {"loaded"}
    assert counters["stats"]["unique_graphs"] == 0, "a saved entry was traced again"
    _assert_own_logits(second, tokens, second_eager, first_eager)


def test_a_saved_trace_that_does_not_load_is_compiled_again(
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model_dir, tokens, eager = _eager_run(tiny_model_factory, "llama", seed=3)
    _runner(model_dir, compiled=True, compile_cache=True)
    (damaged,) = (tmp_path / "compiled").rglob("one_token_forward.bin")
    damaged.write_bytes(b"not a saved trace")
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="compiled_engine.executor.precompiled"):
        runner = _runner(model_dir, compiled=True, compile_cache=True)
    head = {"head": "loaded"} if "head" in _entry_sources(runner) else {}  # two copies of the head here
    assert _entry_sources(runner) == {"layer": "loaded", "one-token forward": "compiled and saved", **head}
    assert "does not load" in caplog.text
    assert damaged.read_bytes() != b"not a saved trace"
    for e, c in zip(eager, _run_steps(runner, tokens), strict=True):
        torch.testing.assert_close(c, e, atol=2e-4, rtol=1e-4)


def _scale_and_shift(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_a_call_the_saved_guards_refuse_runs_through_plain_torch_compile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "fn.bin"
    saving = PrecompiledFunction(_scale_and_shift, path, dynamic_dims=((0, 0),))
    torch.testing.assert_close(saving(torch.ones(4)), torch.full((4,), 3.0))
    assert saving.source == "compiled and saved" and path.is_file()

    torch._dynamo.reset()
    loading = PrecompiledFunction(_scale_and_shift, path, dynamic_dims=((0, 0),))
    x = torch.arange(6.0)
    torch.testing.assert_close(loading(x), x * 2 + 1)  # another length: the token dimension is dynamic
    assert loading.source == "loaded"
    counters.clear()
    with caplog.at_level("WARNING", logger="compiled_engine.executor.precompiled"):
        doubles = torch.arange(3, dtype=torch.float64)
        torch.testing.assert_close(loading(doubles), doubles * 2 + 1)
    assert "guards refuse a call" in caplog.text and "dtype mismatch" in caplog.text
    assert counters["stats"]["unique_graphs"] == 1  # traced, as plain torch.compile does

    unsaved = PrecompiledFunction(_scale_and_shift, None)
    torch.testing.assert_close(unsaved(x), x * 2 + 1)
    assert unsaved.source == "traced"


def test_saved_guards_are_evaluated_once_per_call_signature(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guards read every weight's metadata at each call (about 1 ms a decode step), so a call
    whose signature they already accepted skips them; a new shape, dtype or grad mode is checked,
    and a refused signature is never remembered."""
    path = tmp_path / "fn.bin"
    PrecompiledFunction(_scale_and_shift, path, dynamic_dims=((0, 0),))(torch.ones(4))
    torch._dynamo.reset()
    loading = PrecompiledFunction(_scale_and_shift, path, dynamic_dims=((0, 0),))
    x = torch.arange(6.0)
    torch.testing.assert_close(loading(x), x * 2 + 1)
    checks: list[tuple[Any, ...]] = []
    check = loading.saved.guard_check
    monkeypatch.setattr(loading.saved, "guard_check", lambda *args: checks.append(args) or check(*args))
    for _ in range(3):
        torch.testing.assert_close(loading(x + 1), x * 2 + 3)  # a new tensor, the same signature
    assert checks == []
    torch.testing.assert_close(loading(torch.arange(7.0)), torch.arange(7.0) * 2 + 1)  # another length
    with torch.no_grad():
        loading(x)
    assert len(checks) == 2
    loading(torch.arange(7.0))
    assert len(checks) == 2
    doubles = torch.arange(6, dtype=torch.float64)  # only the dtype differs from x
    for _ in range(2):  # refused each time, so checked each time, and traced
        torch.testing.assert_close(loading(doubles), doubles * 2 + 1)
    assert len(checks) == 4
    assert call_signature((x, [1, 2])) is None  # an unhashable argument: always checked


def test_saved_traces_are_keyed_by_the_model_and_its_configuration(tiny_model_factory: Callable[..., Path]) -> None:
    root = Path("/nonexistent")
    llama = Runner(tiny_model_factory("llama"), EngineConfig(enforce_eager=True)).model
    qwen3 = Runner(tiny_model_factory("qwen3"), EngineConfig(enforce_eager=True)).model
    assert artifact_dir(root, model_signature(llama)) == artifact_dir(root, model_signature(llama))
    assert artifact_dir(root, model_signature(llama)) != artifact_dir(root, model_signature(qwen3))
    assert artifact_dir(root, [*model_signature(llama), "float32"]) != artifact_dir(
        root, [*model_signature(llama), "bfloat16"]
    )
