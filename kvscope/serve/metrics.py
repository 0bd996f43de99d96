"""``/metrics``: vLLM's Prometheus metrics (names, types, labels, buckets), so a vLLM dashboard reads kvscope.

As in vLLM (``vllm/v1/metrics/loggers.py``), every series carries ``model_name`` and ``engine``
labels; counters are exposed by ``prometheus_client`` with the ``_total`` suffix
(``vllm:prefix_cache_queries_total``) and histograms as ``_bucket`` / ``_sum`` / ``_count``.
Counters follow the engine's own totals (``LLMEngine.metrics()``) step by step; the latency
histograms are measured here, from the moment a request reached the server.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# No ``*_created`` series, as vLLM (a process-wide switch of prometheus_client).
disable_created_metrics()

LABELS = ("model_name", "engine")
# vLLM's buckets, so the same dashboard quantiles apply.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort", "error")

# engine counter -> (vLLM metric name, help)
COUNTERS = {
    "prefix_cache_queries": (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    "prompt_tokens": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens": ("vllm:generation_tokens", "Number of generation tokens processed."),
}
GAUGES = {
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    "num_requests_running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "num_requests_waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    # kvscope's own (vLLM has no such gauge): what a fleet view counts from the KV events, to check it against
    "num_cached_blocks": (
        "kvscope:prefix_cache_blocks",
        "Blocks in the prefix cache: full blocks with a hash, in use or free.",
    ),
}


class ServeMetrics:
    """One registry per server (tests start many); updated on the engine's thread, read by ``/metrics``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._counters = {k: Counter(n, h, LABELS, registry=r) for k, (n, h) in COUNTERS.items()}
        self._gauges = {k: Gauge(n, h, LABELS, registry=r) for k, (n, h) in GAUGES.items()}
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            LABELS + ("finished_reason",),
            registry=r,
        )
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self._labels: tuple[str, str] | None = None
        self._last: dict[str, float] = {}

    def attach(self, model_name: str, counters: dict) -> None:
        """A new engine: its counters start from zero, so count all of them."""
        self._labels = (model_name, "0")
        self._last = dict.fromkeys(COUNTERS, 0)
        for counter in self._counters.values():
            counter.labels(*self._labels)  # every series from the start, at 0
        for reason in FINISH_REASONS:
            self._success.labels(*self._labels, reason)  # shown as 0 before the first one, as vLLM does
        self._ttft.labels(*self._labels)
        self._e2e.labels(*self._labels)
        self.update(counters)

    def update(self, counters: dict) -> None:
        if self._labels is None:
            return
        for key, counter in self._counters.items():
            delta = counters[key] - self._last[key]
            if delta > 0:
                counter.labels(*self._labels).inc(delta)
            self._last[key] = counters[key]
        for key, gauge in self._gauges.items():
            gauge.labels(*self._labels).set(counters[key])

    def observe_first_token(self, seconds: float) -> None:
        if self._labels is not None:
            self._ttft.labels(*self._labels).observe(seconds)

    def observe_finished(self, seconds: float, reason: str) -> None:
        if self._labels is None:
            return
        self._success.labels(*self._labels, reason if reason in FINISH_REASONS else "error").inc()
        if reason in ("stop", "length"):  # latency of completed requests, not of the abandoned ones
            self._e2e.labels(*self._labels).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
