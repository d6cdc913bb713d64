"""Resident memory of `serve` for the default model, against the weight and KV bytes it reports.

    python perf/serve_memory.py [-- extra serve arguments, e.g. --quantization none]

Starts `python -m compiled_engine serve` on a free port, sends one and then eight concurrent
64-token completions, and prints the server's resident and peak resident memory (from
/proc/PID/status, Linux only) beside `compiled_engine_weight_bytes` and
`compiled_engine_kv_cache_bytes` from its /metrics, and how many packed weights kept a dense
copy beside them (the warning the server logs).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MIB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"/metrics has no {name}")


def complete(url: str) -> None:
    body = {"prompt": "The lighthouse keeper wrote", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("serve_args", nargs="*", help="more arguments for `serve` (after --)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args()
    port = free_port()
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        command = [sys.executable, "-m", "compiled_engine", "serve", "--port", str(port), *args.serve_args]
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + args.startup_timeout
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"serve exited with {process.returncode}:\n{Path(log.name).read_text()}")
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("serve did not become ready")
                time.sleep(0.5)
            complete(url)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda _: complete(url), range(8)))
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            resident, peak = status_kib(process.pid, "VmRSS") * 1024, status_kib(process.pid, "VmHWM") * 1024
        finally:
            process.terminate()
            process.wait(timeout=60)
        logged = Path(log.name).read_text()
    weights, kv = metric(metrics, "compiled_engine_weight_bytes"), metric(metrics, "compiled_engine_kv_cache_bytes")
    two_copies = logged.count("keeps its dense copy beside it") + logged.count("keep a dense copy beside them")
    print(
        f"serve {' '.join(args.serve_args) or '(default)'}: resident {resident / MIB:.0f} MiB, "
        f"peak {peak / MIB:.0f} MiB; weights {weights / MIB:.0f} MiB + KV {kv / MIB:.0f} MiB; "
        f"over them {(resident - weights - kv) / MIB:.0f} MiB; two-copy warnings logged: {two_copies}"
    )


if __name__ == "__main__":
    main()
