"""The command line: generate prints the answer and its timings, verify reports MATCH or the
first divergence, and bad input exits with a clear error instead of a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from compiled_engine.cli import main
from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import GenerationResult, StepLogits
from compiled_engine.engine.sequence import FinishReason
from compiled_engine.prompts import PromptSpec
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.verify import report_divergence
from reference_oracle import GoldenResult

SMALL_KV = ["--kv-cache-memory-gib", "0.05"]


def test_generate_chat_answers_paris(capsys: pytest.CaptureFixture[str], default_model_dir: Path) -> None:
    code = main(["generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "24", *SMALL_KV])
    out, err = capsys.readouterr()
    assert code == 0
    assert "Paris" in out
    for key in (
        "model_load_ms=",
        "prefill_ms=",
        "ttft_ms=",
        "mean_tpot_ms=",
        "decode_tokens_per_s=",
        "device=cpu",
        "dtype=float32",
    ):
        assert key in err


def test_generate_plain_prompt_respects_max_tokens(capsys: pytest.CaptureFixture[str], default_model_dir: Path) -> None:
    code = main(["generate", "--prompt", "The three primary colors are", "--max-tokens", "5", *SMALL_KV])
    _, err = capsys.readouterr()
    assert code == 0
    assert "output_tokens=5" in err and "finish_reason=length" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/no/such/dir"], "neither a local directory nor a Hub id"),
        (["--max-tokens", "0"], "max_tokens must be at least 1"),
        (["--max-model-len", "8", "--max-tokens", "4"], "exceeds the context length 8"),
        (["--max-model-len", "100000"], "exceeds the model's max_position_embeddings"),
        (["--device", "cuda"], "no CUDA device"),
    ],
)
def test_generate_bad_input_exits_with_clear_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], default_model_dir: Path
) -> None:
    code = main(["generate", "--prompt", "Hello there, how are you?", *SMALL_KV, *argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.startswith("error: ") and message in err


def test_verify_prints_match(tmp_path: Path, capsys: pytest.CaptureFixture[str], default_model_dir: Path) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text('[{"text": "What is 2 + 2?", "chat": true}, "Les couleurs primaires sont"]')
    code = main(["verify", "--prompts", str(prompts), "--max-tokens", "8", *SMALL_KV])
    out, _ = capsys.readouterr()
    assert code == 0
    assert out.startswith("MATCH: 2 prompts")


def test_verify_missing_prompts_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "--prompts", str(tmp_path / "missing.txt")])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_divergence_report_names_step_tokens_and_top5(default_model_dir: Path) -> None:
    tokenizer = Tokenizer(default_model_dir)
    ours = GenerationResult(
        [1, 2],
        [100, 200, 300],
        FinishReason.LENGTH,
        top_logits=[StepLogits([100, 5, 6, 7, 8], [9.0, 8.0, 7.0, 6.0, 5.0])] * 2
        + [StepLogits([300, 301, 302, 303, 304], [3.5, 3.4, 3.0, 2.0, 1.0])],
    )
    golden = GoldenResult(
        [1, 2],
        [100, 200, 301],
        prefill_logits=None,  # type: ignore[arg-type]
        top_token_ids=[[100], [200], [301, 300, 302, 303, 304]],
        top_values=[[9.0], [8.0], [3.45, 3.44, 3.0, 2.0, 1.0]],
    )
    report = report_divergence(tokenizer, 3, PromptSpec("hi", chat=True), ours, golden)
    assert report is not None
    assert "prompt 3 (chat)" in report
    assert "step 2: ours 300" in report and "oracle 301" in report
    assert "our top-5:    300" in report and "oracle top-5: 301" in report
    ours.token_ids = [100, 200, 301]
    assert report_divergence(tokenizer, 3, PromptSpec("hi"), ours, golden) is None
    ours.token_ids = [100, 200]
    stopped = report_divergence(tokenizer, 3, PromptSpec("hi"), ours, golden)
    assert stopped is not None and "ours (stopped)" in stopped


def test_generate_sampling_flags_are_seeded(capsys: pytest.CaptureFixture[str], default_model_dir: Path) -> None:
    argv = [
        "generate",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "8",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        *SMALL_KV,
    ]
    texts = []
    for seed in ("3", "3", "4"):
        assert main([*argv, "--seed", seed]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]
    assert main([*argv, "--temperature", "-1"]) == 2
    assert "temperature must be finite and >= 0" in capsys.readouterr().err


def test_engine_options_reach_verify_and_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command builds its EngineConfig from the one declaration (engine_options.py):
    flags reach the config, absent ones keep EngineConfig's defaults (--enforce-eager absent is
    None, so $COMPILED_ENGINE_ENFORCE_EAGER still decides)."""
    import compiled_engine.server.launch as launch
    import compiled_engine.verify as verify_module

    configs: list[EngineConfig] = []

    def record(config: EngineConfig, *rest: object) -> int:
        configs.append(config)
        return 0

    monkeypatch.setattr(verify_module, "verify", record)
    monkeypatch.setattr(launch, "run_server", record)
    assert main(["verify"]) == 0
    assert configs.pop() == EngineConfig()
    flags = [
        "--enforce-eager",
        "--no-cuda-graphs",
        "--no-prefix-caching",
        "--seed",
        "5",
        "--max-num-seqs",
        "3",
        "--page-size",
        "8",
    ]
    assert main(["serve", *flags]) == 0
    assert configs.pop() == EngineConfig(
        enforce_eager=True, cuda_graphs=False, enable_prefix_caching=False, seed=5, max_num_seqs=3, page_size=8
    )
    assert main(["verify", "--max-num-seqs", "0"]) == 2  # EngineConfig's own check, as a clear error
