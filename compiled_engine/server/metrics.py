"""Prometheus metrics for `GET /metrics`, in a registry of the server's own: both families of
metric_table.py (ours and vLLM's names), and the HTTP responses by route and status."""

from __future__ import annotations

from collections.abc import Iterator

from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from compiled_engine.engine.async_engine import AsyncEngine
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sequence import FinishReason
from compiled_engine.server.metric_table import (
    ENGINE_METRICS,
    FINISHED_OURS,
    FINISHED_VLLM,
    REQUEST_COUNTERS,
    REQUEST_HISTOGRAMS,
    Kind,
    Name,
)

KNOWN_PATHS = ("/health", "/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


class _EngineCollector(Collector):
    """One family's engine metrics at scrape time, from the snapshot the engine loop published
    last (`stats()`). `model_name`: the label every vLLM series carries; None for ours."""

    def __init__(self, engine: AsyncEngine, model_name: str | None) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.engine.stats()
        vllm = self.model_name is not None
        for metric in ENGINE_METRICS:
            name = metric.vllm if vllm else metric.ours
            reading = metric.read(stats)
            if name is None or reading is None:
                continue
            family = GaugeMetricFamily if metric.kind is Kind.GAUGE else CounterMetricFamily
            if not vllm and not metric.labels:
                assert not isinstance(reading, list)
                yield family(name.name, name.help, reading)
                continue
            # A vLLM series, or a labelled one: the samples carry their labels, vLLM's model_name first.
            prefix = [self.model_name] if self.model_name is not None else []
            samples = reading if isinstance(reading, list) else [([], reading)]
            labelled = family(name.name, name.help, labels=[*(["model_name"] if vllm else []), *metric.labels])
            for values, value in samples:
                labelled.add_metric([*prefix, *values], value)
            yield labelled


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str = "default") -> None:
        """`model_name`: the served model, the `model_name` label of the vLLM-named metrics."""
        self.model_name = model_name
        self.registry = registry = CollectorRegistry()
        # Registered in the order /metrics shows them: ours, then vLLM's.
        self.requests = Counter(
            "compiled_engine_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=registry,
        )
        self.counters = [Counter(row.ours.name, row.ours.help, registry=registry) for row in REQUEST_COUNTERS]
        self.finished = Counter(FINISHED_OURS.name, FINISHED_OURS.help, ["finish_reason"], registry=registry)
        self.lora_requests = Counter(
            "compiled_engine_lora_requests", "Finished requests by LoRA adapter", ["adapter"], registry=registry
        )
        self.histograms = [
            (row.observe, Histogram(row.ours.name, row.ours.help, buckets=row.buckets, registry=registry))
            for row in REQUEST_HISTOGRAMS
            if row.ours is not None
        ]
        registry.register(_EngineCollector(engine, None))

        labels = ["model_name"]
        self.vllm_counters = [
            Counter(row.vllm.name, row.vllm.help, labels, registry=registry).labels(model_name)
            for row in REQUEST_COUNTERS
        ]
        self.success = Counter(FINISHED_VLLM.name, FINISHED_VLLM.help, [*labels, "finished_reason"], registry=registry)
        self.vllm_histograms = [
            (row.observe, self._vllm_histogram(row.vllm, row.buckets))
            for row in REQUEST_HISTOGRAMS
            if row.vllm is not None
        ]
        registry.register(_EngineCollector(engine, model_name))
        # Every finish reason is exported from the start, at zero.
        for reason in FinishReason:
            self.finished.labels(str(reason))
            self.success.labels(model_name, str(reason))

    def _vllm_histogram(self, name: Name, buckets: tuple[float, ...]) -> Histogram:
        """A vLLM histogram's one series (exported from the start, at zero)."""
        histogram = Histogram(name.name, name.help, ["model_name"], buckets=buckets, registry=self.registry)
        return histogram.labels(self.model_name)

    def observe(self, output: RequestOutput, adapter: str | None = None) -> None:
        """Record a finished request (`adapter`: the LoRA adapter it ran with)."""
        if adapter is not None:
            self.lora_requests.labels(adapter).inc()
        self.count_finished(finish_reasons(output))
        for row, ours, vllm in zip(REQUEST_COUNTERS, self.counters, self.vllm_counters, strict=True):
            ours.inc(row.count(output))
            vllm.inc(row.count(output))
        for observe, histogram in (*self.histograms, *self.vllm_histograms):
            value = observe(output)
            if value is not None:
                histogram.observe(value)

    def observe_abandoned(self, last: RequestOutput | None, n: int) -> None:
        """Record a request whose client went away before it finished (`last`: the last output it
        was given, None if none yet; `n`: its completions): its unfinished completions count as
        `abort` in both families; its tokens and latencies are not counted."""
        self.count_finished(finish_reasons(last, n))

    def count_finished(self, reasons: list[str]) -> None:
        """Count finished completions, one finish reason each."""
        for reason in reasons:
            self.finished.labels(reason).inc()
            self.success.labels(self.model_name, reason).inc()

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


def finish_reasons(output: RequestOutput | None, n: int = 1) -> list[str]:
    """Each completion's finish reason, `abort` for those not finished: `output` is the request's
    last output (None when it had none yet, then its `n` completions all count as aborted)."""
    if output is None:
        return [str(FinishReason.ABORT)] * n
    return [completion.finish_reason or str(FinishReason.ABORT) for completion in output.outputs]
