"""llama.cpp's own server as a same-run serving baseline (`bench serve --baseline llama-server`):
`llama-server` on the very GGUF file the engine serves, with the same thread count, one slot per
request in flight, driven by the same load as ours once ours has stopped.

The binary is `--llama-server PATH`, else `$LLAMA_SERVER`, else `llama-server` on the PATH;
`perf/build_llama_server.sh` builds it from the llama-cpp-python source distribution (the
llama.cpp it vendors), about seven minutes on two cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from compiled_engine.bench.baseline_server import free_port, wait_until_healthy
from compiled_engine.bench.hf_baseline import BaselineUnavailable

BUILD_HINT = "build it with perf/build_llama_server.sh, or name it with --llama-server PATH or $LLAMA_SERVER"


def find_llama_server(explicit: str | None = None) -> Path:
    """The llama-server binary to run: the one named, else $LLAMA_SERVER, else the PATH's."""
    named = explicit or os.environ.get("LLAMA_SERVER")
    if named:
        path = Path(named).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BaselineUnavailable(f"llama-server {path} is not an executable file")
        return path
    found = shutil.which("llama-server")
    if found is None:
        raise BaselineUnavailable(f"no llama-server binary was found: {BUILD_HINT}")
    return Path(found)


def llama_server_command(
    binary: Path, gguf: Path, port: int, threads: int, parallel: int, context_per_slot: int
) -> list[str]:
    """The command line: `parallel` slots of `context_per_slot` tokens each (llama-server splits
    `-c` evenly among its slots), continuous batching and its prompt cache on (its defaults)."""
    return [
        str(binary),
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--parallel",
        str(parallel),
        "--ctx-size",
        str(parallel * context_per_slot),
    ]


@contextmanager
def llama_server(
    binary: Path,
    gguf: Path | None,
    threads: int,
    parallel: int,
    context_per_slot: int,
    start_timeout_s: float = 300.0,
) -> Iterator[str]:
    """llama-server running on `gguf`; yields its base URL once `/health` answers 200, and stops
    it on exit. A server that exits or never gets healthy raises BaselineUnavailable with the end
    of its log."""
    if gguf is None:
        raise BaselineUnavailable(
            "the llama-server baseline needs a GGUF model (the default model, or --model file.gguf)"
        )
    port = free_port()
    command = llama_server_command(binary, gguf, port, threads, parallel, context_per_slot)
    with tempfile.TemporaryDirectory(prefix="llama-server-") as folder:
        log = Path(folder) / "server.log"
        with log.open("wb") as sink:
            try:
                process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            except OSError as exc:
                raise BaselineUnavailable(f"llama-server {binary} could not be started: {exc}") from exc
        try:
            base_url = f"http://127.0.0.1:{port}"
            wait_until_healthy(process, base_url, log, "llama-server", start_timeout_s)
            yield base_url
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
