"""The GPU benchmarks' two device-side timings, beside their back-to-back Python calls (docs/benchmarks.md, top).

- `in_graph_time`: `IN_GRAPH_COPIES` calls of the op, each on its own inputs (so XLA cannot merge them), in one
  jitted program, the way an op sits among a model step's other work. One dispatch for all of them, but each
  op's kernels are still launched one by one: on the H200 this came out slower than the Python loop for ops of
  50-100 us.
- `device_profile`: the GPU's own trace (jax.profiler / CUPTI) of back-to-back calls: the kernels' summed
  durations per call and the top kernels by name. Host dispatch and launch gaps do not count, so this is the
  kernel's time, and it held to 1-3% across machines where the wall time spread by 1.5x.
"""

from __future__ import annotations

import glob
import os
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax

IN_GRAPH_COPIES = 16  # copies per jitted program in the benchmarks' in-graph timing


def in_graph_time(fn: Callable[..., Any], copy_args: Sequence[tuple], *, shared: tuple = (), samples: int = 15,
                  min_sample_s: float = 2e-3) -> float:
    """Seconds per call of `fn(*copy_args[i], *shared)` when the calls on every tuple of `copy_args` run in one
    jitted program (median over `samples`, each at least `min_sample_s` of back-to-back programs). `shared`
    (weights, say) are arguments of that program: closed over, XLA would embed them as constants."""
    # An array that is the same object in every copy (a page pool) is passed once: 16 aliases of a 20 GB pool
    # make XLA's scheduler budget 16 times its size.
    n = len(copy_args[0])
    same = [j for j in range(n) if all(a[j] is copy_args[0][j] for a in copy_args)]
    once = tuple(copy_args[0][j] for j in same)
    own = [tuple(x for j, x in enumerate(a) if j not in same) for a in copy_args]

    def call(own_i: tuple, once: tuple, shared: tuple) -> Any:
        it_own, it_once = iter(own_i), iter(once)
        return fn(*(next(it_once) if j in same else next(it_own) for j in range(n)), *shared)

    multi = jax.jit(lambda own, once, shared: [call(a, once, shared) for a in own])
    jax.block_until_ready(multi(own, once, shared))
    t0 = time.perf_counter()
    jax.block_until_ready(multi(own, once, shared))
    reps = max(1, int(min_sample_s / max(time.perf_counter() - t0, 1e-6)))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = multi(own, once, shared)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / (reps * len(own)))
    return statistics.median(times)


def fresh_like(x: jax.Array, n: int, seed: int = 0) -> list[jax.Array]:
    """`n` standard-normal arrays of x's shape and dtype (distinct inputs for in_graph_time's copies)."""
    return [jax.random.normal(jax.random.key(seed + i), x.shape, x.dtype) for i in range(n)]


def device_profile(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, calls: int = 20,
                   top: int = 8) -> dict[str, Any]:
    """The GPU's own record of `calls` back-to-back calls (jax.profiler / CUPTI): kernel-busy seconds per call
    (the sum of its kernels' durations, so host gaps between calls do not count) and the `top` kernels by time,
    in microseconds per call. Empty where the trace holds no GPU kernels (on the CPU)."""
    for a in arg_sets:
        jax.block_until_ready(fn(*a))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            for i in range(calls):
                out = fn(*arg_sets[i % len(arg_sets)])
            jax.block_until_ready(out)
        paths = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(paths[0]) if paths else None
    per_kernel: dict[str, float] = defaultdict(float)
    events = 0
    for plane in data.planes if data else []:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        # Kernel and memcpy events sit on the stream lines; the others (XLA Ops, XLA Modules, ...) repeat them.
        streams = [ln for ln in lines if ln.name.startswith("Stream")] or lines
        for line in streams:
            for ev in line.events:
                per_kernel[ev.name] += ev.duration_ns * 1e-9
                events += 1
    if not per_kernel:
        return {}
    busy = sum(per_kernel.values()) / calls
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    return {"device_busy_s": busy, "kernels_us": {k[:80]: round(v / calls * 1e6, 2) for k, v in ranked[:top]},
            "kernels_per_call": events / calls, "trace_lines": sorted({ln.name for ln in streams})[:6]}


def git_rev() -> str:
    """The revision results record: M3JAX_GIT_REV (set on the GPU machine, which has no .git), else git's short
    hash with -dirty for uncommitted changes."""
    if os.environ.get("M3JAX_GIT_REV"):
        return os.environ["M3JAX_GIT_REV"]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"
