"""Does a `lax.cond` make the host wait for the device at dispatch, and does an XLA flag stop it?

The engine overlaps step N+1's dispatch with step N on the device; a conditional whose predicate XLA reads back
on the host ends that overlap. Each case runs a jitted function of ~`--work-ms` of device work with a predicate
computed from its result, then a conditional (or the same choice made branch-free with `jnp.where`), and
times how long the call takes to return (dispatch) against the call plus `block_until_ready` (total). A
dispatch close to the total means the host waited. Each XLA_FLAGS variant runs in its own process (the flags
are read once, at backend start-up); a variant whose flag this XLA does not know fails and says so.

    PYTHONPATH=. python benchmarks/probe_cond_dispatch.py --out cond-dispatch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = {
    "default": "",
    "cmdbuf+conditional": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                          "CONDITIONAL,WHILE",
    "cmdbuf+conditional,min1": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                               "CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1",
    "cmdbuf-off": "--xla_gpu_enable_command_buffer=",
}


def child(work_ms: float, reps: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax import lax

    n = 4096
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16) * (n ** -0.5)
    # Calibrate the chain length to about work_ms of device time.
    one = jax.jit(lambda a: a @ x)
    one(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(20):
        y = one(x)
    y.block_until_ready()
    per = (time.perf_counter() - t0) / 20
    chain = max(1, round(work_ms / 1e3 / per))

    def work(a: jax.Array) -> jax.Array:
        return lax.fori_loop(0, chain, lambda i, b: (b @ x).astype(jnp.bfloat16), a)

    # Branches with real work (two matmuls each, different ones), so that XLA keeps a conditional rather than
    # turning it into a select, as it may for elementwise branches.
    def yes(v: jax.Array) -> jax.Array:
        return ((v @ x).astype(jnp.bfloat16) @ x).astype(jnp.bfloat16)

    def no(v: jax.Array) -> jax.Array:
        return ((v @ x.T).astype(jnp.bfloat16) @ x.T).astype(jnp.bfloat16)

    def with_cond(a: jax.Array) -> jax.Array:
        b = work(a)
        return lax.cond(jnp.sum(b.astype(jnp.float32)) > 0, yes, no, b)

    def branch_free(a: jax.Array) -> jax.Array:  # the same result without a conditional: both branches computed
        b = work(a)
        return jnp.where(jnp.sum(b.astype(jnp.float32)) > 0, yes(b), no(b))

    def cond_in_scan(a: jax.Array) -> jax.Array:  # the MSA layer's shape of it: a conditional per scanned layer
        def body(b: jax.Array, _: None) -> tuple[jax.Array, None]:
            b = lax.fori_loop(0, max(1, chain // 4), lambda i, c: (c @ x).astype(jnp.bfloat16), b)
            return lax.cond(jnp.sum(b.astype(jnp.float32)) > 0, yes, no, b), None
        return lax.scan(body, a, None, length=4)[0]

    def unrolled_cond(a: jax.Array) -> jax.Array:  # no loop at all: the work as straight-line matmuls, then a cond
        for _ in range(min(chain, 64)):
            a = (a @ x).astype(jnp.bfloat16)
        return lax.cond(jnp.sum(a.astype(jnp.float32)) > 0, yes, no, a)

    def unrolled_free(a: jax.Array) -> jax.Array:
        for _ in range(min(chain, 64)):
            a = (a @ x).astype(jnp.bfloat16)
        return jnp.where(jnp.sum(a.astype(jnp.float32)) > 0, yes(a), no(a))

    out: dict[str, Any] = {"chain": chain, "matmul_ms": per * 1e3, "device": str(jax.devices()[0])}
    for name, fn in (("branch_free", branch_free), ("cond", with_cond), ("cond_in_scan", cond_in_scan),
                     ("unrolled_free", unrolled_free), ("unrolled_cond", unrolled_cond)):
        f = jax.jit(fn)
        f(x).block_until_ready()
        dispatch, total = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            y = f(x)
            t1 = time.perf_counter()
            y.block_until_ready()
            t2 = time.perf_counter()
            dispatch.append((t1 - t0) * 1e3)
            total.append((t2 - t0) * 1e3)
        out[name] = {"dispatch_ms": statistics.median(dispatch), "total_ms": statistics.median(total)}
        print(name, out[name], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-ms", type=float, default=20.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--variants", nargs="*", default=["default", "cmdbuf+conditional,min1"])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.work_ms, args.reps)), flush=True)
        return
    records = []
    for name in args.variants:
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + VARIANTS[name]).strip())
        cmd = [sys.executable, __file__, "--child", "--work-ms", str(args.work_ms), "--reps", str(args.reps)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        rec: dict[str, Any] = {"op": "cond_dispatch", "variant": name, "xla_flags": VARIANTS[name]}
        if p.returncode == 0 and lines:
            rec.update(json.loads(lines[-1][len("RESULT "):]))
        else:
            rec["error"] = (p.stderr or p.stdout)[-1500:]
        print(json.dumps(rec), flush=True)
        records.append(rec)
    if args.out:
        args.out.write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
