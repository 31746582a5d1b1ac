"""Prometheus metrics of a server: engine load read at scrape time, per-request latencies and token counts.

Each server gets its own `CollectorRegistry` rather than prometheus_client's global one, so that several servers
in one process (tests) do not collide over metric names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets in seconds, spanning a tiny CPU model's milliseconds to a long prompt's prefill on a big one.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)


class _LoadCollector(Collector):
    """Values that live in the engine and the admission counter, read when Prometheus scrapes."""

    def __init__(self, gauges: Mapping[str, tuple[str, Callable[[], float]]],
                 counters: Mapping[str, tuple[str, Callable[[], float]]]):
        self._gauges = gauges
        self._counters = counters

    def collect(self) -> Iterable[Metric]:
        for name, (doc, read) in self._gauges.items():
            yield GaugeMetricFamily(name, doc, value=read())
        for name, (doc, read) in self._counters.items():
            yield CounterMetricFamily(name, doc, value=read())


class ServerMetrics:
    def __init__(self, gauges: Mapping[str, tuple[str, Callable[[], float]]],
                 counters: Mapping[str, tuple[str, Callable[[], float]]] | None = None):
        self.registry = CollectorRegistry()
        self.registry.register(_LoadCollector(gauges, counters or {}))
        r = self.registry
        self.ttft = Histogram("m3jax_time_to_first_token_seconds", "Time from arrival to the first token",
                              registry=r, buckets=_TTFT_BUCKETS)
        self.tpot = Histogram("m3jax_time_per_output_token_seconds",
                              "Per request: (E2E - TTFT) / (output tokens - 1)", registry=r, buckets=_TOKEN_BUCKETS)
        self.itl = Histogram("m3jax_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             registry=r, buckets=_TOKEN_BUCKETS)
        self.e2e = Histogram("m3jax_e2e_request_latency_seconds", "Time from arrival to the last token",
                             registry=r, buckets=_E2E_BUCKETS)
        self.prompt_tokens = Counter("m3jax_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("m3jax_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("m3jax_requests", "Finished requests by API and finish reason",
                                ["api", "finish_reason"], registry=r)
        self.rejected = Counter("m3jax_requests_rejected", "Requests refused by back-pressure (429 / "
                                "RESOURCE_EXHAUSTED)", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
