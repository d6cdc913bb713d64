"""LoRA adapters against PEFT on transformers (the oracle), fp32 CPU: greedy ids for each adapter
alone and for a batch that mixes two adapters with the base model, eager and compiled; what the
loader refuses; slots and the prefix cache."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from safetensors.torch import load_file, save_file
from torch._dynamo.utils import counters

from compiled_engine import LLM, LoRARequest, SamplingParams
from compiled_engine.config import EngineConfig
from compiled_engine.errors import RequestError
from compiled_engine.linear.lora_op import dense_lora_delta, reference_lora_delta, token_runs
from compiled_engine.lora.adapter import LoRAError, load_adapter
from compiled_engine.model.registry import config_from_model_dir

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 99, 3, 42, 8], [11, 12, 13], [200, 7, 7, 31, 64, 2, 9, 150]]
NEW_TOKENS = 10


def _peft_adapter(model_dir: Path, out: Path, seed: int, **lora: Any) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    options = {"r": 4, "lora_alpha": 8, "target_modules": ALL_TARGETS, "init_lora_weights": False, **lora}
    model = get_peft_model(base, LoraConfig(**options))
    with torch.no_grad():  # PEFT's non-zero init is small: make the adapter change the greedy ids
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out


def _peft_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def lora_setup(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model_dir = tiny_model_factory("llama", max_position_embeddings=64)
    root = tmp_path_factory.mktemp("adapters")
    first = _peft_adapter(model_dir, root / "first", seed=1)
    # q/v only, a rank pattern and rsLoRA scaling: the fused qkv gets two of its three pieces
    second = _peft_adapter(
        model_dir,
        root / "second",
        seed=2,
        r=6,
        lora_alpha=12,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        use_rslora=True,
    )
    return {
        "model_dir": model_dir,
        "first": first,
        "second": second,
        "expected": {
            None: _peft_greedy(model_dir, None),
            "first": _peft_greedy(model_dir, first),
            "second": _peft_greedy(model_dir, second),
        },
    }


def _lora_llm(lora_setup: dict[str, Any], **options: Any) -> LLM:
    """The tiny model with adapter slots, eager unless told, in a small KV pool."""
    return LLM(
        str(lora_setup["model_dir"]),
        **{"enable_lora": True, "enforce_eager": True, "kv_cache_memory_gib": 0.02, **options},
    )


def _greedy(llm: LLM, loras: list[LoRARequest | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        PROMPTS * len(loras), params, use_tqdm=False, lora_request=[x for x in loras for _ in PROMPTS]
    )
    ids = [out.outputs[0].token_ids for out in outputs]
    return [ids[i : i + len(PROMPTS)] for i in range(0, len(ids), len(PROMPTS))]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_adapters_alone_and_mixed_in_one_batch_match_peft(lora_setup: dict[str, Any], compiled: bool) -> None:
    torch._dynamo.reset()
    counters.clear()
    llm = LLM(
        str(lora_setup["model_dir"]),
        enable_lora=True,
        enforce_eager=not compiled,
        compile_cache=False,  # traced here, so that Dynamo's counters see every graph
        kv_cache_memory_gib=0.02,
    )
    graphs = counters["stats"]["unique_graphs"]
    first = LoRARequest("first", str(lora_setup["first"]))
    second = LoRARequest("second", str(lora_setup["second"]))
    expected = lora_setup["expected"]
    assert expected["first"] != expected[None] and expected["second"] != expected[None]  # the adapters matter
    assert _greedy(llm, [first]) == [expected["first"]]
    assert _greedy(llm, [second]) == [expected["second"]]
    # one batch: both adapters and the base model, interleaved sequence by sequence
    assert _greedy(llm, [first, None, second]) == [expected["first"], expected[None], expected["second"]]
    assert counters["stats"]["unique_graphs"] == graphs, "loading adapters or mixing them recompiled"


@pytest.mark.parametrize(
    ("method", "compiled"),
    [("ngram", False), ("ngram", True), ("draft_model", False)],
    ids=["eager", "compiled", "draft"],
)
def test_speculative_decoding_with_adapters_matches_peft(
    lora_setup: dict[str, Any], method: str, compiled: bool
) -> None:
    """Drafts verified with each sequence's adapter: a verify step is a many-token forward in
    which every token reads its sequence's slot. Greedy ids stay PEFT's, alone and in a batch
    that mixes two adapters with the base model, and the drafts are accepted (the random model's
    greedy output loops, so prompt lookup finds them; the draft model is the base model, which
    drafts without adapters and agrees with them often)."""
    speculative: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft_model":
        speculative = {"method": "draft_model", "model": str(lora_setup["model_dir"]), "num_speculative_tokens": 3}
    llm = _lora_llm(lora_setup, enforce_eager=not compiled, speculative_config=speculative)
    first = LoRARequest("first", str(lora_setup["first"]))
    second = LoRARequest("second", str(lora_setup["second"]))
    expected = lora_setup["expected"]
    assert _greedy(llm, [first]) == [expected["first"]]
    assert _greedy(llm, [first, None, second]) == [expected["first"], expected[None], expected["second"]]
    assert _greedy(llm, [None]) == [expected[None]]  # the base model drafting for itself
    stats = llm.engine.speculative_stats
    assert stats.accepted_tokens > 0 and stats.draft_tokens > stats.accepted_tokens  # accepted and rejected
    manager = llm.engine.block_manager
    assert manager.num_free_pages == manager.num_pages and not llm.engine.adapters.in_use


@pytest.mark.gpu
def test_adapters_in_cuda_graphs_match_peft_and_eager(lora_setup: dict[str, Any]) -> None:
    """Decode replays CUDA graphs with each row's slot in the graphs' static buffer: the same
    greedy ids as eager on the same device, and as PEFT."""
    options = {"device": "cuda", "dtype": "float32", "attention_backend": "torch", "max_num_seqs": 9}
    graphed = _lora_llm(lora_setup, enforce_eager=False, **options)
    assert graphed.engine.runner.graphs is not None
    eager = _lora_llm(lora_setup, **options)
    first = LoRARequest("first", str(lora_setup["first"]))
    second = LoRARequest("second", str(lora_setup["second"]))
    mixed = [first, None, second]
    assert _greedy(graphed, mixed) == _greedy(eager, mixed)
    expected = lora_setup["expected"]
    assert _greedy(graphed, [second]) == [expected["second"]]


def test_the_prefix_cache_never_shares_pages_between_adapters(lora_setup: dict[str, Any]) -> None:
    llm = _lora_llm(lora_setup)
    prompt = list(range(3, 40))  # two full pages of 16 and five tokens
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = LoRARequest("first", str(lora_setup["first"]))

    def cached(lora: LoRARequest | None) -> int:
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(None) == 0
    assert cached(first) == 0  # the base model's pages are not the adapter's
    assert cached(first) == 36  # but the adapter's own are: all but the last token
    assert cached(None) == 36


def test_at_most_max_loras_adapters_run_at_once_and_slots_are_reused(lora_setup: dict[str, Any]) -> None:
    llm = _lora_llm(lora_setup, max_loras=1, max_cpu_loras=2)
    engine = llm.engine
    first = LoRARequest("first", str(lora_setup["first"]))
    second = LoRARequest("second", str(lora_setup["second"]))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(PROMPTS[0], params, lora_request=lora) for lora in (first, second, None)]
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        running = {s.adapter.name for s in engine.scheduler.running if s.adapter is not None}
        assert len(running) <= 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    expected = lora_setup["expected"]
    assert [finished[i] for i in ids] == [expected["first"][0], expected["second"][0], expected[None][0]]


def test_requests_name_adapters_only_when_the_engine_serves_them(lora_setup: dict[str, Any]) -> None:
    llm = LLM(str(lora_setup["model_dir"]), enforce_eager=True, kv_cache_memory_gib=0.02)
    with pytest.raises(RequestError, match="enable_lora"):
        llm.generate([PROMPTS[0]], use_tqdm=False, lora_request=LoRARequest("first", str(lora_setup["first"])))
    assert not llm.engine.has_unfinished_requests()


def test_runs_join_neighbouring_tokens_on_one_slot_and_skip_the_base_model() -> None:
    assert token_runs([0, 0, 0, 0, -1, 1, 1, 0, 0, 0]) == [(0, 4, 0), (5, 7, 1), (7, 10, 0)]


def _broken(adapter: Path, tmp_path: Path, config: dict[str, Any] | None = None, drop: str | None = None) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(adapter, out)
    if config is not None:
        data = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**data, **config}))
    if drop is not None:
        tensors = load_file(out / "adapter_model.safetensors")
        save_file({k: v for k, v in tensors.items() if drop not in k}, out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
        ({"target_modules": ["q_proj", "c_attn"]}, "unknown module 'c_attn'"),
        ({"bias": "all"}, "bias"),
        ({"r": 8}, "rank 4, but the config gives 8"),
        ({"peft_type": "IA3"}, "IA3"),
    ],
)
def test_the_loader_refuses_what_it_cannot_apply(
    lora_setup: dict[str, Any], tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    config = config_from_model_dir(lora_setup["model_dir"])
    with pytest.raises(LoRAError, match=message):
        load_adapter(_broken(lora_setup["first"], tmp_path, config=change), config, max_rank=16)


def test_the_loader_checks_files_shapes_and_rank(lora_setup: dict[str, Any], tmp_path: Path) -> None:
    config = config_from_model_dir(lora_setup["model_dir"])
    with pytest.raises(LoRAError, match="above --max-lora-rank 2"):
        load_adapter(lora_setup["first"], config, max_rank=2)
    with pytest.raises(LoRAError, match="no such adapter directory"):
        load_adapter(tmp_path / "missing", config, max_rank=16)
    missing_b = _broken(lora_setup["first"], tmp_path, drop="layers.1.mlp.up_proj.lora_B")
    with pytest.raises(LoRAError, match=r"layers\.1\.mlp\.up_proj: lora_A and lora_B must both be present"):
        load_adapter(missing_b, config, max_rank=16)
    pickled = tmp_path / "pickled"
    shutil.copytree(lora_setup["first"], pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(LoRAError, match="pickle files, which are never loaded"):
        load_adapter(pickled, config, max_rank=16)
    other = config_from_model_dir(lora_setup["model_dir"])
    wider = type(other)(**{**{f: getattr(other, f) for f in other.__struct_fields__}, "hidden_size": 128})
    with pytest.raises(LoRAError, match="do not fit"):
        load_adapter(lora_setup["first"], wider, max_rank=16)


def test_a_failed_load_keeps_the_loaded_adapters(lora_setup: dict[str, Any], tmp_path: Path) -> None:
    llm = _lora_llm(lora_setup)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = LoRARequest("first", str(lora_setup["first"]))
    llm.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=first)
    bad = LoRARequest("first", str(_broken(lora_setup["first"], tmp_path, config={"use_dora": True})))
    with pytest.raises(LoRAError, match="DoRA"):
        llm.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=bad)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=first)
    assert out[0].outputs[0].token_ids == lora_setup["expected"]["first"][0]


# -- the server, on the default model ---------------------------------------------------------------

SERVER_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def default_adapters(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("default_adapters")
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = tokenizer(SERVER_PROMPT)["input_ids"]
    adapters = {
        "french": _peft_adapter(default_model_dir, root / "french", seed=3, r=8, lora_alpha=16),
        "second": _peft_adapter(default_model_dir, root / "second", seed=4, target_modules=["q_proj", "o_proj"]),
    }
    expected = {
        name: tokenizer.decode(_peft_greedy(default_model_dir, path, [prompt])[0])
        for name, path in [("base", None), *adapters.items()]
    }
    return {"paths": adapters, "expected": expected}


def test_the_server_serves_adapters_by_model_name_and_loads_and_unloads_them(
    default_adapters: dict[str, Any], tmp_path: Path
) -> None:
    import httpx

    from tests.server_process import running_server

    paths, expected = default_adapters["paths"], default_adapters["expected"]
    assert len({expected["base"], expected["french"], expected["second"]}) == 3
    args = ["--kv-cache-memory-gib", "0.05", "--enable-lora", "--max-loras", "2", "--served-model-name", "base"]
    args += ["--lora-modules", f"french={paths['french']}", "--enable-runtime-lora-updates"]
    with running_server(tmp_path, *args) as server:
        url = server.url

        def complete(model: str) -> httpx.Response:
            body = {"model": model, "prompt": SERVER_PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
            return httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60)

        cards = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("base", None), ("french", "base")]
        assert complete("french").json()["choices"][0]["text"] == expected["french"]
        assert complete("base").json()["choices"][0]["text"] == expected["base"]
        assert complete("second").status_code == 404

        load = f"{url}/v1/load_lora_adapter"
        assert httpx.post(load, json={"lora_name": "second", "lora_path": str(paths["second"])}).status_code == 200
        assert complete("second").json()["choices"][0]["text"] == expected["second"]
        # bad loads: each a 4xx that names the problem, and nothing loaded is lost
        missing = httpx.post(load, json={"lora_name": "third", "lora_path": str(tmp_path / "none")})
        assert missing.status_code == 400 and "no such adapter directory" in missing.json()["error"]["message"]
        assert httpx.post(load, json={"lora_name": "base", "lora_path": str(paths["second"])}).status_code == 400
        assert httpx.post(load, json={"lora_name": "french", "lora_path": str(paths["second"])}).status_code == 400
        assert complete("french").json()["choices"][0]["text"] == expected["french"]

        unload = f"{url}/v1/unload_lora_adapter"
        assert httpx.post(unload, json={"lora_name": "second"}).status_code == 200
        assert complete("second").status_code == 404
        assert httpx.post(unload, json={"lora_name": "second"}).status_code == 404
        # an adapter a running request uses is not unloaded under it
        body = {"model": "french", "prompt": SERVER_PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()  # kept: dropping the iterator would close the stream
            assert stream.status_code == 200, next(lines)
            next(lines)
            busy = httpx.post(unload, json={"lora_name": "french"})
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "adapter_in_use", busy.text
        assert complete("french").json()["choices"][0]["text"] == expected["french"]
        metrics = httpx.get(f"{url}/metrics").text
        assert 'compiled_engine_lora_requests_total{adapter="french"} 3.0' in metrics
        assert 'compiled_engine_lora_requests_total{adapter="second"} 1.0' in metrics
        assert "compiled_engine_lora_adapters_loaded 1.0" in metrics


def test_bench_lora_reports_each_figure_against_the_base_model(
    lora_setup: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from compiled_engine.bench.__main__ import main
    from compiled_engine.lora import manager as lora_manager

    loads: list[str] = []  # the adapter directories read from disk
    load = lora_manager.load_adapter
    monkeypatch.setattr(
        lora_manager, "load_adapter", lambda path, *rest: (loads.append(Path(path).name), load(path, *rest))[1]
    )
    out = tmp_path / "lora.json"
    args = ["lora", "--model", str(lora_setup["model_dir"]), "--enforce-eager", "--kv-cache-memory-gib", "0.02"]
    args += ["--lora-rank", "4", "--num-adapters", "2", "--batch", "3", "--prompt-len", "8", "--output-len", "4"]
    args += ["--rounds", "2"]
    assert main([*args, "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    for key in (
        "base_batch1",
        "adapter_batch1",
        "base_batch_output_tokens_per_s",
        "adapters_batch_output_tokens_per_s",
    ):
        assert results[key] > 0
    rounds = results["per_round"]
    assert len(rounds["ratio_batch1"]) == 2
    for first, second in zip(rounds["adapter_batch1"], rounds["base_batch1"], strict=True):
        assert first / second in rounds["ratio_batch1"]
    assert results["ratio_batch1"] == pytest.approx(sum(rounds["ratio_batch1"]) / 2)  # the median of two
    # the timed load is a real one, and the only one of its adapter: every later request reuses it
    assert results["load_seconds"] > 0 and loads == ["a0", "a1"]


def _slot_tensors(tokens: int = 77) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """x, a and b of 4 slots as the slots hold them: two pieces of rank 6, 30 and 10 rows wide."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 24, generator=generator)
    a = torch.randn(4, 2 * 6, 24, generator=generator)
    b = torch.randn(4, 6, 30 + 10, generator=generator)
    return x, a, b, [30, 10]


# slot 2 in two runs of 36 tokens in all (gathered, at::addmm), slot 3 in one run of 33 (at::addmm
# on a narrow), slot 0 one token and slot 1 three (the few-token loops); two tokens past the
# batch's 77, as a CUDA graph's padding rows are
MIXED_SLOTS = [2, 2, -1, -1, -1, -1, 0] + [2] * 34 + [1, 1, 1] + [3] * 33 + [-1, -1]


def test_the_native_lora_kernel_equals_the_python_kernel() -> None:
    from compiled_engine.linear import lora_op

    assert lora_op.native_lora_kernel()  # the machine has a compiler (as CI's has)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("compiled_engine::lora_delta", "CPU")
    x, a, b, widths = _slot_tensors()
    slots = torch.tensor(MIXED_SLOTS)
    native = torch.ops.compiled_engine.lora_delta(x, a, b, slots, widths)
    reference = reference_lora_delta(x, a, b, slots, widths)
    torch.testing.assert_close(native, reference)
    assert native[2:6].abs().max() == 0 and native[:2].abs().max() > 0
    # each piece's rows take its own rank rows of a only
    torch.testing.assert_close(reference[0, 30:], (x[0] @ a[2, 6:].T) @ b[2, :, 30:])
    none = torch.full((77,), -1)
    assert torch.ops.compiled_engine.lora_delta(x, a, b, none, widths).abs().max() == 0
    with pytest.raises(RuntimeError, match="uses slot 4 of 4"):
        torch.ops.compiled_engine.lora_delta(x, a, b, torch.full((77,), 4), widths)
    with pytest.raises(RuntimeError, match="a slot for each of the 77 tokens"):
        torch.ops.compiled_engine.lora_delta(x, a, b, slots[:10], widths)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_fused_quantized_lora_product_equals_its_reference(fmt: str) -> None:
    """`quantized_lora_linear_f32` (the quantized product and the delta in one native call, what
    a GGUF model's adapters run) against dequantize-then-matmul plus the Python delta, on the
    decode path and on the many-token paths, and through a LoRALinear that picks it."""
    from compiled_engine.linear import lora_op
    from compiled_engine.linear.quantize import quantize
    from compiled_engine.linear.quantized import QuantizedLinear
    from compiled_engine.lora import layers

    assert lora_op.native_lora_kernel()
    x, a, b, widths = _slot_tensors()
    weight = quantize(torch.randn(sum(widths), 64, generator=torch.Generator().manual_seed(2)), fmt, 32)
    x = torch.randn(x.shape[0], 64, generator=torch.Generator().manual_seed(3))
    a = torch.randn(a.shape[0], a.shape[1], 64, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(sum(widths))
    base = QuantizedLinear(weight, bias)
    assert base.native is not None
    slots = torch.tensor(MIXED_SLOTS)
    # the slots sit inside larger stores, as a layer's products' do: other products' values
    # around; the stores are themselves views that start inside their storage
    a_store = torch.cat([torch.randn(9), a.flatten(), torch.randn(5)])[2:]
    b_store = torch.cat([torch.randn(14), b.flatten(), torch.randn(3)])[3:]
    a_view, b_view = lora_op.StoreView(7, tuple(a.shape)), lora_op.StoreView(11, tuple(b.shape))
    product = layers.LoRALinear(base, widths, a_store, a_view, b_store, b_view, slots)
    assert product.fused
    num_slots, rank = b.shape[0], b.shape[1]
    # one token, then a decode-sized batch (the few-token loops), then every path
    for rows in (slice(6, 7), slice(0, 20), slice(0, x.shape[0])):
        args = (
            x[rows],
            base.data,
            base.scales,
            base.offsets,
            base.bias,
            base.group_size,
            32,
            64,
            a_store,
            b_store,
            slots[rows],
            7,
            11,
            num_slots,
            rank,
            widths,
        )
        native = torch.ops.compiled_engine.quantized_lora_linear_f32(*args)
        reference = lora_op.reference_quantized_lora_linear(*args)
        torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(product(x), native)  # the module reads the slots from its buffer
    assert (native - base(x)).abs().max() > 1  # the delta is there
    delta = lora_op.reference_lora_delta(x, a, b, slots, widths)  # the twin reads the same slots
    torch.testing.assert_close(lora_op.reference_quantized_lora_linear(*args), base(x) + delta, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="do not fit the stores"):
        torch.ops.compiled_engine.quantized_lora_linear_f32(*args[:11], 13, 11, num_slots, rank, widths)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_decode_sized_fused_product_shares_one_parallel_region_and_equals_its_reference(
    fmt: str, threads: int
) -> None:
    """Up to 32 tokens, `quantized_lora_linear_f32` runs the product's strips and the slots' rank
    rows in one parallel region (each thread a partial output, added after one barrier). Rank 10
    splits into runs of four rows and single rows on every thread count here; three pieces whose
    borders fall inside the product's 16-row strips; tokens on several slots, on none, and all on
    the base model."""
    from compiled_engine.linear import lora_op
    from compiled_engine.linear.quantize import quantize
    from compiled_engine.linear.quantized import QuantizedLinear

    assert lora_op.native_lora_kernel()
    generator = torch.Generator().manual_seed(5)
    widths, rank, num_slots, in_features = [40, 9, 23], 10, 3, 96
    base = QuantizedLinear(quantize(torch.randn(sum(widths), in_features, generator=generator), fmt, 32), None)
    a = torch.randn(num_slots * len(widths) * rank * in_features, generator=generator)
    b = torch.randn(num_slots * rank * sum(widths), generator=generator)
    x = torch.randn(32, in_features, generator=generator)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for slots in ([1], [-1], [2, 0, -1, 2, 1, 1, -1, 0] * 4, [-1] * 5, [0] * 32):
            token_slots = torch.tensor([*slots, 2, 2])  # a graph's padding rows past the batch
            args = (x[: len(slots)], base.data, base.scales, base.offsets, None, 32, 32, 64, a, b, token_slots, 0, 0)
            args += (num_slots, rank, widths)
            native = torch.ops.compiled_engine.quantized_lora_linear_f32(*args)
            reference = lora_op.reference_quantized_lora_linear(*args)
            torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-4)
            on_slots = torch.tensor(slots) >= 0
            if on_slots.any():  # the delta is there, on the adapters' tokens only
                plain = base(x[: len(slots)])
                assert (native - plain)[on_slots].abs().min(dim=1).values.min() > 0
                torch.testing.assert_close(native[~on_slots], plain[~on_slots], rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("in_features", [80, 83])
def test_the_native_few_token_loops_equal_the_python_kernel(in_features: int) -> None:
    """Decode-sized calls at widths that take every branch of the vector loops: whole blocks of
    32 and 8 inputs and a scalar tail (83), 16-column blocks and tails, and the threads' split of
    the columns falling inside a piece."""
    from compiled_engine.linear import lora_op

    assert lora_op.native_lora_kernel()
    generator = torch.Generator().manual_seed(1)
    widths = [40, 19, 8]
    x = torch.randn(5, in_features, generator=generator)
    a = torch.randn(3, 3 * 4, in_features, generator=generator)
    b = torch.randn(3, 4, sum(widths), generator=generator)
    slots = torch.tensor([1, -1, 0, 1, 2])
    native = torch.ops.compiled_engine.lora_delta(x, a, b, slots, widths)
    torch.testing.assert_close(native, reference_lora_delta(x, a, b, slots, widths))
    assert native[1].abs().max() == 0 and native[0].abs().min() > 0


def test_the_graph_kernel_equals_the_python_kernel() -> None:
    """`dense_lora_delta` (CUDA's kernel: no host work, so graphs capture it) against the
    reference, on the CPU."""
    x, a, b, widths = _slot_tensors()
    slots = torch.tensor(MIXED_SLOTS)
    dense = dense_lora_delta(x, a, b, slots, widths)
    torch.testing.assert_close(dense, reference_lora_delta(x, a, b, slots, widths))
    assert dense[2:6].abs().max() == 0


def test_an_adapter_named_by_hub_id_resolves_through_huggingface_hub(
    lora_setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    config = config_from_model_dir(lora_setup["model_dir"])
    asked: list[str] = []

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        asked.append(repo_id)
        if repo_id == "someone/french-lora":
            return str(lora_setup["first"])
        raise LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    adapter = load_adapter("someone/french-lora", config, max_rank=16)
    local = load_adapter(lora_setup["first"], config, max_rank=16)
    assert adapter.path == Path("someone/french-lora") and adapter.digest == local.digest
    with pytest.raises(LoRAError, match="not in the local Hugging Face cache"):
        load_adapter("someone/absent", config, max_rank=16)
    with pytest.raises(LoRAError, match="nor a Hub id"):
        load_adapter("/no/such/dir", config, max_rank=16)
    assert asked == ["someone/french-lora", "someone/absent"]


def test_adapter_churn_under_load_leaks_no_pages_and_no_uses(
    lora_setup: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests on three adapters through two slots. One adapter is unloaded while other requests
    run (refused while its own requests are unfinished), then loaded again from another directory:
    every page comes back, every use is released, and each request's tokens are its adapter's."""
    from compiled_engine.lora import manager as lora_manager

    loads: list[Path] = []  # every adapter directory read from disk, in order
    load = lora_manager.load_adapter
    monkeypatch.setattr(
        lora_manager, "load_adapter", lambda path, *rest: (loads.append(Path(path)), load(path, *rest))[1]
    )
    llm = _lora_llm(lora_setup, max_loras=2, max_cpu_loras=3, max_num_seqs=4)
    engine = llm.engine
    manager = engine.adapters
    assert manager is not None
    copies = [tmp_path / "first-again", tmp_path / "first-once-more"]  # the same weights as "first"
    for copy in copies:
        shutil.copytree(lora_setup["first"], copy)
    first, second = LoRARequest("first", str(lora_setup["first"])), LoRARequest("second", str(lora_setup["second"]))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = lora_setup["expected"]
    want = {"first": expected["first"], "second": expected["second"], "third": expected["first"], None: expected[None]}
    submitted: dict[str, tuple[str | None, int]] = {}
    finished: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids

    for round_ in range(3):
        third = LoRARequest("third", str(copies[0] if round_ < 2 else copies[1]))
        for i, lora in enumerate([first, second, third, None] * 2):
            prompt = i % len(PROMPTS)
            request_id = engine.add_request(PROMPTS[prompt], params, lora_request=lora)
            submitted[request_id] = (lora.name if lora else None, prompt)
        if round_ != 1:
            for _ in range(4):
                step()
            continue
        # longer than the others, so that it still runs when "third" is unloaded
        longer = SamplingParams(temperature=0, max_tokens=3 * NEW_TOKENS, ignore_eos=True)
        keeper = engine.add_request(PROMPTS[0], longer, lora_request=first)
        with pytest.raises(LoRAError, match="'third' is in use"):
            manager.remove("third")
        while manager.in_use.get("third"):
            step()
        assert keeper not in finished and manager.in_use == {"first": 1}  # the others still run
        manager.remove("third")
        assert "third" not in manager.adapters
    while engine.has_unfinished_requests():
        step()
    assert [path for path in loads if path in copies] == copies  # "third" was read again, from the other copy
    assert manager.adapters["third"].path == copies[1]
    assert manager.in_use == {}
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
    for request_id, (name, prompt) in submitted.items():
        assert finished[request_id] == want[name][prompt], (name, prompt)
    assert finished[keeper][:NEW_TOKENS] == expected["first"][0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel_size": 2}, "LoRA adapters with tensor parallelism are not supported yet"),
        ({"max_loras": 3, "max_cpu_loras": 2}, r"max_cpu_loras \(2\) must be at least max_loras \(3\)"),
    ],
)
def test_options_lora_cannot_run_with_are_refused_before_any_work(
    tiny_model_factory: Callable[..., Path], options: dict[str, Any], message: str
) -> None:
    """Refused while the features are planned: no process started, no weight read."""
    from compiled_engine.engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(tiny_model_factory("llama")), enable_lora=True, enforce_eager=True, **options)
    with pytest.raises(ValueError, match=message):
        LLMEngine(config)
