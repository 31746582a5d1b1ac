"""Do the MoE kernels' tile sets give a (token, expert) row the same bits, on this device?

The batch-invariant mode (tiles.invariant_tiles) runs the table's entry for each token count (16-row blocks at
decode, 64 or 128 above), so that decode does not pay for blocks four times taller than it needs. That holds only
if a row's bits do not depend on the block height, N tile or K step. This checks exactly that: rows [:M] of the op
(the same tokens, their routing fixed once) against the invariant tiles' rows at the largest M, bit for bit, for
the mode's own choice at each M in --policy-m and for the table's entries (and variants) at each M in --m.

    PYTHONPATH=. python benchmarks/check_moe_invariance.py [--formats bf16 mxfp8] [--m 32 300]
    PYTHONPATH=. python benchmarks/check_moe_invariance.py --tiny --interpret --m 5 --policy-m 1 40   # CPU smoke
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_moe import ALPHA, LIMIT, SCALING, make_weights, tiles_dict
from benchmarks.timing import git_rev
from pallas_kernels.moe import kernel, layout, reference
from pallas_kernels.moe.tiles import DECODE_MAX_T, MID_MAX_T, MoeTiles, invariant_tiles, pick_tiles

FORMATS = {"bf16": "dense", "mxfp8": "mxfp8", "mxfp4": "mxfp4"}


def tile_sets(fmt: str, interpret: bool) -> dict[str, MoeTiles]:
    """The table's per-regime entries (2 tokens for decode: one token may split K) and variants."""
    if interpret:  # one tile set in interpret mode; vary the block height the way the GPU table does
        base = invariant_tiles(fmt, 1, interpret=True)
        return {"bm32": base.replace(bm=32), "bm32_tail16": base.replace(bm=32, tail_heights=(16,))}
    mid = pick_tiles(DECODE_MAX_T + 1, fmt)
    pre = pick_tiles(MID_MAX_T + 1, fmt)
    return {"decode": pick_tiles(2, fmt), "mid": mid, "mid_no_tail": mid.replace(tail_heights=()),
            "mid_bm32": mid.replace(bm=32, tail_heights=(16,)), "prefill": pre,
            "prefill_no_tail": pre.replace(tail_heights=())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["bf16", "mxfp8"], choices=tuple(FORMATS))
    ap.add_argument("--policy-m", type=int, nargs="+", default=[1, 8, 128, 129, 2048],
                    help="token counts at which the invariant tiles' own choice (tiles.invariant_tiles) is checked")
    ap.add_argument("--m", type=int, nargs="+", default=[32, 300], help="token counts for the other tile sets")
    ap.add_argument("--experts", type=int, default=16, help="routed experts (the per-row arithmetic does not "
                                                            "depend on how many; fewer keep the weights small)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (D=256, F=128) for a CPU smoke run")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/moe-invariance.json")
    args = ap.parse_args()

    E, K = args.experts, 4
    D, F = (256, 128) if args.tiny else (6144, 3072)
    dt = jnp.float32 if args.interpret else jnp.bfloat16
    w = make_weights(jax.random.PRNGKey(0), E, D, F, dt)
    max_m = max(args.m + args.policy_m)
    h = jax.random.normal(jax.random.PRNGKey(1), (max_m, D), jnp.float32).astype(dt)
    # Routing once for all M: XLA's router GEMM is not what this checks.
    idx, wts = jax.jit(functools.partial(reference.route, top_k=K))(h, w["router"], w["router_bias"])

    @functools.partial(jax.jit, static_argnames=("tiles",))
    def run(h, idx, wts, experts, tiles):
        return kernel.routed_experts_pallas(h, idx, wts, experts, shared_slot=True, routed_scaling=SCALING,
                                            alpha=ALPHA, limit=LIMIT, tiles=tiles, interpret=args.interpret)

    records = []

    def compare(name: str, set_name: str, tiles: MoeTiles, m: int, want: np.ndarray) -> None:
        got = np.asarray(run(h[:m], idx[:m], wts[:m], experts, tiles))
        diff_rows = int(np.sum(np.any(got.view(np.uint32) != want[:m].view(np.uint32), axis=1)))
        rec = {"format": name, "tiles": set_name, "m": m, "rows_differing": diff_rows,
               "max_abs_diff": float(np.max(np.abs(got - want[:m]))), "tile_shapes": tiles_dict(tiles)}
        records.append(rec)
        print(f"{name:6s} {set_name:16s} M={m:5d}: {diff_rows}/{m} rows differ from the invariant tiles at "
              f"M={max_m} (max |diff| {rec['max_abs_diff']:.3g})", flush=True)

    for name in args.formats:
        fmt = FORMATS[name]
        experts = w["dense"] if fmt == "dense" else layout.quantize_experts(w["dense"], fmt)
        want = np.asarray(run(h, idx, wts, experts, invariant_tiles(fmt, max_m, interpret=args.interpret)))
        for m in args.policy_m:  # the mode's own choice at each token count
            compare(name, "invariant", invariant_tiles(fmt, m, interpret=args.interpret), m, want)
        for set_name, tiles in tile_sets(fmt, args.interpret).items():
            for m in args.m:
                compare(name, set_name, tiles, m, want)
    dev = jax.devices()[0]
    out = {"device": f"{dev.device_kind} ({jax.default_backend()})", "rev": git_rev(), "experts": E, "top_k": K,
           "d_model": D, "d_ff": F, "reference_m": max_m, "records": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
