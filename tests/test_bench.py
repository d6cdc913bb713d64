"""Tiny runs of each bench subcommand: our figures, the same-run baseline, the JSON schema."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from compiled_engine.bench import __main__ as bench
from compiled_engine.bench.hf_baseline import BaselineUnavailable

ENV_KEYS = {"git_commit", "python", "torch", "transformers", "device", "dtype", "cpu_model", "cpu_threads", "model_config_hash"}


def _run(argv: list[str], tmp_path: Path) -> dict[str, object]:
    out = tmp_path / "result.json"
    assert bench.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["environment"]) >= ENV_KEYS
    assert report["bandwidth_ceiling_bytes_per_s"] > 1e8
    return report


def test_latency_with_hf_baseline(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    model = str(tiny_model_factory("llama"))
    report = _run(["latency", "--model", model, "--prompt-len", "24", "--output-len", "6", "--repeats", "1", "--baseline", "hf", "--kv-cache-memory-gib", "0.01"], tmp_path)
    results = report["results"]
    assert isinstance(results, dict)
    ours, hf = results["ours"], results["hf"]
    for key in ("ttft_s", "prefill_tokens_per_s", "decode_ms_per_token", "decode_tokens_per_s", "effective_bandwidth_bytes_per_s", "bandwidth_fraction"):
        assert ours[key] > 0
    assert hf["decode_tokens_per_s"] > 0 and hf["prefill_tokens_per_s"] > 0
    assert results["ratio_vs_hf"]["decode_tokens_per_s"] == pytest.approx(ours["decode_tokens_per_s"] / hf["decode_tokens_per_s"])
    assert report["workload"] == {"prompt_len": 24, "output_len": 6, "repeats": 1, "seed": 0}


def test_offline_with_hf_baseline(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    model = str(tiny_model_factory("llama"))
    report = _run(["offline", "--model", model, "--num-seqs", "5", "--input-len", "4", "20", "--output-len", "2", "9", "--baseline", "hf", "--hf-batch-size", "2", "--kv-cache-memory-gib", "0.01"], tmp_path)
    results = report["results"]
    assert isinstance(results, dict)
    workload = report["workload"]
    assert isinstance(workload, dict) and workload["num_seqs"] == 5
    assert 10 <= workload["output_tokens"] <= 45
    ours = results["ours"]
    assert ours["output_tokens_per_s"] > 0 and ours["steps"] >= 9 and ours["bytes_read"] > 0
    assert results["hf"]["output_tokens_per_s"] > 0 and "output_tokens_per_s" in results["ratio_vs_hf"]


def test_a_baseline_that_cannot_run_says_why(tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(*args: object) -> None:
        raise BaselineUnavailable("transformers is not installed")

    monkeypatch.setattr(bench, "load_hf", unavailable)
    report = _run(["offline", "--model", str(tiny_model_factory("llama")), "--num-seqs", "2", "--input-len", "4", "8", "--output-len", "2", "3", "--baseline", "hf", "--kv-cache-memory-gib", "0.01"], tmp_path)
    results = report["results"]
    assert isinstance(results, dict)
    assert results["hf"] == {"error": "transformers is not installed"}
    assert results["ours"]["output_tokens_per_s"] > 0 and "ratio_vs_hf" not in results


def test_bad_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["latency", "--model", str(tmp_path / "missing")]) == 2
    assert "neither a local directory nor a Hub id" in capsys.readouterr().err
