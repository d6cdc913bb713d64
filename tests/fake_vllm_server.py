#!/usr/bin/env python3
"""A stand-in for vLLM's OpenAI API-server module in the serving bench's tests (vLLM is not
installed in CI): it takes the command line the bench gives vLLM, starts a child process as
vLLM's engine core does, answers `/health` with 503 while it "loads" and then 200, lists the
served model name, refuses a completion that names another model (404, as vLLM does) and
streams the rest as tests/fake_llama_server.py does. It appends its command line, its own and
its child's pid and the environment variables vLLM reads, one JSON line, to the file named by
$FAKE_LLAMA_SERVER_LOG, and every request body after it. With $FAKE_VLLM_FAIL set it prints that
text and exits with status 1 instead, as a server that cannot start does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from http.server import ThreadingHTTPServer

from fake_llama_server import Handler, record  # beside this file, on the path of a script run

SERVED_ENV = ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "PYTHONPATH")


class VllmHandler(Handler):
    served_name = ""

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.served_name, "object": "model"}]})
        else:
            super().do_GET()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("model") != self.served_name:
            self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
            return
        record({"request": body})
        self.stream(body)


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--served-model-name", "--host", "--port", "--dtype", "--max-model-len", "--max-num-seqs"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    engine_core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    env = {name: os.environ.get(name) for name in SERVED_ENV}
    record({"argv": sys.argv[1:], "pid": os.getpid(), "child_pid": engine_core.pid, "env": env})
    failure = os.environ.get("FAKE_VLLM_FAIL")
    if failure:
        engine_core.kill()
        print(failure, flush=True)
        sys.exit(1)
    VllmHandler.served_name = args.served_model_name
    ThreadingHTTPServer((args.host, int(args.port)), VllmHandler).serve_forever()


if __name__ == "__main__":
    main()
