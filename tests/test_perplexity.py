"""Sliding-window perplexity through the engine's runner, against transformers' own loss on the
same windows of the shipped text; the scored-token bookkeeping; the refusals; the bench command."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from compiled_engine.bench import __main__ as bench
from compiled_engine.bench.perplexity import TEXT_PATH, perplexity, windows
from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.weights.default_model import GGUF_NAME, default_model_dir, manifest_problem

NUM_TOKENS = 300
MAX_MODEL_LEN = 512
CHUNK = 100  # max_num_batched_tokens: windows longer than this run as several prefill chunks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's fp32 safetensors checkpoint alone (its files linked, the GGUF left out)."""
    source = default_model_dir()
    problem = manifest_problem(source, check_hashes=False) if source.is_dir() else "missing"
    if problem is not None:
        pytest.skip(f"the default model is not prepared ({problem})")
    target = tmp_path_factory.mktemp("dense-model")
    for path in source.iterdir():
        if path.name != GGUF_NAME:
            (target / path.name).symlink_to(path)
    return target


@pytest.fixture(scope="module")
def token_ids(model_dir: Path) -> list[int]:
    ids = Tokenizer(model_dir).encode(TEXT_PATH.read_text(encoding="utf-8"))
    return ids[:NUM_TOKENS]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[LLMEngine]:
    config = EngineConfig(
        model=str(model_dir),
        quantization="none",
        enforce_eager=True,
        device="cpu",
        dtype="float32",
        kv_cache_memory_gib=0.05,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=CHUNK,
    )
    engine = LLMEngine(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    model: torch.nn.Module = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def _hf_perplexity(model: torch.nn.Module, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """The Hugging Face perplexity guide's loop: labels -100 outside each window's new tokens,
    the model's own shifted cross-entropy."""
    nll_sum, scored, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        trg_len = end - prev_end
        input_ids = torch.tensor([ids[begin:end]])
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        loss = model(input_ids, labels=target_ids).loss
        num_loss_tokens = int((target_ids[:, 1:] != -100).sum())
        if num_loss_tokens:
            nll_sum += float(loss) * num_loss_tokens
            scored += num_loss_tokens
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / scored), scored


@pytest.mark.slow
@pytest.mark.parametrize(
    ("window", "stride"),
    [(128, 64), pytest.param(100, 100, marks=pytest.mark.full), pytest.param(256, 50, marks=pytest.mark.full)],
)
def test_matches_transformers_on_the_same_windows(
    engine: LLMEngine, hf_model: torch.nn.Module, token_ids: list[int], window: int, stride: int
) -> None:
    ours = perplexity(engine, token_ids, window, stride)
    theirs, scored = _hf_perplexity(hf_model, token_ids, window, stride)
    assert ours.tokens_scored == scored
    assert ours.perplexity == pytest.approx(theirs, rel=1e-3)
    assert ours.perplexity == pytest.approx(math.exp(ours.mean_nll))
    assert 1 < ours.perplexity < 1000  # a language model on English prose
    manager = engine.block_manager
    assert manager.num_free_pages == manager.num_pages  # every window's pages went back


@pytest.mark.slow
def test_overlap_changes_the_value_and_the_count(engine: LLMEngine, token_ids: list[int]) -> None:
    apart = perplexity(engine, token_ids, 64, 64)  # windows side by side: each one's first token has no context
    overlapping = perplexity(engine, token_ids, 64, 16)
    assert math.isfinite(apart.perplexity) and math.isfinite(overlapping.perplexity)
    assert apart.perplexity != pytest.approx(overlapping.perplexity, rel=1e-3)
    assert (apart.windows, apart.tokens_scored) == (5, NUM_TOKENS - 5)  # ceil(300 / 64) windows
    # Starts 0, 16, ..., 240: the one at 240 reaches the end.
    assert (overlapping.windows, overlapping.tokens_scored) == (16, NUM_TOKENS - 1)
    single = perplexity(engine, token_ids[:50], 64, 32)  # shorter than one window
    assert (single.windows, single.tokens_scored) == (1, 49)


def test_windows_score_every_token_once() -> None:
    for num_tokens in (2, 3, 64, 65, 300, 301):
        for window, stride in ((2, 1), (2, 2), (64, 1), (64, 17), (64, 64), (400, 400)):
            spans = windows(num_tokens, window, stride)
            scored = [t for _, first, end in spans for t in range(first, end)]
            starts_at_window_begin = any(first == begin for begin, first, _ in spans)
            assert not starts_at_window_begin  # every scored token has context in its window
            assert all(end - begin <= window for begin, _, end in spans)
            expected = [t for t in range(1, num_tokens) if stride < window or t % window]
            assert scored == expected


@pytest.mark.slow
@pytest.mark.parametrize(
    ("window", "stride", "ids", "message"),
    [
        (1, 1, None, "window must be at least 2"),
        (64, 0, None, "stride must be between 1 and the window"),
        (64, 65, None, "stride must be between 1 and the window"),
        (64, 32, [5], "at least 2 tokens"),
        (MAX_MODEL_LEN + 1, 32, None, "exceeds the engine's max_model_len of 512"),
        (64, 32, [5, 10**9], "outside the model's vocabulary"),
    ],
)
def test_bad_arguments_are_refused(
    engine: LLMEngine, token_ids: list[int], window: int, stride: int, ids: list[int] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        perplexity(engine, token_ids if ids is None else ids, window, stride)


@pytest.mark.slow
def test_the_bench_command_reports_each_format(
    engine: LLMEngine, model_dir: Path, token_ids: list[int], tmp_path: Path
) -> None:
    out = tmp_path / "perplexity.json"
    argv = [
        "perplexity", "--formats", "none", "--enforce-eager", "--device", "cpu", "--kv-cache-memory-gib", "0.05",
        "--model", str(model_dir), "--max-tokens", "80", "--window", "48", "--stride", "16", "--json", str(out),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    [row] = report["results"]
    assert (row["format"], row["quantization"], row["ratio"], row["within_tolerance"]) == ("none", "none", 1.0, True)
    assert report["workload"]["tokens"] == 80
    direct = perplexity(engine, token_ids[:80], 48, 16)
    assert row["tokens_scored"] == direct.tokens_scored == 79
    assert row["perplexity"] == pytest.approx(direct.perplexity, rel=1e-5)
    assert report["environment"]["dtype"] == "float32"


def test_the_bench_command_refuses_bad_formats_and_windows(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench._parser().parse_args(["perplexity", "--formats", "none,fp8"])
    with pytest.raises(SystemExit):
        bench._parser().parse_args(["perplexity", "--formats", "none,none"])
    assert bench.main(["perplexity", "--window", "64", "--stride", "128"]) == 2
    assert "stride must be between 1 and the window" in capsys.readouterr().err


def test_the_text_ships_without_a_license_header() -> None:
    text = TEXT_PATH.read_text(encoding="utf-8")
    assert 80_000 <= len(text.encode()) <= 110_000
    assert text.lstrip().startswith("ALICE'S ADVENTURES IN WONDERLAND")
    assert "gutenberg" not in text.lower()
