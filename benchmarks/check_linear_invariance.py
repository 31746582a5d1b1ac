"""Does the linear kernel's batch-invariant mode give a row the same bits at every row count, on this device?

For each projection shape of a preset (K x N, the dtypes the model runs), row 0 of `linear(x[:M])` with the
invariant tiles is compared bitwise across M, and with the K split forced across programs (`spread`) against
inside each program (`in_program`) at one M. Also the largest difference from XLA's fp32 product (correctness).
The CPU tests hold this in interpret mode (tests/test_batch_invariant.py); the compiled Triton kernels may not.

    PYTHONPATH=. python benchmarks/check_linear_invariance.py [--model m3-slice-1moe] [--m 1 32 300 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import git_rev


def shapes(cfg) -> dict[str, tuple[int, int, str]]:
    """{name: (K, N, kind)} of the products the batch-invariant mode runs through the linear kernel. kind "bf16":
    a bf16 projection (`linear`); "router": bf16 activations times the fp32 router, "norm_sum": fp32 squares times
    bf16 ones (both `linear_fp32`, fp32 out)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    return {"q": (d, cfg.num_heads * hd, "bf16"), "kv": (d, cfg.num_kv_heads * hd, "bf16"),
            "o": (cfg.num_heads * hd, d, "bf16"), "mlp_up": (d, cfg.dense_intermediate_size, "bf16"),
            "mlp_down": (cfg.dense_intermediate_size, d, "bf16"), "router": (d, cfg.num_experts, "router"),
            "norm_sum": (d, 16, "norm_sum"), "head_norm_sum": (hd, 16, "norm_sum")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="m3-slice-1moe")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32, 300, 2048])
    ap.add_argument("--impl", default="pallas", choices=("pallas", "interpret"))
    ap.add_argument("--alt-tiles", nargs="*", default=[],
                    help="bm,bn,bk,warps,stages: tiles to compare bitwise with the invariant ones at the largest M "
                         "(the same K split). Equal on the device means prefill may run them in the invariant mode")
    ap.add_argument("--out", default="benchmarks/results/linear-invariance.json")
    args = ap.parse_args()

    from m3jax.config import preset
    from pallas_kernels.linear import dispatch, kernel

    cfg = preset(args.model)
    records = []
    for name, (k, n, dt) in shapes(cfg).items():
        key = jax.random.key(k * 7 + n)
        x = jax.random.normal(key, (max(args.m), k), jnp.float32)
        w = jax.random.normal(jax.random.fold_in(key, 1), (k, n), jnp.float32) / np.sqrt(k)
        if dt == "bf16":
            x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
            product = functools.partial(dispatch.linear, impl=args.impl, invariant=True)
        else:
            x = x.astype(jnp.bfloat16) if dt == "router" else x * x
            w = w if dt == "router" else jnp.ones_like(w, jnp.bfloat16)
            product = functools.partial(dispatch.linear_fp32, impl=args.impl)
        run = jax.jit(product)
        rows = {m: np.asarray(run(x[:m], w)[:1].astype(jnp.float32)) for m in args.m}
        base = rows[min(args.m)]
        ref = np.asarray(jnp.dot(x[:1].astype(jnp.float32), w.astype(jnp.float32),
                                 precision=jax.lax.Precision.HIGHEST))
        rec = {"op": "linear_row_invariance", "case": name, "shape": {"k": k, "n": n}, "dtype": dt,
               "tiles": str(dispatch.tiles_for(1, k, n, args.impl, True)) if dt == "bf16" else "linear_fp32",
               "row0_max_abs_diff_by_m": {str(m): float(np.max(np.abs(r - base))) for m, r in rows.items()},
               "max_abs_err_vs_fp32": float(np.max(np.abs(base - ref)))}
        # The same M with the split forced across programs and forced inside each program.
        m = max(args.m)
        forced = {}
        for mode in (False, True):
            orig = kernel._in_program
            kernel._in_program = lambda tiles, blocks, n_tiles, mode=mode: tiles.split > 1 and mode
            try:
                f = jax.jit(lambda x, w, product=product: product(x, w))  # a new jit traces the patched choice
                forced[mode] = np.asarray(f(x[:m], w).astype(jnp.float32))
            finally:
                kernel._in_program = orig
        rec["spread_vs_in_program_max_abs_diff"] = float(np.max(np.abs(forced[False] - forced[True])))
        rec["invariant"] = max(rec["row0_max_abs_diff_by_m"].values()) == 0 and \
            rec["spread_vs_in_program_max_abs_diff"] == 0
        # Other tile shapes over the same K order (same split and bk-step sequence of MMAs): same bits?
        base_tiles = dispatch.tiles_for(m, k, n, args.impl, True)
        rec["alt_tiles_max_abs_diff"] = {}
        for spec in args.alt_tiles if dt == "bf16" else ():
            bm, bn, bk, warps, stages = (int(v) for v in spec.split(","))
            alt = dataclasses.replace(base_tiles, bm=bm, bn=min(bn, n), bk=bk, warps=warps, stages=stages)
            if n % alt.bn or k % (alt.bk * alt.split):
                continue
            f = jax.jit(lambda x, w, alt=alt: kernel.linear(x, w, tiles=alt, interpret=args.impl == "interpret"))
            got = np.asarray(f(x[:m], w).astype(jnp.float32))
            rec["alt_tiles_max_abs_diff"][spec] = float(np.max(np.abs(got - forced[True])))
        rec.update(device=jax.devices()[0].device_kind, git_rev=git_rev())
        print(json.dumps(rec), flush=True)
        records.append(rec)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
