"""Every metric `/metrics` exports, in one table per source: the engine's published state
(`EngineStats`, read at scrape time) and each finished request (`RequestOutput`).

Each row names the metric in both families: ours (`compiled_engine_*`) and vLLM's (`vllm:*`, every
series with the `model_name` label), so that dashboards and alerts written for vLLM
(`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`, ...)
work unchanged. Ours stay because existing scrapes and tests use them and they carry what vLLM
has no name for (KV pages, memory, LoRA slots); a row without one of the names exists in one family
only. docs/grafana-dashboard.json is built on vLLM's names only.

Where we measure less finely than vLLM it is said here: `vllm:inter_token_latency_seconds`
observes each request's mean gap between output tokens, not every gap.

A request whose client went away before it finished (a cut stream, a closed connection) counts as
finish reason `abort` (`compiled_engine_finished_requests`, and vLLM's
`vllm:request_success_total{finished_reason="abort"}`) and in no other series: no tokens, no
lengths, no latencies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from compiled_engine.engine.drafting import DraftStats
from compiled_engine.engine.outputs import RequestMetrics, RequestOutput
from compiled_engine.engine.stats import EngineStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 8, 32, 128, 512, 2048, 8192)


class Kind(Enum):
    GAUGE = "gauge"
    COUNTER = "counter"


@dataclass(frozen=True)
class Name:
    """A metric's name in one family, and its help text there."""

    name: str
    help: str


# One labelled sample: its label values (in the row's `labels` order) and its value.
LabelledValue = tuple[list[str], float]
# A row's reading: one value, labelled values (possibly none), or None when the metric is not
# exported now (the engine does not speculate, serves no adapters).
Reading = float | list[LabelledValue] | None


@dataclass(frozen=True)
class EngineMetric:
    kind: Kind
    ours: Name | None
    vllm: Name | None
    read: Callable[[EngineStats], Reading]
    labels: tuple[str, ...] = ()  # the labels of a reading's labelled values (vLLM's model_name comes first)


def _kv_usage(stats: EngineStats) -> float:
    used = stats.kv_pages_total - stats.kv_pages_free
    return used / stats.kv_pages_total if stats.kv_pages_total else 0.0


def _accepted_per_position(stats: EngineStats) -> list[LabelledValue] | None:
    spec = stats.speculative
    if spec is None:
        return None
    return [([str(position)], count) for position, count in enumerate(spec.accepted_at)]


def _lora_info(stats: EngineStats) -> list[LabelledValue] | None:
    if stats.lora_max is None:
        return None
    return [([",".join(stats.lora_running), ",".join(stats.lora_waiting), str(stats.lora_max)], 1)]


G, C = Kind.GAUGE, Kind.COUNTER
# In the order each family exports them.
ENGINE_METRICS: tuple[EngineMetric, ...] = (
    EngineMetric(
        G,
        Name("compiled_engine_running_requests", "Sequences running in the engine"),
        Name("vllm:num_requests_running", "Requests running"),
        lambda s: s.running_requests,
    ),
    EngineMetric(
        G,
        Name("compiled_engine_waiting_requests", "Requests waiting to be scheduled"),
        Name("vllm:num_requests_waiting", "Requests waiting"),
        lambda s: s.waiting_requests,
    ),
    EngineMetric(
        G,
        Name("compiled_engine_kv_pages_used", "KV cache pages referenced by sequences"),
        None,
        lambda s: s.kv_pages_total - s.kv_pages_free,
    ),
    EngineMetric(G, None, Name("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)"), _kv_usage),
    EngineMetric(
        G, Name("compiled_engine_kv_pages_free", "KV cache pages free or evictable"), None, lambda s: s.kv_pages_free
    ),
    EngineMetric(
        G,
        Name(
            "compiled_engine_weight_bytes",
            "Weight memory: the models' tensors, each held once (packed on the compiled CPU path)",
        ),
        None,
        lambda s: s.weight_bytes,
    ),
    EngineMetric(G, Name("compiled_engine_kv_cache_bytes", "KV page pool memory"), None, lambda s: s.kv_cache_bytes),
    EngineMetric(
        G, Name("compiled_engine_kv_cache_tokens", "Tokens the KV page pool holds"), None, lambda s: s.kv_cache_tokens
    ),
    EngineMetric(
        G,
        Name("compiled_engine_kv_cache_info", "The KV pages' storage type (--kv-cache-dtype), as a label"),
        None,
        lambda s: [([s.kv_cache_dtype], 1.0)] if s.kv_cache_dtype else None,
        ("kv_cache_dtype",),
    ),
    EngineMetric(C, None, Name("vllm:num_preemptions", "Preemptions"), lambda s: s.num_preemptions),
    EngineMetric(
        C,
        Name("compiled_engine_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache"),
        Name("vllm:prefix_cache_queries", "Prompt tokens looked up"),
        lambda s: s.prefix_queried_tokens,
    ),
    EngineMetric(
        C,
        Name("compiled_engine_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache"),
        Name("vllm:prefix_cache_hits", "Prompt tokens found cached"),
        lambda s: s.prefix_hit_tokens,
    ),
    EngineMetric(
        C,
        Name(
            "compiled_engine_aborted_requests",
            "Requests the engine ended before they finished: aborted (client gone, grace period over) or in a failed step",
        ),
        None,
        lambda s: s.aborted_requests,
    ),
    EngineMetric(
        G, Name("compiled_engine_lora_adapters_loaded", "LoRA adapters loaded"), None, lambda s: s.lora_loaded
    ),
    EngineMetric(
        G,
        Name("compiled_engine_lora_adapters_resident", "LoRA adapters in device slots"),
        None,
        lambda s: s.lora_resident,
    ),
    EngineMetric(
        C,
        Name("compiled_engine_spec_decode_drafts", "Sequence-steps that verified a draft"),
        Name("vllm:spec_decode_num_drafts", "Drafts verified"),
        lambda s: None if s.speculative is None else s.speculative.drafts,
    ),
    EngineMetric(
        C,
        Name("compiled_engine_spec_decode_draft_tokens", "Draft tokens verified"),
        Name("vllm:spec_decode_num_draft_tokens", "Draft tokens"),
        lambda s: None if s.speculative is None else s.speculative.draft_tokens,
    ),
    EngineMetric(
        C,
        Name("compiled_engine_spec_decode_accepted_tokens", "Draft tokens accepted"),
        Name("vllm:spec_decode_num_accepted_tokens", "Accepted tokens"),
        lambda s: None if s.speculative is None else s.speculative.accepted_tokens,
    ),
    EngineMetric(
        C,
        Name(
            "compiled_engine_spec_decode_accepted_tokens_per_position",
            "Drafts whose token at this position was accepted",
        ),
        Name("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position"),
        _accepted_per_position,
        ("position",),
    ),
    EngineMetric(
        G,
        Name("compiled_engine_spec_decode_acceptance_rate", "Accepted over verified draft tokens"),
        None,
        lambda s: None if s.speculative is None else acceptance_rate(s.speculative),
    ),
    EngineMetric(
        G,
        Name(
            "compiled_engine_spec_decode_mean_acceptance_length",
            "Tokens a verifying step gives a sequence on average (accepted drafts plus one)",
        ),
        None,
        lambda s: None if s.speculative is None else mean_acceptance_length(s.speculative),
    ),
    EngineMetric(
        G,
        None,
        Name("vllm:lora_requests_info", "LoRA adapters running and waiting"),
        _lora_info,
        ("running_lora_adapters", "waiting_lora_adapters", "max_lora"),
    ),
)


@dataclass(frozen=True)
class RequestHistogram:
    """A distribution over finished requests; `observe` gives a request's value (None: not known)."""

    ours: Name | None
    vllm: Name | None
    observe: Callable[[RequestOutput], float | None]
    buckets: tuple[float, ...] = LATENCY_BUCKETS


def _timed(span: Callable[[RequestMetrics], float | None]) -> Callable[[RequestOutput], float | None]:
    return lambda output: None if output.metrics is None else span(output.metrics)


def _prefill(m: RequestMetrics) -> float | None:
    if m.first_token_time is None or m.first_scheduled_time is None:
        return None
    return m.first_token_time - m.first_scheduled_time


def _decode(m: RequestMetrics) -> float | None:
    if m.finished_time is None or m.first_token_time is None:
        return None
    return m.finished_time - m.first_token_time


def generated_tokens(output: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in output.outputs)


REQUEST_HISTOGRAMS: tuple[RequestHistogram, ...] = (
    RequestHistogram(
        Name("compiled_engine_time_to_first_token_seconds", "Time to first token"),
        Name("vllm:time_to_first_token_seconds", "Time to first token"),
        _timed(lambda m: m.ttft),
    ),
    RequestHistogram(
        Name("compiled_engine_inter_token_latency_seconds", "Mean time between output tokens, per request"),
        Name("vllm:inter_token_latency_seconds", "Mean time between output tokens, per request"),
        _timed(lambda m: m.tpot),
    ),
    RequestHistogram(
        Name("compiled_engine_e2e_request_latency_seconds", "Arrival to last token"),
        Name("vllm:e2e_request_latency_seconds", "Arrival to finish"),
        _timed(lambda m: m.e2e),
    ),
    RequestHistogram(
        None, Name("vllm:request_queue_time_seconds", "Arrival to first scheduled"), _timed(lambda m: m.queue_time)
    ),
    RequestHistogram(
        None, Name("vllm:request_prefill_time_seconds", "First scheduled to first token"), _timed(_prefill)
    ),
    RequestHistogram(None, Name("vllm:request_decode_time_seconds", "First token to finish"), _timed(_decode)),
    RequestHistogram(
        None,
        Name("vllm:request_prompt_tokens", "Prompt tokens per request"),
        lambda output: len(output.prompt_token_ids),
        TOKEN_BUCKETS,
    ),
    RequestHistogram(
        None,
        Name("vllm:request_generation_tokens", "Generated tokens per request"),
        generated_tokens,
        TOKEN_BUCKETS,
    ),
)


@dataclass(frozen=True)
class RequestCounter:
    """A count over finished requests; `count` gives what a request adds."""

    ours: Name
    vllm: Name
    count: Callable[[RequestOutput], int]


REQUEST_COUNTERS: tuple[RequestCounter, ...] = (
    RequestCounter(
        Name("compiled_engine_prompt_tokens", "Prompt tokens of finished requests"),
        Name("vllm:prompt_tokens", "Prompt tokens"),
        lambda output: len(output.prompt_token_ids),
    ),
    RequestCounter(
        Name("compiled_engine_generated_tokens", "Tokens generated for finished requests"),
        Name("vllm:generation_tokens", "Generated tokens"),
        generated_tokens,
    ),
)

# Finished completions by finish reason: both families count them, under different label names.
FINISHED_OURS = Name(
    "compiled_engine_finished_requests",
    "Finished completions by finish reason (a request with n counts n); abort: aborted, or its client went away",
)
FINISHED_VLLM = Name("vllm:request_success", "Finished requests by reason")


def acceptance_rate(spec: DraftStats) -> float:
    return spec.accepted_tokens / spec.draft_tokens if spec.draft_tokens else 0.0


def mean_acceptance_length(spec: DraftStats) -> float:
    """Tokens a verifying step gives a sequence on average: its accepted drafts plus one."""
    return 1 + spec.accepted_tokens / spec.drafts if spec.drafts else 0.0
