"""Prometheus metrics for `GET /metrics`, in a registry of the server's own: both families of
metric_table.py (ours and vLLM's names), and the HTTP responses by route and status.

vLLM's series carry `model_name` and `engine` (the data-parallel replica, "0" for one engine), as
vLLM's do; ours describe the server as a whole (the replicas' sum), and
`compiled_engine_engine_up{engine}` says which replicas are alive."""

from __future__ import annotations

from collections.abc import Iterator

from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sequence import FinishReason
from compiled_engine.server.metric_table import (
    ENGINE_METRICS,
    FINISHED_OURS,
    FINISHED_VLLM,
    REQUEST_COUNTERS,
    REQUEST_HISTOGRAMS,
    Kind,
)
from compiled_engine.serving.client import EngineClient

KNOWN_PATHS = ("/health", "/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


class _EngineCollector(Collector):
    """One family's engine metrics at scrape time, from the snapshot the engine loop published
    last (`stats()`). `model_name`: the label every vLLM series carries; None for ours."""

    def __init__(self, engine: EngineClient, model_name: str | None) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if self.model_name is None:
            yield from self._ours()
            return
        by_engine = self.engine.engine_stats()  # the live engines only
        for metric in ENGINE_METRICS:
            if metric.vllm is None:
                continue
            family = GaugeMetricFamily if metric.kind is Kind.GAUGE else CounterMetricFamily
            labelled = family(metric.vllm.name, metric.vllm.help, labels=["model_name", "engine", *metric.labels])
            exported = False
            for index, stats in by_engine.items():
                reading = metric.read(stats)
                if reading is None:
                    continue
                exported = True
                for values, value in reading if isinstance(reading, list) else [([], reading)]:
                    labelled.add_metric([self.model_name, str(index), *values], value)
            if exported:
                yield labelled

    def _ours(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        health = self.engine.health()
        up = GaugeMetricFamily(
            "compiled_engine_engine_up", "1 while the engine (replica) runs, else 0", labels=["engine"]
        )
        for replica in health:
            up.add_metric([str(replica.index)], 1.0 if replica.alive else 0.0)
        yield up
        if not any(replica.alive for replica in health):
            return
        stats = self.engine.stats()
        for metric in ENGINE_METRICS:
            reading = metric.read(stats)
            if metric.ours is None or reading is None:
                continue
            family = GaugeMetricFamily if metric.kind is Kind.GAUGE else CounterMetricFamily
            if not metric.labels:
                assert not isinstance(reading, list)
                yield family(metric.ours.name, metric.ours.help, reading)
                continue
            labelled = family(metric.ours.name, metric.ours.help, labels=list(metric.labels))
            for values, value in reading if isinstance(reading, list) else [([], reading)]:
                labelled.add_metric(values, value)
            yield labelled


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str = "default", num_engines: int = 1) -> None:
        """`model_name`: the served model, the `model_name` label of the vLLM-named metrics;
        `num_engines`: the data-parallel replicas (their `engine` labels 0..N-1)."""
        self.model_name = model_name
        engines = [str(index) for index in range(num_engines)]
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

        labels = ["model_name", "engine"]
        self.vllm_counters = [
            Counter(row.vllm.name, row.vllm.help, labels, registry=registry) for row in REQUEST_COUNTERS
        ]
        self.success = Counter(FINISHED_VLLM.name, FINISHED_VLLM.help, [*labels, "finished_reason"], registry=registry)
        self.vllm_histograms = [
            (row.observe, Histogram(row.vllm.name, row.vllm.help, labels, buckets=row.buckets, registry=registry))
            for row in REQUEST_HISTOGRAMS
            if row.vllm is not None
        ]
        registry.register(_EngineCollector(engine, model_name))
        # Every series is exported from the start, at zero, for every engine.
        for index in engines:
            for counter in self.vllm_counters:
                counter.labels(model_name, index)
            for _, histogram in self.vllm_histograms:
                histogram.labels(model_name, index)
            for reason in FinishReason:
                self.success.labels(model_name, index, str(reason))
        for reason in FinishReason:
            self.finished.labels(str(reason))

    def observe(self, output: RequestOutput, adapter: str | None = None) -> None:
        """Record a finished request (`adapter`: the LoRA adapter it ran with)."""
        if adapter is not None:
            self.lora_requests.labels(adapter).inc()
        engine = str(output.engine_index)
        self.count_finished(finish_reasons(output), engine)
        for row, ours, vllm in zip(REQUEST_COUNTERS, self.counters, self.vllm_counters, strict=True):
            ours.inc(row.count(output))
            vllm.labels(self.model_name, engine).inc(row.count(output))
        for observe, histogram in self.histograms:
            value = observe(output)
            if value is not None:
                histogram.observe(value)
        for observe, labelled in self.vllm_histograms:
            value = observe(output)
            if value is not None:
                labelled.labels(self.model_name, engine).observe(value)

    def observe_abandoned(self, last: RequestOutput | None, n: int) -> None:
        """Record a request whose client went away before it finished (`last`: the last output it
        was given, None if none yet; `n`: its completions): its unfinished completions count as
        `abort` in both families; its tokens and latencies are not counted."""
        self.count_finished(finish_reasons(last, n), str(last.engine_index if last is not None else 0))

    def count_finished(self, reasons: list[str], engine: str = "0") -> None:
        """Count finished completions, one finish reason each (`engine`: the replica that ran them)."""
        for reason in reasons:
            self.finished.labels(reason).inc()
            self.success.labels(self.model_name, engine, reason).inc()

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
