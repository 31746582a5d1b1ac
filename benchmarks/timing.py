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


def _gpu_trace(run: Callable[[], Any]) -> tuple[list[tuple[int, int, str]], dict[str, dict[str, str]],
                                                 list[str]]:
    """Run `run()` under the GPU's trace (jax.profiler / CUPTI): its kernel and memcpy events as (start ns, end ns,
    name), sorted; the trace's stats of each name's first event (`hlo_op`, `tf_op`, ...); the stream lines'
    names. Events are taken from the stream lines (the other lines, XLA Ops and XLA Modules, repeat them).
    Empty on the CPU."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            run()
        paths = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(paths[0]) if paths else None
    events: list[tuple[int, int, str]] = []
    stats: dict[str, dict[str, str]] = {}
    names: set[str] = set()
    for plane in data.planes if data else []:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        for line in [ln for ln in lines if ln.name.startswith("Stream")] or lines:
            names.add(line.name)
            for ev in line.events:
                events.append((ev.start_ns, ev.start_ns + ev.duration_ns, ev.name))
                if ev.name not in stats:
                    stats[ev.name] = {k: str(v) for k, v in ev.stats}
    return sorted(events), stats, sorted(names)


def device_profile(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, calls: int = 20,
                   top: int = 8) -> dict[str, Any]:
    """The GPU's own record of `calls` back-to-back calls: kernel-busy seconds per call (the sum of its kernels'
    durations, so host gaps between calls do not count) and the `top` kernels by time, in microseconds per call.
    Empty where the trace holds no GPU kernels (on the CPU)."""
    for a in arg_sets:
        jax.block_until_ready(fn(*a))

    def run() -> None:
        out = None
        for i in range(calls):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)

    events, _, lines = _gpu_trace(run)
    per_kernel: dict[str, float] = defaultdict(float)
    for start, end, name in events:
        per_kernel[name] += (end - start) * 1e-9
    if not per_kernel:
        return {}
    busy = sum(per_kernel.values()) / calls
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    return {"device_busy_s": busy, "kernels_us": {k[:80]: round(v / calls * 1e6, 2) for k, v in ranked[:top]},
            "kernels_per_call": len(events) / calls, "trace_lines": lines[:6]}


def device_timeline(fn: Callable[..., Any], *, calls: int = 3, gaps: int = 12,
                    min_gap_us: float = 5.0) -> dict[str, Any]:
    """Where the device idles inside one call of `fn()`: each of `calls` calls runs alone (waited for) under the
    GPU trace. Per call: the span from its first kernel's start to its last kernel's end, the kernels' busy
    time, and the idle time between them; for the median call, the `gaps` longest idle stretches of at least
    `min_gap_us`, each with the kernels either side and its offset from the first kernel, and its `gaps` * 2
    costliest kernels with the HLO op and the JAX name stack (`tf_op`: the jitted function, scopes and primitive)
    that the trace names for each (to tell apart kernels of the same name). A call whose wall time is well
    over its span waits on the host before its first kernel or after its last; idle inside the span is the
    host launching kernels more slowly than the device runs them (or a wait inside the graph). Empty on the
    CPU."""
    jax.block_until_ready(fn())
    walls: list[float] = []
    pause_s = 0.02  # between calls: a clear break in the trace, where the calls are told apart

    def run() -> None:
        for _ in range(calls):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            walls.append(time.perf_counter() - t)
            time.sleep(pause_s)

    events, stats, _ = _gpu_trace(run)
    if not events:
        return {}
    groups: list[list[tuple[int, int, str]]] = []
    last_end = None
    for ev in events:
        if last_end is None or ev[0] - last_end > pause_s * 1e9 / 2:
            groups.append([])
        groups[-1].append(ev)
        last_end = ev[1] if last_end is None else max(last_end, ev[1])
    per_call = []
    for g in groups:
        start, end = g[0][0], max(e[1] for e in g)
        busy, idle, covered, holes = 0, 0, start, []
        for i, (s, e, name) in enumerate(g):
            if s > covered:
                idle += s - covered
                if (s - covered) / 1e3 >= min_gap_us:
                    holes.append({"us": round((s - covered) / 1e3, 1), "at_us": round((covered - start) / 1e3, 1),
                                  "after": g[i - 1][2][:60] if i else "", "before": name[:60]})
            busy += e - s
            covered = max(covered, e)
        per_call.append({"span_us": round((end - start) / 1e3, 1), "busy_us": round(busy / 1e3, 1),
                         "idle_us": round(idle / 1e3, 1), "kernels": len(g),
                         "gaps": sorted(holes, key=lambda h: -h["us"])[:gaps]})
    i_mid = sorted(range(len(per_call)), key=lambda i: per_call[i]["span_us"])[len(per_call) // 2]
    by_kernel: dict[str, float] = defaultdict(float)
    for s, e, name in groups[i_mid]:
        by_kernel[name] += (e - s) / 1e3
    costliest = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:2 * gaps]

    def origin(name: str) -> str:
        st = stats.get(name, {})
        return f"{st.get('hlo_op', '')} | {st.get('tf_op', '')}"[:200]

    return {"wall_us": [round(w * 1e6, 1) for w in walls], "calls": [{k: v for k, v in c.items() if k != "gaps"}
                                                                     for c in per_call],
            "median_call_gaps": per_call[i_mid]["gaps"],
            "median_call_kernels": [{"kernel": k[:80], "us": round(us, 1), "origin": origin(k)}
                                    for k, us in costliest]}


def rel_err(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| in fp32 on the host: a kernel's output against its reference."""
    import numpy as np

    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def triton_kernels_only() -> None:
    """From here on, the Triton kernels where the Hopper dispatch would pick the Mosaic GPU ones (the "before"
    of a Mosaic kernel, in the same process setup): the two names the tile tables ask, patched as
    tests/test_step_lowering.py patches them. The executable cache's key does not see it: compile afresh."""
    import pallas_kernels.attention.dispatch as attention_dispatch
    import pallas_kernels.moe.kernel as moe_kernel

    attention_dispatch.wgmma_device = moe_kernel.wgmma_device = lambda: False


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
