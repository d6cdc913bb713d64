"""vLLM's metric names, exported beside ours, so that dashboards and alerts written for vLLM
(`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`, ...)
work unchanged; every series has the `model_name` label. Ours (`compiled_engine_*`) stay, because
existing scrapes and tests use them and they carry what vLLM has no name for (HTTP status counts,
LoRA slots). docs/grafana-dashboard.json is built on these names only.

Where we measure less finely than vLLM it is said here: `vllm:inter_token_latency_seconds`
observes each request's mean gap between output tokens, not every gap.

A request whose client went away before it finished (a cut stream, a closed connection) counts in
`vllm:request_success_total{finished_reason="abort"}` (vLLM's name for it) and in no other
series here: no tokens, no lengths, no latencies.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from compiled_engine.engine.async_engine import AsyncEngine
from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.engine.sequence import FinishReason

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 8, 32, 128, 512, 2048, 8192)


class _VllmEngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _family(
        self, kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, text: str, value: float
    ) -> GaugeMetricFamily | CounterMetricFamily:
        family = kind(name, text, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.engine.stats()
        used = stats.kv_pages_total - stats.kv_pages_free
        yield self._family(GaugeMetricFamily, "vllm:num_requests_running", "Requests running", stats.running_requests)
        yield self._family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting", stats.waiting_requests)
        yield self._family(
            GaugeMetricFamily,
            "vllm:kv_cache_usage_perc",
            "KV cache usage (1 = full)",
            used / stats.kv_pages_total if stats.kv_pages_total else 0.0,
        )
        yield self._family(CounterMetricFamily, "vllm:num_preemptions", "Preemptions", stats.num_preemptions)
        yield self._family(
            CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up", stats.prefix_queried_tokens
        )
        yield self._family(
            CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found cached", stats.prefix_hit_tokens
        )
        spec = stats.speculative
        if spec is not None:
            yield self._family(CounterMetricFamily, "vllm:spec_decode_num_drafts", "Drafts verified", spec.drafts)
            yield self._family(
                CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Draft tokens", spec.draft_tokens
            )
            yield self._family(
                CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Accepted tokens", spec.accepted_tokens
            )
            per_position = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens by position",
                labels=["model_name", "position"],
            )
            for position, count in enumerate(spec.accepted_at):
                per_position.add_metric([self.model_name, str(position)], count)
            yield per_position
        if stats.lora_max is not None:
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "LoRA adapters running and waiting",
                labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            info.add_metric(
                [self.model_name, ",".join(stats.lora_running), ",".join(stats.lora_waiting), str(stats.lora_max)], 1
            )
            yield info


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, engine: AsyncEngine, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, text: str, buckets: tuple[float, ...] = BUCKETS) -> Histogram:
            return Histogram(name, text, labels, buckets=buckets, registry=registry)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", labels, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", labels, registry=registry)
        self.success = Counter(
            "vllm:request_success", "Finished requests by reason", [*labels, "finished_reason"], registry=registry
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Mean time between output tokens, per request")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish")
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled")
        self.prefill = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token")
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to finish")
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.generation_len = histogram("vllm:request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS)
        for series in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue):
            series.labels(model_name)  # exported from the start, at zero
        for series in (self.prefill, self.decode, self.prompt_len, self.generation_len):
            series.labels(model_name)
        for reason in FinishReason:
            self.success.labels(model_name, str(reason))
        registry.register(_VllmEngineCollector(engine, model_name))

    def observe(self, output: RequestOutput) -> None:
        name = self.model_name
        generated = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(name).inc(generated)
        self.prompt_len.labels(name).observe(len(output.prompt_token_ids))
        self.generation_len.labels(name).observe(generated)
        self.count_finished(finish_reasons(output))
        m = output.metrics
        if m is None:
            return
        spans = {
            self.ttft: m.ttft,
            self.itl: m.tpot,
            self.e2e: m.e2e,
            self.queue: m.queue_time,
            self.prefill: None
            if m.first_token_time is None or m.first_scheduled_time is None
            else m.first_token_time - m.first_scheduled_time,
            self.decode: None
            if m.finished_time is None or m.first_token_time is None
            else m.finished_time - m.first_token_time,
        }
        for histogram, value in spans.items():
            if value is not None:
                histogram.labels(name).observe(value)

    def count_finished(self, reasons: list[str]) -> None:
        """Count finished completions, one finish reason each."""
        for reason in reasons:
            self.success.labels(self.model_name, reason).inc()


def finish_reasons(output: RequestOutput | None, n: int = 1) -> list[str]:
    """Each completion's finish reason, `abort` for those not finished: `output` is the request's
    last output (None when it had none yet, then its `n` completions all count as aborted)."""
    if output is None:
        return [str(FinishReason.ABORT)] * n
    return [completion.finish_reason or str(FinishReason.ABORT) for completion in output.outputs]
