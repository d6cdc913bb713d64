#!/usr/bin/env python3
"""A stand-in for llama.cpp's `llama-server` binary in the serving bench's tests (the real one is
not built in CI): it takes llama-server's command line, answers `/health` with 503 while it
"loads" and then 200, lists one model, and streams `/v1/completions` as llama-server does, one
token per chunk and a usage chunk. It appends its command line and every request body, one JSON
line each, to the file named by $FAKE_LLAMA_SERVER_LOG. With $FAKE_LLAMA_SERVER_FAIL set it
prints that text and exits with status 1 instead, as a server that cannot load its model does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LOADING_S = 0.5


def record(entry: dict[str, Any]) -> None:
    with open(os.environ["FAKE_LLAMA_SERVER_LOG"], "a") as log:
        log.write(json.dumps(entry) + "\n")


class Handler(BaseHTTPRequestHandler):
    started = time.monotonic()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            loading = time.monotonic() - self.started < LOADING_S
            self._json(503 if loading else 200, {"status": "loading model" if loading else "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake.gguf", "object": "model"}]})
        else:
            self._json(404, {"error": {"code": 404, "message": "File Not Found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        record({"request": body})
        self.stream(body)

    def stream(self, body: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"text": "x", "index": 0, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.001)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--host", "--port", "--threads", "--threads-batch", "--parallel", "--ctx-size"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    record({"argv": sys.argv[1:], "pid": os.getpid()})
    failure = os.environ.get("FAKE_LLAMA_SERVER_FAIL")
    if failure:
        print(failure, flush=True)
        sys.exit(1)
    ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()


if __name__ == "__main__":
    main()
