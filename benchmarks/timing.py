"""Device time of an op inside one jitted program, the way a serving step runs it.

The benchmarks' main timing calls the jitted op back to back from Python, which measures the device only while
the host enqueues faster than the device runs. For ops of tens of microseconds the two are close, and a slower or
busier host CPU on one loan shows up as a slower kernel. Here `copies` calls of the op, each on its own inputs (so
XLA cannot merge them), are one jitted program: one dispatch for all of them, as in a decode step where the op
sits among the layers' other work.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


def in_graph_time(fn: Callable[..., Any], copy_args: Sequence[tuple], *, samples: int = 15,
                  min_sample_s: float = 2e-3) -> float:
    """Seconds per call of `fn` when its calls on each tuple of `copy_args` run in one jitted program (median
    over `samples`, each at least `min_sample_s` of back-to-back programs)."""
    multi = jax.jit(lambda args: [fn(*a) for a in args])
    args = list(copy_args)
    jax.block_until_ready(multi(args))
    t0 = time.perf_counter()
    jax.block_until_ready(multi(args))
    reps = max(1, int(min_sample_s / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = multi(args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / (reps * len(args)))
    return statistics.median(times)


def fresh_like(x: jax.Array, n: int, seed: int = 0) -> list[jax.Array]:
    """`n` standard-normal arrays of x's shape and dtype (distinct inputs for in_graph_time's copies)."""
    return [jax.random.normal(jax.random.key(seed + i), x.shape, x.dtype) for i in range(n)]
