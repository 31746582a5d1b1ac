"""Prometheus metrics of a server: engine load read at scrape time, per-request latencies and token counts.

Every figure is exported twice: under m3jax's own names (`m3jax_*`) and under vLLM's names and labels
(`vllm:*`, each with `model_name`), so that the Grafana dashboards and alerts written for vLLM work unchanged.
vLLM's `finished_reason` values are `stop`, `length`, `abort` and `error`; a request whose client left counts
as `abort` there (m3jax's own `m3jax_requests_total` tells it apart as `cancelled`).

Each server gets its own `CollectorRegistry` rather than prometheus_client's global one, so that several servers
in one process (tests) do not collide over metric names.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets in seconds, spanning a tiny CPU model's milliseconds to a long prompt's prefill on a big one.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
                1920.0, 7680.0)

# What m3jax's finish reasons are in vLLM's `finished_reason` label.
_VLLM_REASON = {"stop": "stop", "length": "length", "abort": "abort", "cancelled": "abort", "error": "error"}


def _one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's buckets for token counts."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


@dataclass(frozen=True)
class Reading:
    """A figure that lives in the engine or the admission counter, read when Prometheus scrapes."""

    kind: str  # "gauge" or "counter"
    name: str
    doc: str
    read: Callable[[], float]
    labels: tuple[tuple[str, str], ...] = ()


class _LoadCollector(Collector):
    def __init__(self, readings: Sequence[Reading]):
        self._readings = readings

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}  # readings of one name (one per label set) share a family
        for r in self._readings:
            if r.name not in families:
                family = GaugeMetricFamily if r.kind == "gauge" else CounterMetricFamily
                families[r.name] = family(r.name, r.doc, labels=[k for k, _ in r.labels])
            families[r.name].add_metric([v for _, v in r.labels], r.read())
        yield from families.values()


class _PerToken(Collector):
    """The figures updated for every generated token: the gap between a request's tokens (one histogram, exported
    under m3jax's name and vLLM's two) and the generated-token counters (m3jax's and vLLM's).

    prometheus_client's Histogram takes a lock and walks its buckets in Python on each observe; three histograms
    and two counters a token took about 14% of the servers' event loop at 64 streams (docs/benchmarks.md, "What a
    token costs the servers' process"). Here a token is one bisect and three adds. Written only from the servers'
    event loop, which also renders /metrics, so it needs no lock."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.bounds = _TOKEN_BUCKETS
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.generated = 0

    def tokens(self, n: int, gap: float | None) -> None:
        if gap is not None:  # tokens that arrive together share the gap
            self.counts[bisect_left(self.bounds, gap / n)] += n  # `le`: a gap on a bound counts in its bucket
            self.sum += gap
        self.generated += n

    def collect(self) -> Iterable[Metric]:
        buckets, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            buckets.append((floatToGoString(bound), total))
        for name, doc, labels in (
                ("m3jax_inter_token_latency_seconds", "Time between consecutive tokens of a request", ()),
                # vLLM observes every inter-token gap under both names (the second is the older one, which its
                # dashboards still read).
                ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                 (self.model_name,)),
                ("vllm:time_per_output_token_seconds", "Histogram of inter-token latency in seconds.",
                 (self.model_name,))):
            h = HistogramMetricFamily(name, doc, labels=["model_name"] if labels else None)
            h.add_metric(list(labels), buckets, self.sum)
            yield h
        c = CounterMetricFamily("m3jax_generation_tokens", "Generated tokens")
        c.add_metric([], self.generated)
        yield c
        c = CounterMetricFamily("vllm:generation_tokens", "Number of generation tokens processed.",
                                labels=["model_name"])
        c.add_metric([self.model_name], self.generated)
        yield c


class ServerMetrics:
    """The request-level metrics (histograms, token and request counters) plus the engine readings.

    The servers report through four calls: `first_token`, `tokens`, `finished` and `overloaded`.
    """

    def __init__(self, model_name: str, readings: Sequence[Reading], max_model_len: int):
        self.registry = CollectorRegistry()
        self.registry.register(_LoadCollector(readings))
        r = self.registry
        self.model_name = model_name
        # Plain totals, for the periodic throughput log line.
        self.prompt_tokens_count = 0
        self.per_token = _PerToken(model_name)
        r.register(self.per_token)

        # ---- m3jax's names ----
        self.ttft = Histogram("m3jax_time_to_first_token_seconds", "Time from arrival to the first token",
                              registry=r, buckets=_TTFT_BUCKETS)
        self.tpot = Histogram("m3jax_time_per_output_token_seconds",
                              "Per request: (E2E - TTFT) / (output tokens - 1)", registry=r, buckets=_TOKEN_BUCKETS)
        self.e2e = Histogram("m3jax_e2e_request_latency_seconds", "Time from arrival to the last token",
                             registry=r, buckets=_E2E_BUCKETS)
        self.queue = Histogram("m3jax_request_queue_time_seconds", "Time from the engine's arrival of a request to "
                               "the scheduling of its first chunk", registry=r, buckets=_TTFT_BUCKETS)
        self.prefill = Histogram("m3jax_request_prefill_time_seconds", "Time from the scheduling of a request's "
                                 "first chunk to its first token", registry=r, buckets=_TTFT_BUCKETS)
        # The rest of the server's TTFT, outside the engine (both clocks are the host's monotonic clock, which the
        # engine process shares): the request's way in and its first token's way out.
        self.handoff = Histogram("m3jax_request_handoff_seconds", "Time from the server's receipt of a request to "
                                 "the engine's arrival of it (checks, tokenisation, the hand-over to the engine "
                                 "process)", registry=r, buckets=_TTFT_BUCKETS)
        self.delivery = Histogram("m3jax_first_token_delivery_seconds", "Time from the engine's first token of a "
                                  "request to the server's handler", registry=r, buckets=_TTFT_BUCKETS)
        self.prompt_tokens = Counter("m3jax_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.requests = Counter("m3jax_requests", "Requests admitted by a server, by API and how they ended "
                                "(stop, length, abort, cancelled: the client left, invalid: refused as a bad "
                                "request, error)", ["api", "finish_reason"], registry=r)
        self.rejected = Counter("m3jax_requests_rejected", "Requests refused by back-pressure, never admitted "
                                "(--max-queue reached: HTTP 429 / RESOURCE_EXHAUSTED)", registry=r)

        # ---- vLLM's names and labels ----
        name = ["model_name"]
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                name, registry=r, buckets=_TTFT_BUCKETS).labels(model_name)
        self.v_tpot = Histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                                "time_per_output_token_seconds per request.", name, registry=r,
                                buckets=_TOKEN_BUCKETS).labels(model_name)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                               name, registry=r, buckets=_E2E_BUCKETS).labels(model_name)
        self.v_queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for "
                                 "request.", name, registry=r, buckets=_TTFT_BUCKETS).labels(model_name)
        self.v_prefill = Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase "
                                   "for request.", name, registry=r, buckets=_TTFT_BUCKETS).labels(model_name)
        self.v_decode = Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase "
                                  "for request.", name, registry=r, buckets=_E2E_BUCKETS).labels(model_name)
        token_buckets = _one_two_five(max_model_len)
        self.v_prompt_len = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", name,
                                      registry=r, buckets=token_buckets).labels(model_name)
        self.v_generation_len = Histogram("vllm:request_generation_tokens", "Number of generation tokens "
                                          "processed.", name, registry=r, buckets=token_buckets).labels(model_name)
        self.v_max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                                      "parameter.", name, registry=r, buckets=token_buckets).labels(model_name)
        self.v_prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", name,
                                       registry=r).labels(model_name)
        self.v_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                 ["finished_reason", "model_name"], registry=r)
        for reason in ("stop", "length", "abort", "error"):  # present from the start, as vLLM's are
            self.v_success.labels(reason, model_name)

    # ---- what the servers report ------------------------------------------------------------------------------
    def first_token(self, ttft: float, prompt_tokens: int, *, queue: float | None = None,
                    prefill: float | None = None, handoff: float | None = None,
                    delivery: float | None = None) -> None:
        """A request's first token, `ttft` seconds after the server received it; `queue` and `prefill` split the
        engine's part of that wait (arrival to the first chunk's scheduling, then to the first token), `handoff`
        and `delivery` the rest (the server's receipt to the engine's arrival; the first token to the server)."""
        self.ttft.observe(ttft)
        self.v_ttft.observe(ttft)
        if queue is not None and prefill is not None:
            self.queue.observe(queue)
            self.v_queue.observe(queue)
            self.prefill.observe(prefill)
            self.v_prefill.observe(prefill)
        if handoff is not None and delivery is not None:
            self.handoff.observe(handoff)
            self.delivery.observe(delivery)
        self.prompt_tokens.inc(prompt_tokens)
        self.v_prompt_tokens.inc(prompt_tokens)
        self.prompt_tokens_count += prompt_tokens

    def tokens(self, n: int, gap: float | None) -> None:
        """`n` tokens arrived together, `gap` seconds after the request's previous ones (None: the first)."""
        self.per_token.tokens(n, gap)

    @property
    def generation_tokens_count(self) -> int:
        return self.per_token.generated

    def finished(self, api: str, reason: str, *, e2e: float | None = None, decode: float | None = None,
                 prompt_tokens: int = 0, generated: int = 0, max_tokens: int | None = None) -> None:
        """A request admitted by a server ended; `e2e` is None when it never reached the engine (a bad request
        refused at its door)."""
        self.requests.labels(api, reason).inc()
        if e2e is None:
            return
        self.e2e.observe(e2e)
        self.v_e2e.observe(e2e)
        if decode is not None and generated > 1:
            tpot = decode / (generated - 1)
            self.tpot.observe(tpot)
            self.v_tpot.observe(tpot)
            self.v_decode.observe(decode)
        self.v_prompt_len.observe(prompt_tokens)
        self.v_generation_len.observe(generated)
        if max_tokens is not None:
            self.v_max_tokens.observe(max_tokens)
        self.v_success.labels(_VLLM_REASON.get(reason, "error"), self.model_name).inc()

    def overloaded(self) -> None:
        self.rejected.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
