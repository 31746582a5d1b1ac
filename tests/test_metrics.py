"""The per-token metrics (one collector, written on the event loop) against prometheus_client's own Histogram and
Counter fed the same tokens: the exposition must not change for dashboards or alerts."""

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving.metrics import _TOKEN_BUCKETS, ServerMetrics


def _samples(text: str, prefix: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(prefix) and not s.name.endswith("_created")}


def test_per_token_histogram_and_counters_match_prometheus_client():
    metrics = ServerMetrics("m", [], 4096)
    ref = CollectorRegistry()
    itl = Histogram("m3jax_inter_token_latency_seconds", "", registry=ref, buckets=_TOKEN_BUCKETS)
    generated = Counter("m3jax_generation_tokens", "", registry=ref)
    rng = random.Random(0)
    bounds = [*_TOKEN_BUCKETS, 100.0]
    for _ in range(3000):
        n = rng.choice([1, 1, 2, 4])  # tokens that arrive together (a speculative step's accepted run)
        # Gaps on the bucket bounds too: `le` is inclusive.
        gap = rng.choice([None, rng.expovariate(50.0), rng.choice(bounds) * n])
        metrics.tokens(n, gap)
        if gap is not None:
            for _ in range(n):
                itl.observe(gap / n)
        generated.inc(n)
    got = metrics.render().decode()
    want = _samples(generate_latest(ref).decode(), "m3jax_")
    mine = _samples(got, "m3jax_inter_token") | _samples(got, "m3jax_generation")
    assert mine.keys() == want.keys()
    for key, value in want.items():  # bucket counts and totals exactly; the sum to rounding (one add per gap)
        assert mine[key] == value if not key[0].endswith("_sum") else abs(mine[key] - value) <= 1e-9 * value, key
    # vLLM's two names carry the same histogram, and its counter the same total, labelled with the model.
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        theirs = _samples(got, name)
        assert all(dict(labels)["model_name"] == "m" for _, labels in theirs)
        unlabelled = {(n.replace(name, "m3jax_inter_token_latency_seconds"),
                       tuple(x for x in labels if x[0] != "model_name")): v for (n, labels), v in theirs.items()}
        assert unlabelled == _samples(got, "m3jax_inter_token")
    total = _samples(got, "vllm:generation_tokens")[("vllm:generation_tokens_total", (("model_name", "m"),))]
    assert total == want[("m3jax_generation_tokens_total", ())] == metrics.generation_tokens_count
