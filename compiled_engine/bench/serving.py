"""Online serving load: streamed `/v1/completions` requests against any OpenAI-compatible URL,
either a fixed number in flight (closed loop) or arriving as a Poisson process (open loop).

Each request sends token ids with `ignore_eos`, so every server generates exactly the asked
number of tokens and the figures compare like with like. Times are taken on the client: TTFT
is the first streamed chunk, ITL the gaps between streamed chunks (a token that adds no text,
such as half a UTF-8 character, arrives with the next chunk), TPOT the decode time per token
after the first, E2E the whole request.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from compiled_engine.bench.workload import Workload

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    prompt_tokens: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def served_model_name(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def stream_completion(
    client: httpx.AsyncClient, base_url: str, model: str, prompt: list[int], max_tokens: int
) -> RequestRecord:
    record = RequestRecord(prompt_tokens=len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = str(event["error"])
                    return record
                if event.get("usage"):
                    record.output_tokens = int(event["usage"]["completion_tokens"])
                if event.get("choices"):  # a token (or several) arrived; the usage chunk has none
                    now = time.perf_counter()
                    if chunks == 0:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e_s = time.perf_counter() - start
    if record.output_tokens == 0:
        record.output_tokens = chunks  # a server without usage in the stream: one token per chunk
    record.ok = record.ttft_s is not None
    if not record.ok:
        record.error = "the stream ended without a token"
    return record


async def run_load(
    base_url: str,
    workload: Workload,
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    api_key: str | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    timeout_s: float = 600.0,
) -> tuple[list[RequestRecord], float]:
    """Every request of `workload`, at most `concurrency` in flight, or started at Poisson times
    of `request_rate` per second (both may be given: arrivals capped by concurrency). Returns the
    records in workload order and the wall time."""
    if concurrency is None and request_rate is None:
        raise ValueError("give a concurrency or a request rate")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)
    async with httpx.AsyncClient(headers=headers, timeout=timeout_s, limits=limits) as client:
        model = await served_model_name(client, base_url)

        async def one(prompt: list[int], max_tokens: int) -> RequestRecord:
            if gate is None:
                record = await stream_completion(client, base_url, model, prompt, max_tokens)
            else:
                async with gate:
                    record = await stream_completion(client, base_url, model, prompt, max_tokens)
            if on_done is not None:
                on_done(record)
            return record

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in zip(workload.prompts, workload.output_lens, strict=True):
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
            if request_rate is not None and request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        records = list(await asyncio.gather(*tasks))
        return records, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    out = {"mean": statistics.fmean(ordered)}
    for p in PERCENTILES:
        # nearest-rank percentile: the smallest value with at least p% of values at or below it
        rank = max(1, -(-p * len(ordered) // 100))
        out[f"p{p}"] = ordered[rank - 1]
    return out


def summarize(records: list[RequestRecord], seconds: float) -> dict[str, Any]:
    """Latency percentiles (seconds) and throughput of one load run."""
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    errors = [r.error for r in records if not r.ok and r.error]
    return {
        "seconds": seconds,
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_examples": sorted(set(errors))[:3],
        "request_throughput": len(ok) / seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / seconds,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([gap for r in ok for gap in r.itl_s]),
        "tpot_s": percentiles([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "samples": {
            "ttft_s": [r.ttft_s for r in ok],
            "e2e_s": [r.e2e_s for r in ok],
        },
    }
