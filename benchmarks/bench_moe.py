"""MoE kernels vs the ragged_dot reference at M3 shapes (128 experts + shared, 6144 -> 3072, top-4).

For each token count T and weight format (bf16, MXFP8, MXFP4) it checks the Pallas path against the reference
run on the same (dequantised) weights, then times both with the same routing (median over repetitions after
warm-up; several inputs rotated; routing from a random fp32 router, so about 1 - (1 - 4/128)^T of the experts
are touched). The timed op is the MoE given the routing: sort-and-pad + two kernels + combine, against sort +
three ragged_dots + scatter-add + the shared expert's dense MLP.

Floor: max(touched expert bytes / HBM bandwidth, FLOPs / bf16 peak) with touched = distinct routed experts + the
shared one, FLOPs = 2 * T * (k + 1) * 3 * D * F. After the main table, a sweep of tile candidates per regime
(deadline-bounded) shows which table entry wins; `--sweep 0` skips it.

    PYTHONPATH=. python benchmarks/bench_moe.py --out benchmarks/results/moe-h200.json
    PYTHONPATH=. python benchmarks/bench_moe.py --tiny --interpret --tokens 3 17   # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.devicewarm import gpu_state, warm_up_device
from benchmarks.timing import IN_GRAPH_COPIES, device_profile, fresh_like, git_rev, in_graph_time
from pallas_kernels.moe import kernel, layout, reference
from pallas_kernels.moe.tiles import INTERPRET_TILES, KernelTiles, MoeTiles, pick_tiles, regime

FORMATS = {"bf16": "dense", "mxfp8": "mxfp8", "mxfp4": "mxfp4"}
SCALING, ALPHA, LIMIT = 2.0, 1.702, 7.0
T0 = time.perf_counter()


def _tails(tiles: MoeTiles) -> str:
    return "t" + ",".join(map(str, tiles.tail_heights)) if tiles.tail_heights else ""


def candidates(T: int, fmt: str) -> list[MoeTiles]:
    """Tile candidates to sweep besides the table's entry (all spill-free in an offline sm_90 build)."""
    k = KernelTiles
    base = pick_tiles(T, fmt)
    reg = regime(T)
    out: list[MoeTiles] = []
    if reg == "decode" and fmt != "dense":
        # Deeper pipelines, first (--sweep-first 4): since the scale words travel with the weight tiles as async
        # copies, a program's bytes in flight grow with its stages, and at decode sizes the few programs per SM
        # wait on memory (offline sm_90 at T = 1: 47-48 registers and 42 KB of shared memory at 3 stages).
        def deeper(s: int, t: KernelTiles) -> KernelTiles:
            return dataclasses.replace(t, stages=s)

        out += [base.replace(gu=deeper(s, base.gu), dn=deeper(s, base.dn)) for s in (4, 5, 6)]
        out.append(base.replace(gu=deeper(5, base.gu), dn=dataclasses.replace(base.dn, stages=5, split=1)))
    if T == 1:
        # Split K: one token's 5 slots make few output tiles (240 programs for 132 SMs at the table's tiles).
        # (Twice-wide MX tiles with K split in two, so that x serves twice the widened weights per warp, were
        # slower: gate_up 77 against 54 us, moe-h200-t1-wide.json.)
        out += [base.replace(gu=dataclasses.replace(base.gu, split=g), dn=dataclasses.replace(base.dn, split=d))
                for g, d in ((2, 2), (3, 3), (2, 1), (1, 2), (1, 3), (1, 4), (1, 6)) if (g, d) != (base.gu.split,
                                                                                              base.dn.split)]
        # Narrower down tiles: twice the programs without the partials.
        out += [base.replace(dn=dataclasses.replace(base.dn, bn=64, split=d)) for d in (1, 2)]
        out.append(base.replace(gu=dataclasses.replace(base.gu, split=1), dn=dataclasses.replace(base.dn, split=1)))
    def mosaic(gu: KernelTiles, dn: KernelTiles, group: int = base.group) -> MoeTiles:
        return base.replace(bm=128, backend="mosaic", gu=gu, dn=dn, group=group, tail_heights=())

    if reg != "decode" and fmt == "mxfp8" and base.backend == "triton":
        # Mosaic GPU kernels for MXFP8 experts (moe/kernel_mgpu.py), first: each 128-deep K group widened once
        # per compute warpgroup into a bf16 tile in shared memory, then one 128-deep wgmma. Shared memory per
        # stage: 32 KB of x + 16.5 KB of words and scales per matrix and 128 columns, beside the widened tiles
        # (32 KB per matrix, 128 columns and warpgroup) and 32 KB of epilogue buffers; what fits the H200's
        # 227 KB (checked by tests/test_triton_lowering.py's Mosaic lowering): gate_up 64 columns at 2 stages,
        # down 128 columns at 2 stages or 64 at 3-4.
        # "swap" (wgmma's operands swapped: each compute warpgroup widens its own 64 columns into registers, the
        # A operand, nothing goes back to shared memory; 128 columns, gate_up at 2 stages, down at 3-4, its y
        # stored transposed), then "split" (each compute warpgroup widens half a step into a shared tile), then
        # "each" (every warpgroup the whole step), whose best at T = 8192 on the H100 was group 1
        # (moe-h100-mosaic-mx-4a2c932).
        out += [mosaic(k(128, 128, 4, 2), k(128, 128, 4, d), group=g).replace(mx_widen="swap")
                for g, d in ((1, 3), (1, 4), (16, 3))]
        split = [mosaic(k(64, 128, 4, 2), k(128, 128, 4, 2), group=g).replace(mx_widen="split") for g in (1, 16)]
        out += [*split, mosaic(k(64, 128, 4, 2), k(128, 128, 4, 2), group=1),
                mosaic(k(64, 128, 4, 2), k(64, 128, 4, 3), group=1).replace(mx_widen="split")]
    if reg != "decode" and fmt == "dense" and base.backend == "triton":
        # Mosaic GPU kernels (moe/kernel_mgpu.py), first: gate_up two 128-column B tiles, down one 256- or
        # 128-column tile, 64-deep K steps (one 128-byte swizzle), 3-4 stages (4 x 48 KB + 32 KB of epilogue
        # buffers is the most shared memory that fits).
        # T = 8192, first sweep (moe-h200-mosaic-1.json): 3 stages 10.71 ms kernel-busy, 4 stages 11.12 / 11.11
        # (256- / 128-column down), groups of 8 blocks 11.40, against the Triton table's 9.66 ms.
        out += [mosaic(k(128, 64, 4, 3), k(256, 64, 4, 3), group=g) for g in (2, 1, 4, 6)]
        out += [mosaic(k(128, 64, 4, 4), k(256, 64, 4, 4)), mosaic(k(128, 64, 4, 4), k(128, 64, 4, 4))]
    if reg == "mid" and fmt != "dense":
        # 8-warp MX tiles at mid size. The 4-warp table entry compiles (offline sm_90) to one 4-warp program per
        # SM: a 64-row gate_up takes the wgmma path, whose widened weights go back through shared memory, and
        # needs 172 registers and 123 KB. These run two 8-warp programs per SM on mma.sync with the weights
        # widened in registers, warps splitting N (no warp widens another's columns).
        g8, d8 = k(64, 128, 8, 3), k(128, 128, 8, 3)
        out += [base.replace(gu=g8, dn=k(64, 128, 8, 3)), base.replace(bm=32, gu=g8, dn=d8, tail_heights=(16,)),
                base.replace(bm=16, gu=g8, dn=d8, tail_heights=())]
    if reg == "prefill" and fmt != "dense":
        # The mid-size MXFP8 lesson at prefill size: 64 rows at 8 warps and 3 stages fit two programs per SM
        # (offline sm_90: 116 / 83 registers), against one for the table's 128-row blocks.
        out.append(base.replace(bm=64, tail_heights=(32,), gu=k(64, 128, 8, 3), dn=k(64, 128, 8, 3)))
    if reg != "decode" and base.bm >= 32:
        # Short tail blocks (kernel._for_used_block): off or halves, then halves and quarters; first, so
        # --sweep-first 2 is that A/B/C.
        half, quarters = (base.bm // 2,), (base.bm // 4, base.bm // 2)
        out += [base.replace(tail_heights=h) for h in ((() if base.tail_heights else half), quarters)
                if h != base.tail_heights]
    if fmt != "dense" and base.mx_mode == "expand":
        out.append(base.replace(mx_mode="subdot") if reg != "prefill" else None)
    if reg == "decode" and fmt != "dense":
        # Around the 8-warp table entry: MX decode is bound by the in-register widening (integer pipe), not HBM.
        out += [base.replace(gu=k(32, 128, 8, 4), dn=k(64, 128, 8, 4)),
                base.replace(gu=k(64, 128, 16, 4), dn=k(128, 128, 16, 4)),
                base.replace(gu=k(64, 256, 8, 3), dn=k(128, 256, 8, 3)),
                base.replace(gu=k(128, 128, 8, 4)),
                base.replace(gu=k(64, 128, 8, 5), dn=k(128, 128, 8, 5)),
                # Fewer stages: smaller shared-memory footprint, so three 8-warp programs fit per SM.
                base.replace(gu=k(64, 128, 8, 3), dn=k(128, 128, 8, 3)),
                base.replace(gu=k(64, 128, 8, 2), dn=k(128, 128, 8, 2)),
                base.replace(gu=k(64, 128, 16, 3), dn=k(128, 128, 16, 3)),
                base.replace(gu=k(64, 128, 4, 3), dn=k(128, 128, 4, 3)),
                base.replace(gu=k(32, 128, 8, 3), dn=k(64, 128, 8, 3)),
                base.replace(gu=k(32, 128, 4, 4), dn=k(64, 128, 4, 4))]
        return [c for c in dict.fromkeys(out) if c is not None and c != base]
    if reg == "decode":
        out += [base.replace(gu=k(32, 128, 4, 4), dn=k(64, 128, 4, 4)) if T <= 8 else
                base.replace(gu=k(128, 128, 4, 4), dn=k(128, 128, 4, 4)),
                base.replace(gu=k(64, 256, 4, 3), dn=k(128, 256, 4, 3)),
                base.replace(gu=k(64, 64, 4, 6), dn=k(128, 64, 4, 6))]
    elif reg == "mid":
        out += [base.replace(bm=32) if base.bm != 32 else base.replace(bm=64),
                base.replace(bm=16, group=16),
                pick_tiles(8192, fmt).replace(regime="mid")]
    else:
        out += [base.replace(bm=64, gu=k(64, 64 if fmt == "dense" else 128, 4, 4),
                                 dn=k(128, 64 if fmt == "dense" else 128, 4, 4)),
                base.replace(group=32)]
        if fmt == "dense":
            g3 = k(128, 64, 8, 3)
            # Launch-order groups around the table's 4 (the x tiles of a group's row blocks share L2).
            out += [base.replace(group=g) for g in (1, 2, 6, 8, 16) if g != base.group]
            out += [base.replace(gu=g3), base.replace(dn=k(256, 64, 8, 4))]
        else:
            out += [base.replace(gu=k(64, 128, 8, 3), dn=k(128, 128, 8, 3))]
    return [c for c in dict.fromkeys(out) if c is not None and c != base]


def tiles_dict(t: MoeTiles) -> dict[str, Any]:
    return dataclasses.asdict(t)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def bench(fn, inputs: list[tuple], *, target_s: float = 0.03, reps: int = 5) -> float:
    """Median over `reps` of the mean time of back-to-back calls (async dispatch keeps the device busy)."""
    jax.block_until_ready(fn(*inputs[0]))
    t = time.perf_counter()
    jax.block_until_ready(fn(*inputs[1 % len(inputs)]))
    est = time.perf_counter() - t
    iters = int(min(50, max(1, target_s / max(est, 1e-6))))
    if est > 0.2:
        reps = 3
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = None
        for i in range(iters):
            out = fn(*inputs[i % len(inputs)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / iters)
    return statistics.median(times)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def make_weights(key: jax.Array, E: int, D: int, F: int, dtype: jnp.dtype) -> dict:
    ks = jax.random.split(key, 5)
    return {
        "router": jax.random.normal(ks[0], (D, E), jnp.float32) / np.sqrt(D),
        "router_bias": 0.05 * jax.random.normal(ks[1], (E,), jnp.float32),
        # Dense stacked [E + 1, K, N]: slot E is the shared expert (same width as a routed one in M3).
        "dense": {
            "gate": (jax.random.normal(ks[2], (E + 1, D, F), jnp.float32) / np.sqrt(D)).astype(dtype),
            "up": (jax.random.normal(ks[3], (E + 1, D, F), jnp.float32) / np.sqrt(D)).astype(dtype),
            "down": (jax.random.normal(ks[4], (E + 1, F, D), jnp.float32) / np.sqrt(F)).astype(dtype),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048, 8192])
    ap.add_argument("--formats", nargs="+", default=["bf16", "mxfp8", "mxfp4"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (E=8, D=256, F=128) for a CPU smoke run")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--skip-main", nargs="*", default=[], help="formats to sweep only (no main table)")
    ap.add_argument("--main-max-tokens", type=int, default=1 << 30, help="main table only up to this T")
    ap.add_argument("--sweep", type=int, default=1, help="1: time the tile candidates of each regime")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds; skip remaining work after it")
    ap.add_argument("--ref-time-max-tokens", type=int, default=1 << 30,
                    help="time the ragged_dot reference only up to this T (it takes 0.6 s a call at 8192)")
    ap.add_argument("--hbm-tbps", type=float, default=4.3)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--mx-modes", nargs="+", default=None,
                    help="MX formats: time these mx_modes too, each on the table's tiles (same weights and inputs)")
    ap.add_argument("--mx-rows", type=int, nargs="+", default=None, choices=(32, 64),
                    help="MX formats: time the table's tiles with these MoeTiles.mx_rows too")
    ap.add_argument("--layout-methods", nargs="+", default=None, choices=("compare", "argsort"),
                    help="also time the op with each sort_and_pad method forced (same tiles and inputs)")
    ap.add_argument("--sweep-cases", nargs="+", default=None, metavar="T:FORMAT",
                    help="sweep only these cases (e.g. 8192:bf16 1:mxfp8), in this order")
    ap.add_argument("--kernels-only-tokens", type=int, nargs="+", default=[1, 8, 32, 128],
                    help="also time the two kernels alone (layout precomputed) at these T")
    ap.add_argument("--sweep-check-max-tokens", type=int, default=2048,
                    help="check sweep candidates against the reference only up to this T")
    ap.add_argument("--sweep-first", type=int, default=1000, help="sweep only the first N candidates of each case")
    ap.add_argument("--sweep-table", action="store_true",
                    help="time each sweep case's table tiles first, as a sweep row (no reference check past "
                         "--sweep-check-max-tokens), and the Triton table's beside a Mosaic GPU entry: the table "
                         "beside its candidates where the main table's 8192-token reference does not fit, as on "
                         "an 80 GB card")
    ap.add_argument("--gather-ab-tokens", type=int, nargs="*", default=[],
                    help="A/B the in-kernel x gather against an XLA row copy first at these T")
    ap.add_argument("--in-graph-max-tokens", type=int, default=128,
                    help=f"also time the op in one jitted program of {IN_GRAPH_COPIES} copies (timing.py) up to "
                         "this T")
    ap.add_argument("--out", default="benchmarks/results/moe-h200.json")
    args = ap.parse_args()

    E, D, F, K = (8, 256, 128, 2) if args.tiny else (128, 6144, 3072, 4)
    dt = jnp.float32 if args.interpret else jnp.bfloat16
    dev = jax.devices()[0]
    device = f"{dev.device_kind} ({jax.default_backend()})"
    rev = git_rev()
    w = make_weights(jax.random.PRNGKey(0), E, D, F, dt)
    jax.block_until_ready(w)
    state: dict[str, str] = {}
    if not args.interpret:
        warm_up_device(5.0)
        state = gpu_state()
        log(f"gpu state after warm-up: {state}")
    log(f"weights ready on {device}, jax {jax.__version__}, rev {rev}")
    slot_bytes = {"bf16": 3 * D * F * 2, "mxfp8": 3 * D * F * (1 + 1 / 32), "mxfp4": 3 * D * F * (0.5 + 1 / 32)}
    results: list[dict[str, Any]] = []
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out_path.write_text(json.dumps(results, indent=1) + "\n")

    route = jax.jit(functools.partial(reference.route, top_k=K))
    inputs: dict[int, list[tuple]] = {}
    touched: dict[int, int] = {}
    graph_inputs: dict[int, list[tuple]] = {}
    graph_touched: dict[int, float] = {}
    for T in args.tokens:
        hs = [jax.random.normal(jax.random.PRNGKey(100 + T * 7 + i), (T, D), jnp.float32).astype(dt) for i in range(3)]
        inputs[T] = [(h, *route(h, w["router"], w["router_bias"])) for h in hs]
        touched[T] = int(np.mean([len(np.unique(np.asarray(i))) for _, i, _ in inputs[T]])) + 1
        if args.in_graph_max_tokens >= T:  # timing.in_graph_time: each copy its own tokens and routing
            hs = fresh_like(jnp.zeros((T, D), dt), IN_GRAPH_COPIES, seed=5000 + T)
            graph_inputs[T] = [(h, *route(h, w["router"], w["router_bias"])) for h in hs]
            graph_touched[T] = float(np.mean([len(np.unique(np.asarray(i))) for _, i, _ in graph_inputs[T]])) + 1

    @functools.partial(jax.jit, static_argnames=("tiles", "layout_method"))
    def run_kernel(h, idx, wts, experts, tiles, layout_method=None):
        return kernel.routed_experts_pallas(h, idx, wts, experts, shared_slot=True, routed_scaling=SCALING,
                                            alpha=ALPHA, limit=LIMIT, tiles=tiles, layout_method=layout_method,
                                            interpret=args.interpret)

    @jax.jit
    def run_reference(h, idx, wts, rp):
        out = reference.routed_experts(h, idx, wts, rp["w_gate"], rp["w_up"], rp["w_down"], alpha=ALPHA,
                                       limit=LIMIT) * SCALING
        s = rp["shared"]
        return out + reference.dense_mlp(h, s["w_gate"], s["w_up"], s["w_down"], alpha=ALPHA, limit=LIMIT)

    def floor(T: int, fmt: str, touched_slots: float | None = None) -> float:
        flops = 2 * T * (K + 1) * 3 * D * F
        byts = (touched_slots or touched[T]) * slot_bytes[fmt] + 2 * T * D * 2
        return max(byts / (args.hbm_tbps * 1e12), flops / (args.peak_tflops * 1e12))

    def measure(T: int, fmt: str, experts: dict, rp: dict | None, tiles: MoeTiles, ref_time: float | None,
                op: str, layout_method: str | None = None) -> dict[str, Any]:
        rec: dict[str, Any] = {"op": op, "shape": {"T": T, "E": E, "D": D, "F": F, "top_k": K, "shared": 1},
                               "dtype": fmt, "tiles": tiles_dict(tiles), "device": device, "git_rev": rev,
                               "jax": jax.__version__, "touched_slots": touched[T],
                               "layout_method": layout_method or "auto", "gpu_state": state}
        fn = functools.partial(run_kernel, experts=experts, tiles=tiles, layout_method=layout_method)
        try:
            t = time.perf_counter()
            got = jax.block_until_ready(fn(*inputs[T][0]))
            rec["compile_s"] = time.perf_counter() - t
            if rp is not None:
                want = run_reference(*inputs[T][0], rp).astype(jnp.float32)
                got32 = got.astype(jnp.float32)
                rec["rel_err"] = float(jnp.linalg.norm(got32 - want) / jnp.linalg.norm(want))
                rec["max_abs_err"] = float(jnp.max(jnp.abs(got32 - want)))
                again = fn(*inputs[T][0])
                rec["deterministic"] = bool(jnp.array_equal(got, again))
                rec["finite"] = bool(jnp.all(jnp.isfinite(got32)))
            rec["time_s"] = bench(fn, inputs[T])
            rec["floor_s"] = floor(T, fmt)
            rec["ratio"] = rec["time_s"] / rec["floor_s"]
            rec["reference_time_s"] = ref_time
            rec["speedup_vs_reference"] = ref_time / rec["time_s"] if ref_time else None
            rec["weight_tbps"] = touched[T] * slot_bytes[fmt] / rec["time_s"] / 1e12
            rec["tflops"] = 2 * T * (K + 1) * 3 * D * F / rec["time_s"] / 1e12
            if op in ("moe_experts", "moe_sweep"):
                prof = device_profile(fn, inputs[T], calls=2 if args.interpret else 20)
                rec.update(prof)
                if "device_busy_s" in prof:
                    rec["ratio_device"] = prof["device_busy_s"] / rec["floor_s"]
            if op == "moe_experts" and T in graph_inputs:
                def one(h, idx, wts, ex):
                    return run_kernel(h, idx, wts, ex, tiles=tiles, layout_method=layout_method)
                rec["time_in_graph_s"] = in_graph_time(one, graph_inputs[T], shared=(experts,),
                                                       samples=3 if args.interpret else 15)
                rec["floor_in_graph_s"] = floor(T, fmt, graph_touched[T])
                rec["ratio_in_graph"] = rec["time_in_graph_s"] / rec["floor_in_graph_s"]
        except Exception as e:  # one failing config must not lose the rest of the run
            rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            traceback.print_exc(limit=3)
        results.append(rec)
        save()
        err = rec.get("error", "")[:200]
        def kt(t: KernelTiles) -> str:
            return f"{t.bn}/{t.bk}/{t.warps}/{t.stages}" + (f"/s{t.split}" if t.split > 1 else "")

        backend = tiles.backend + ("/" + tiles.mx_widen if tiles.backend == "mosaic" else "")

        log(f"{op:12s} T={T:5d} {fmt:6s} bm={tiles.bm:3d}{_tails(tiles)} gu={kt(tiles.gu)} "
            f"dn={kt(tiles.dn)} g={tiles.group} {backend} "
            f"{tiles.mx_mode:6s} r{tiles.mx_rows} {layout_method or '':7s} time={rec.get('time_s', 0) * 1e3:8.3f}ms "
            f"ratio={rec.get('ratio', 0):5.2f} "
            + (f"in-graph={rec['time_in_graph_s'] * 1e3:8.3f}ms ({rec['ratio_in_graph']:.2f}) "
               if "ratio_in_graph" in rec else "")
            + (f"busy={rec['device_busy_s'] * 1e3:8.3f}ms ({rec['ratio_device']:.2f}) {rec.get('kernels_us')} "
               if "ratio_device" in rec else "") +
            f"ref={(ref_time or 0) * 1e3:8.3f}ms err={rec.get('rel_err', -1):.2e} {err}")
        return rec

    ref_times: dict[int, float] = {}
    experts_by_fmt: dict[str, dict] = {}
    rp_by_fmt: dict[str, dict] = {}
    for name in args.formats:
        fmt = FORMATS[name]
        # jit: fused quantisation, no full-size float intermediates on the device.
        experts = jax.block_until_ready(jax.jit(layout.quantize_experts, static_argnums=1)(w["dense"], fmt))
        experts_by_fmt[name] = experts
        if name in args.skip_main:
            continue
        # The reference computes with the same (dequantised) weights the kernel reads.
        rp = jax.jit(layout.reference_params, static_argnums=1)(
            {"router": w["router"], "router_bias": w["router_bias"], "experts": experts}, dt)
        for T in args.tokens:
            if time.perf_counter() - T0 > args.deadline:
                log("deadline: skipping the rest of the main table")
                break
            if args.main_max_tokens < T:
                continue
            if (name == "bf16" or T not in ref_times) and args.ref_time_max_tokens >= T:
                try:
                    jax.block_until_ready(run_reference(*inputs[T][0], rp))
                    ref_times[T] = bench(functools.partial(run_reference, rp=rp), inputs[T])
                except Exception as e:
                    log(f"reference failed at T={T}: {e}")
            # The table's tiles as the engine picks them on this device (the Mosaic entry on a Hopper GPU).
            tiles = kernel.kernel_tiles(T, experts, interpret=args.interpret)
            rec = measure(T, name, experts, rp, tiles, ref_times.get(T), "moe_experts")
            if "error" in rec and fmt != "dense" and tiles.mx_mode == "expand":
                measure(T, name, experts, rp, tiles.replace(mx_mode="subdot"), ref_times.get(T), "moe_experts")
            for method in args.layout_methods or []:
                measure(T, name, experts, rp, tiles, ref_times.get(T), "moe_layout", layout_method=method)
            if fmt != "dense" and not args.interpret:
                for mode in args.mx_modes or []:
                    if mode != tiles.mx_mode:
                        measure(T, name, experts, rp, tiles.replace(mx_mode=mode), ref_times.get(T), "moe_mx_mode")
                for r in args.mx_rows or []:
                    if r != tiles.mx_rows and (fmt == "mxfp8" or r == 32):  # MXFP4 words: 32-row pieces only
                        measure(T, name, experts, rp, tiles.replace(mx_rows=r), ref_times.get(T), "moe_mx_rows")
        if args.sweep:
            rp_by_fmt[name] = rp  # the sweep checks each candidate against it too
        del rp

    # The two kernels alone (layout precomputed): what the glue (sort and combine) adds at decode sizes.
    @functools.partial(jax.jit, static_argnames=("tiles",))
    def run_kernels_only(h_TD, row_token_M, slot_B, rows_B, experts, tiles):
        act = kernel.gate_up(h_TD, row_token_M, slot_B, rows_B, experts, tiles, alpha=ALPHA, limit=LIMIT,
                             interpret=args.interpret)
        return kernel.down(act, slot_B, rows_B, experts, tiles, interpret=args.interpret)

    for T in [t for t in args.tokens if t in args.kernels_only_tokens]:
        for name in [f for f in args.formats if f not in args.skip_main]:
            if time.perf_counter() - T0 > args.deadline:
                break
            fmt = FORMATS[name]
            tiles = INTERPRET_TILES if args.interpret else pick_tiles(T, fmt)
            rec = {"op": "moe_kernels_only", "shape": {"T": T, "E": E, "D": D, "F": F, "top_k": K, "shared": 1},
                   "dtype": name, "tiles": tiles_dict(tiles), "device": device, "git_rev": rev}
            try:
                sp = jax.jit(functools.partial(kernel.sort_and_pad, num_slots=E + 1, shared_slot=True, bm=tiles.bm,
                                               routed_scaling=SCALING))
                lay_inputs = []
                for h, idx, wts in inputs[T]:
                    lay = sp(idx, wts)
                    lay_inputs.append((h, lay.row_token_M, lay.slot_B, lay.rows_B))
                rec["time_s"] = bench(functools.partial(run_kernels_only, experts=experts_by_fmt[name], tiles=tiles),
                                      lay_inputs)
                rec["floor_s"] = floor(T, name)
                rec["ratio"] = rec["time_s"] / rec["floor_s"]
                rec["weight_tbps"] = touched[T] * slot_bytes[name] / rec["time_s"] / 1e12
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            results.append(rec)
            save()
            log(f"kernels only T={T:5d} {name:6s} time={rec.get('time_s', 0) * 1e3:8.3f}ms "
                f"ratio={rec.get('ratio', 0):5.2f} {rec.get('error', '')[:200]}")

    # A/B of where x's rows are gathered: inside gate_up's loads (the library's path) or by an XLA gather that
    # writes the [M, D] row copy first (the path before rev dd3054b), same tiles and inputs.
    @functools.partial(jax.jit, static_argnames=("tiles",))
    def run_copy_x(h, idx, wts, experts, tiles):
        lay = kernel.sort_and_pad(idx, wts, num_slots=E + 1, shared_slot=True, bm=tiles.bm, routed_scaling=SCALING)
        x_MD = h[lay.row_token_M]
        act = kernel.gate_up(x_MD, jnp.arange(x_MD.shape[0], dtype=jnp.int32), lay.slot_B, lay.rows_B, experts,
                             tiles, alpha=ALPHA, limit=LIMIT, interpret=args.interpret)
        y = kernel.down(act, lay.slot_B, lay.rows_B, experts, tiles, interpret=args.interpret)
        return kernel.combine(y, lay.dest_TJ, lay.w_TJ)

    for T in [t for t in args.tokens if t in args.gather_ab_tokens]:
        for name in [f for f in args.formats if f not in args.skip_main]:
            if time.perf_counter() - T0 > args.deadline:
                break
            ex = experts_by_fmt[name]
            tiles = kernel.kernel_tiles(T, ex, interpret=args.interpret)
            for variant, f in (("in_kernel", functools.partial(run_kernel, experts=ex, tiles=tiles)),
                               ("xla_copy", functools.partial(run_copy_x, experts=ex, tiles=tiles))):
                rec = {"op": "moe_x_gather_ab", "variant": variant, "dtype": name, "tiles": tiles_dict(tiles),
                       "shape": {"T": T, "E": E, "D": D, "F": F, "top_k": K, "shared": 1}, "device": device,
                       "git_rev": rev, "gpu_state": state}
                try:
                    rec["time_s"] = bench(f, inputs[T])
                    rec.update(device_profile(f, inputs[T], calls=2 if args.interpret else 20))
                    rec["floor_s"] = floor(T, name)
                    rec["ratio"] = rec["time_s"] / rec["floor_s"]
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
                results.append(rec)
                save()
                log(f"x gather A/B T={T:5d} {name:6s} {variant:9s} time={rec.get('time_s', 0) * 1e3:8.3f}ms "
                    f"busy={rec.get('device_busy_s', 0) * 1e3:8.3f}ms {rec.get('kernels_us')} "
                    f"{rec.get('error', '')[:200]}")

    if args.sweep and not args.interpret:
        sweep_fmts = [f for f in ("bf16", "mxfp8", "mxfp4") if f in experts_by_fmt]
        # Most telling first (the targets: decode and the largest prefill), so that a deadline cut loses the least.
        order = [(1, "mxfp8"), (32, "mxfp8"), (128, "mxfp8"), (8, "mxfp8"), (8192, "bf16"), (1, "bf16"),
                 (2048, "bf16"), (512, "bf16"), (8192, "mxfp8"), (2048, "mxfp8"), (32, "bf16"), (128, "bf16"),
                 (8, "bf16"), (512, "mxfp8")]
        if args.sweep_cases:
            order = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.sweep_cases]
        order = [(T, f) for T, f in order if T in args.tokens and f in sweep_fmts]
        plan = []
        for T, name in order:
            table = [kernel.kernel_tiles(T, experts_by_fmt[name])] if args.sweep_table else []
            if table and table[0].backend != "triton":  # and the Triton table's entry that the Mosaic one replaced
                table.append(kernel.kernel_tiles(T, experts_by_fmt[name], tiles=pick_tiles(T, FORMATS[name])))
            plan += [(T, name, c) for c in table + candidates(T, FORMATS[name])[:args.sweep_first]]
        for T, name, c in plan:
            if time.perf_counter() - T0 > args.deadline:
                log("deadline: stopping the sweep")
                break
            # The reference check at T = 8192 needs ~48 GB beside two formats' weights (out of memory in the
            # tail-height A/B run): larger sweeps time only; the main table checked these inputs.
            rp = rp_by_fmt.get(name) if args.sweep_check_max_tokens >= T else None
            measure(T, name, experts_by_fmt[name], rp, c, ref_times.get(T), "moe_sweep")
    save()
    log(f"wrote {len(results)} records to {out_path}")
    print("\n| T | dtype | time ms | floor ms | ratio | in-graph ms | in-graph ratio | kernel-busy ms | busy ratio | "
          "ragged_dot ms | speedup | rel err |")
    for r in results:
        if r["op"] == "moe_experts" and "time_s" in r:
            g = (f"{r['time_in_graph_s'] * 1e3:.3f} | {r['ratio_in_graph']:.2f}" if "ratio_in_graph" in r
                 else "- | -")
            g += f" | {r['device_busy_s'] * 1e3:.3f} | {r['ratio_device']:.2f}" if "ratio_device" in r else " | - | -"
            print(f"| {r['shape']['T']} | {r['dtype']} | {r['time_s'] * 1e3:.3f} | {r['floor_s'] * 1e3:.3f} | "
                  f"{r['ratio']:.2f} | {g} | {(r['reference_time_s'] or 0) * 1e3:.3f} | "
                  f"{r['speedup_vs_reference'] or 0:.1f} | {r.get('rel_err', float('nan')):.1e} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
