"""Prometheus metrics for `GET /metrics`, in a registry of the server's own."""

from __future__ import annotations

from collections.abc import Iterator

from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from compiled_engine.engine.async_engine import AsyncEngine
from compiled_engine.engine.drafting import DraftStats
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sequence import FinishReason
from compiled_engine.server.vllm_metrics import VllmMetrics, finish_reasons

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
KNOWN_PATHS = ("/health", "/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


class _EngineCollector(Collector):
    """The engine's gauges at scrape time, from the snapshot its loop published last (`stats()`)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.engine.stats()
        yield GaugeMetricFamily(
            "compiled_engine_running_requests", "Sequences running in the engine", stats.running_requests
        )
        yield GaugeMetricFamily(
            "compiled_engine_waiting_requests", "Requests waiting to be scheduled", stats.waiting_requests
        )
        yield GaugeMetricFamily(
            "compiled_engine_kv_pages_used",
            "KV cache pages referenced by sequences",
            stats.kv_pages_total - stats.kv_pages_free,
        )
        yield GaugeMetricFamily(
            "compiled_engine_kv_pages_free", "KV cache pages free or evictable", stats.kv_pages_free
        )
        yield GaugeMetricFamily(
            "compiled_engine_weight_bytes",
            "Weight memory: the models' tensors, each held once (packed on the compiled CPU path)",
            stats.weight_bytes,
        )
        yield GaugeMetricFamily("compiled_engine_kv_cache_bytes", "KV page pool memory", stats.kv_cache_bytes)
        yield CounterMetricFamily(
            "compiled_engine_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache",
            stats.prefix_queried_tokens,
        )
        yield CounterMetricFamily(
            "compiled_engine_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache",
            stats.prefix_hit_tokens,
        )
        yield CounterMetricFamily(
            "compiled_engine_aborted_requests",
            "Requests the engine ended by an abort before they finished (client gone, grace period over)",
            stats.aborted_requests,
        )
        yield GaugeMetricFamily("compiled_engine_lora_adapters_loaded", "LoRA adapters loaded", stats.lora_loaded)
        yield GaugeMetricFamily(
            "compiled_engine_lora_adapters_resident", "LoRA adapters in device slots", stats.lora_resident
        )
        spec = stats.speculative
        if spec is not None:
            yield CounterMetricFamily(
                "compiled_engine_spec_decode_drafts", "Sequence-steps that verified a draft", spec.drafts
            )
            yield CounterMetricFamily(
                "compiled_engine_spec_decode_draft_tokens", "Draft tokens verified", spec.draft_tokens
            )
            yield CounterMetricFamily(
                "compiled_engine_spec_decode_accepted_tokens", "Draft tokens accepted", spec.accepted_tokens
            )
            per_position = CounterMetricFamily(
                "compiled_engine_spec_decode_accepted_tokens_per_position",
                "Drafts whose token at this position was accepted",
                labels=["position"],
            )
            for position, count in enumerate(spec.accepted_at):
                per_position.add_metric([str(position)], count)
            yield per_position
            yield GaugeMetricFamily(
                "compiled_engine_spec_decode_acceptance_rate",
                "Accepted over verified draft tokens",
                acceptance_rate(spec),
            )
            yield GaugeMetricFamily(
                "compiled_engine_spec_decode_mean_acceptance_length",
                "Tokens a verifying step gives a sequence on average (accepted drafts plus one)",
                mean_acceptance_length(spec),
            )


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str = "default") -> None:
        """`model_name`: the served model, the `model_name` label of the vLLM-named metrics."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "compiled_engine_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "compiled_engine_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generated_tokens = Counter(
            "compiled_engine_generated_tokens", "Tokens generated for finished requests", registry=self.registry
        )
        self.finished = Counter(
            "compiled_engine_finished_requests",
            "Finished completions by finish reason (a request with n counts n); abort: aborted, or its client went away",
            ["finish_reason"],
            registry=self.registry,
        )
        for reason in FinishReason:
            self.finished.labels(str(reason))
        self.lora_requests = Counter(
            "compiled_engine_lora_requests",
            "Finished requests by LoRA adapter",
            ["adapter"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "compiled_engine_time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "compiled_engine_inter_token_latency_seconds",
            "Mean time between output tokens, per request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "compiled_engine_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))
        self.vllm = VllmMetrics(self.registry, engine, model_name)

    def observe(self, output: RequestOutput, adapter: str | None = None) -> None:
        """Record a finished request (`adapter`: the LoRA adapter it ran with)."""
        if adapter is not None:
            self.lora_requests.labels(adapter).inc()
        self.vllm.observe(output)
        for reason in finish_reasons(output):
            self.finished.labels(reason).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generated_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
        m = output.metrics
        if m is None:
            return
        for histogram, value in ((self.ttft, m.ttft), (self.itl, m.tpot), (self.e2e, m.e2e)):
            if value is not None:
                histogram.observe(value)

    def observe_abandoned(self, last: RequestOutput | None, n: int) -> None:
        """Record a request whose client went away before it finished (`last`: the last output it
        was given, None if none yet; `n`: its completions): its unfinished completions count as
        `abort`, here and in vLLM's `request_success`; its tokens and latencies are not counted."""
        reasons = finish_reasons(last, n)
        for reason in reasons:
            self.finished.labels(reason).inc()
        self.vllm.count_finished(reasons)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """Counts every HTTP response by route and status code."""

        async def count(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            status = 500

            async def send_and_note(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await app(scope, receive, send_and_note)
            finally:
                path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
                self.requests.labels(path, str(status)).inc()

        return count


def acceptance_rate(spec: DraftStats) -> float:
    return spec.accepted_tokens / spec.draft_tokens if spec.draft_tokens else 0.0


def mean_acceptance_length(spec: DraftStats) -> float:
    """Tokens a verifying step gives a sequence on average: its accepted drafts plus one."""
    return 1 + spec.accepted_tokens / spec.drafts if spec.drafts else 0.0
