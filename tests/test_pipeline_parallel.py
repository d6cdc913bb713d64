"""Pipeline parallelism on CPU with gloo: PP = N (and PP x TP) against PP = 1, the same greedy ids
and close logprobs, on tiny models and on the default model, batched and alone, with chunked
prefill and preemption; a Gemma 3 stage that starts mid-model picks its layers' rotary; the
micro-batches a step is cut into; a stage's loader reading only its layers; and a killed stage
failing the engine instead of hanging it.

Engines with more than one rank run in a spawned child process (rank 0), as in
tests/test_tensor_parallel.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.executor.pipeline import ParallelLayout, stage_layers
from compiled_engine.executor.step import StepInputs
from compiled_engine.model.checkpoint import CheckpointTensor
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.weights import gguf_loader as gguf_loading
from compiled_engine.weights.load import load_weights
from tests.test_model_families import VARIANTS
from tests.test_tensor_parallel import PROMPTS, _assert_same, _fields, _generate, _in_child, dead_worker_message

pytestmark = pytest.mark.usefixtures("one_thread")


def test_stages_take_contiguous_even_slices_of_the_layers() -> None:
    assert [list(stage_layers(30, 2, s)) for s in (0, 1)] == [list(range(15)), list(range(15, 30))]
    assert [len(stage_layers(7, 3, s)) for s in range(3)] == [3, 2, 2]
    assert [stage_layers(7, 3, s).start for s in range(3)] == [0, 3, 5]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        stage_layers(2, 3, 0)
    grid = [ParallelLayout(rank, 2, 3) for rank in range(6)]
    assert [(layout.stage, layout.tensor_rank) for layout in grid] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [layout.is_last_stage for layout in grid] == [False] * 3 + [True] * 3


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_a_stage_reads_and_holds_only_its_layers(
    source: str,
    tiny_model_factory: Callable[..., Path],
    default_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage's loader reads its decoder layers (and the embedding, norm and head), not the
    others, and holds them with the values a whole load gives them."""
    model_dir = tiny_model_factory("llama") if source == "safetensors" else default_model_dir
    config = config_from_model_dir(model_dir)
    engine_config = EngineConfig(model=str(model_dir), device="cpu")
    cpu = torch.device("cpu")
    read: list[str] = []
    if source == "safetensors":
        original = CheckpointTensor.read

        def recording(self: CheckpointTensor, tensor_slice: Any) -> torch.Tensor:
            read.append(self.param)
            return original(self, tensor_slice)

        monkeypatch.setattr(CheckpointTensor, "read", recording)
    else:
        original_read = gguf_loading._read

        def recording_read(f: Any, header: Any, part: Any) -> Any:
            read.append(part.name)
            return original_read(f, header, part)

        monkeypatch.setattr(gguf_loading, "_read", recording_read)
    whole = load_weights(model_dir, config, engine_config, torch.float32, cpu).model
    whole_reads, read[:] = set(read), []
    kept = stage_layers(config.num_layers, 2, 1)
    stage = load_weights(model_dir, config, engine_config, torch.float32, cpu, layers=kept).model

    layer_of = re.compile(r"(?:layers|blk)\.(\d+)\.")
    read_layers = {int(m.group(1)) for name in read if (m := layer_of.match(name))}
    assert read_layers == set(kept)
    assert {name for name in whole_reads if not layer_of.match(name)} <= set(read)  # embedding, norm, head
    assert len(stage.layers) == len(kept) and stage.first_layer == kept.start
    whole_state, stage_state = whole.state_dict(), stage.state_dict()
    for name, tensor in stage_state.items():
        found = layer_of.match(name)
        whole_name = (
            name if found is None else name.replace(found.group(0), f"layers.{int(found.group(1)) + kept.start}.", 1)
        )
        assert torch.equal(tensor, whole_state[whole_name]), name


def test_a_step_is_cut_into_micro_batches_of_whole_sequences() -> None:
    decode = StepInputs(list(range(8)), list(range(10, 18)), [1] * 8, [11] * 8, [[i] for i in range(8)], [0] * 8)
    parts = decode.micro_batches(2)
    assert [part.query_lens for part in parts] == [[1] * 4, [1] * 4]
    assert [token for part in parts for token in part.token_ids] == decode.token_ids
    assert parts[1].block_tables == [[4], [5], [6], [7]] and parts[1].lora_slots == [0] * 4
    mixed = StepInputs(list(range(13)), list(range(13)), [10, 1, 1, 1], [10, 5, 6, 7], [[0], [1], [2], [3]])
    assert [part.query_lens for part in mixed.micro_batches(2)] == [[10], [1, 1, 1]]
    assert [part.query_lens for part in mixed.micro_batches(4)] == [[10], [1], [1], [1]]
    lone = StepInputs([1, 2, 3], [0, 1, 2], [3], [3], [[0]])
    assert [part.query_lens for part in lone.micro_batches(4)] == [[3]]


@pytest.mark.parametrize(
    ("variant", "pipeline", "tensor"),
    [
        ("llama", 2, 1),
        pytest.param("llama", 2, 2, marks=pytest.mark.full),  # a 2 x 2 grid: each stage's layers split again
        pytest.param("gemma3", 3, 1, marks=pytest.mark.full),  # stage 1 is layer 1 alone: a full-attention layer
        pytest.param("qwen3", 2, 1, marks=pytest.mark.full),
    ],
)
def test_pp_matches_one_process_on_tiny_models(
    variant: str, pipeline: int, tensor: int, tiny_model_factory: Callable[..., Path]
) -> None:
    model_type, overrides = VARIANTS.get(variant, (variant, {}))
    model_dir = str(tiny_model_factory(model_type, **{k: v for k, v in overrides.items() if k != "pad_token_id"}))
    base = EngineConfig(model=model_dir, kv_cache_memory_gib=0.01, enforce_eager=True, max_num_batched_tokens=8)
    single = _generate(base, PROMPTS, 6)
    parallel = {"pipeline_parallel_size": pipeline, "tensor_parallel_size": tensor}
    _assert_same(_in_child(EngineConfig(**{**_fields(base), **parallel}), PROMPTS, 6), single)


@pytest.mark.full
def test_compiled_pp_matches_eager_one_process(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = str(tiny_model_factory("llama"))
    base = EngineConfig(model=model_dir, kv_cache_memory_gib=0.01, enforce_eager=True, max_num_batched_tokens=8)
    compiled = {"pipeline_parallel_size": 2, "enforce_eager": False}
    _assert_same(_in_child(EngineConfig(**{**_fields(base), **compiled}), PROMPTS, 6), _generate(base, PROMPTS, 6))


def _batched_and_alone(queue: Any, config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> None:
    """The prompts' greedy ids batched, then each alone, and the preemptions the batch caused."""
    try:
        engine = LLMEngine(config)
        try:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

            def run(batch: list[list[int]]) -> list[list[int]]:
                ids = [engine.add_request(p, params) for p in batch]
                done: dict[str, list[int]] = {}
                while engine.has_unfinished_requests():
                    done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
                return [done[i] for i in ids]

            batched = run(prompts)
            preemptions = engine.scheduler.num_preemptions
            alone = [run([prompt])[0] for prompt in prompts]
            queue.put(("ok", (batched, alone, preemptions)))
        finally:
            engine.shutdown()
    except BaseException as exc:  # hand any failure to the test
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize(
    ("pipeline", "tensor"),
    [pytest.param(2, 1, marks=pytest.mark.full), pytest.param(2, 3, marks=pytest.mark.full)],  # 2 x 3: six processes
)
def test_default_model_pp_gives_pp1s_ids_batched_and_alone_with_chunks_and_preemption(
    pipeline: int, tensor: int, default_model_dir: Path
) -> None:
    from compiled_engine.prompts import DEFAULT_PROMPTS
    from compiled_engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model_dir)
    prompts = [tokenizer.encode_prompt(p.text, p.chat) for p in DEFAULT_PROMPTS[:3]]
    # Chunks of at most 16 tokens a step, and pages for about two of the three sequences at once.
    base = EngineConfig(enforce_eager=True, max_num_batched_tokens=16, num_pages=9, page_size=16)
    want_batched, want_alone, want_preempted = _in_child(base, prompts, 24, target=_batched_and_alone)
    assert want_preempted > 0, "the pool is meant to force a preemption"
    parallel = {"pipeline_parallel_size": pipeline, "tensor_parallel_size": tensor}
    batched, alone, preempted = _in_child(
        EngineConfig(**{**_fields(base), **parallel}), prompts, 24, target=_batched_and_alone, timeout_s=900
    )
    assert preempted > 0
    assert batched == want_batched
    assert alone == want_alone


@pytest.mark.full  # the quick tier kills a tensor-parallel worker (tests/test_tensor_parallel.py)
def test_a_killed_stage_fails_the_engine_instead_of_hanging(tiny_model_factory: Callable[..., Path]) -> None:
    message = dead_worker_message(str(tiny_model_factory("qwen3")), "killed", {"pipeline_parallel_size": 2})
    assert "EngineDeadError" in message and "rank-1" in message, message


def test_pipeline_parallelism_refuses_what_it_does_not_run(tiny_model_factory: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="without speculative decoding and LoRA"):
        EngineConfig(pipeline_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="without speculative decoding and LoRA"):
        EngineConfig(pipeline_parallel_size=2, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1"):
        EngineConfig(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):  # before any process starts
        LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), pipeline_parallel_size=3, enforce_eager=True))


@pytest.mark.full
def test_pp_keeps_the_one_process_ids_on_an_fp8_kv_cache(tiny_model_factory: Callable[..., Path]) -> None:
    """Each stage holds its layers' pages in the same type: two stages give one process's ids."""
    model_dir = str(tiny_model_factory("llama"))
    base = EngineConfig(
        model=model_dir,
        kv_cache_memory_gib=0.01,
        enforce_eager=True,
        max_num_batched_tokens=8,
        kv_cache_dtype="fp8_e4m3",
    )
    single = _generate(base, PROMPTS, 6)
    _assert_same(_in_child(EngineConfig(**{**_fields(base), "pipeline_parallel_size": 2}), PROMPTS, 6), single)
