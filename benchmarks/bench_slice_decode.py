"""Decode step of the `m3-slice` model (real M3 widths: 1 dense + 3 MSA/MoE layers) on one GPU with the Pallas
kernels, at batch 1, 32 and 128, against the step's memory floor.

Weights are random (drawn on the device: 25B parameters do not need a checkpoint to be timed) and the page
pool is filled with random K/V/index-K for a context of `--context` tokens per request, so MSA really selects
16 of the visible blocks. The floor is the bytes one step must read (every attention / dense weight, the
experts a batch of B tokens touches in expectation under uniform routing, the shared experts, the lm_head,
and the K/V/index-K each query reads) over the HBM bandwidth. Per-layer time = (step - lm_head) / layers.
`time_s` waits for each step before dispatching the next; `back_to_back_time_s` dispatches 20 steps and waits once,
as the engine's decode loop runs them (the host launches a step before it collects the one before).

    PYTHONPATH=. python benchmarks/bench_slice_decode.py [--batches 1 32 128] [--context 4096] [--moe-format mxfp8]
        [--prefill-lens 1024]   (also one request's whole prompt in one step: the bare prefill)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import device_profile, device_timeline, git_rev, triton_kernels_only

# HBM bytes per expert weight as the MoE kernels read it (moe/layout.py): an E8M0 byte per 32 elements for MX.
EXPERT_BYTES = {"bf16": 2.0, "mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32}


def step_bytes(cfg, B: int, context: int, itemsize: int = 2, moe_format: str = "bf16") -> dict[str, float]:
    d, hd, kv = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads
    attn = d * (cfg.num_heads + 2 * kv) * hd + cfg.num_heads * hd * d
    b = {"attention_weights": 0.0, "index_weights": 0.0, "mlp_weights": 0.0, "kv_reads": 0.0,
         "lm_head": d * cfg.vocab_size * itemsize}
    expert = 3 * d * cfg.moe_intermediate_size * EXPERT_BYTES[moe_format]
    # The shared expert is stacked as one more slot (same format) when it has the routed width.
    shared_bytes = EXPERT_BYTES[moe_format] if cfg.shared_intermediate_size == cfg.moe_intermediate_size else itemsize
    touched = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** B)
    visible = context + 1
    for a, m in zip(cfg.attn_types, cfg.mlp_types, strict=True):
        b["attention_weights"] += attn * itemsize
        if a == "dense":
            b["kv_reads"] += B * visible * 2 * kv * hd * itemsize
        else:
            b["index_weights"] += d * (cfg.index_num_heads + 1) * cfg.index_head_dim * itemsize
            b["kv_reads"] += B * visible * cfg.index_head_dim * itemsize  # index-K
            sel = min(visible, cfg.index_topk_blocks * cfg.index_block_size)
            b["kv_reads"] += B * sel * 2 * kv * hd * itemsize  # selected K/V, per group
        if m == "dense":
            b["mlp_weights"] += 3 * d * cfg.dense_intermediate_size * itemsize
        else:
            shared = 3 * d * cfg.shared_intermediate_size * shared_bytes
            b["mlp_weights"] += touched * expert + shared + d * cfg.num_experts * 4  # + the fp32 router
    b["total"] = sum(b.values())
    b["touched_experts"] = touched
    return b


def pipelined_time(step, n: int = 20, repeats: int = 5) -> float:
    """Seconds per step with `n` steps dispatched back to back and one wait at the end, the median of `repeats`:
    each step takes the page pool the one before returned, so the device runs them in order, and the host
    dispatches the next while the device runs the last. This is how the engine runs decode steps (it launches a
    step before it collects the one before); `timeit`'s wait per step adds the dispatch and the wake-up to each."""
    jax.block_until_ready(step())
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            out = step()
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / n)
    return float(np.median(ts))


def timeit(fn, n: int = 10) -> float:
    fn()
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="m3-slice")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--hbm-tbps", type=float, default=4.3)
    ap.add_argument("--moe-format", default="bf16", choices=tuple(EXPERT_BYTES),
                    help="the expert weights' format, prepared at load time as a checkpoint in it would be")
    ap.add_argument("--prefill-lens", type=int, nargs="*", default=[],
                    help="also time one request's whole prompt of each length in one step (the bare prefill "
                         "behind a served request's time to first token)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the kernels' batch-invariant mode (issue 27): where its cost goes, kernel by kernel")
    ap.add_argument("--no-mosaic", action="store_true",
                    help="the Triton kernels where a Hopper GPU's dispatch picks the Mosaic GPU ones (the before / "
                         "after of issue 28's prefill kernels in one call)")
    ap.add_argument("--out", default="benchmarks/results/slice-decode-h200.json")
    args = ap.parse_args()
    if args.no_mosaic:
        triton_kernels_only()
    kernels_name = "triton" if args.no_mosaic else "table"

    from checkpoints.prepare import prepare_params
    from m3jax.api import M3Model
    from m3jax.batch import RowPlan, build_batch
    from m3jax.config import preset
    from m3jax.params import init_params
    from m3jax.sharding import make_rules
    from pallas_kernels.choice import KernelChoice

    cfg = preset(args.preset)
    t0 = time.perf_counter()
    params = init_params(cfg, dtype=jnp.bfloat16)
    if jax.default_backend() == "gpu":
        params = prepare_params(params, args.moe_format, keep_reference=False)
    jax.block_until_ready(params)
    print(f"params ready in {time.perf_counter() - t0:.1f}s", flush=True)
    model = M3Model(cfg, params, make_rules(1), jnp.bfloat16,
                    kernels=KernelChoice("auto", "auto", batch_invariant=args.batch_invariant))
    ps = model.page_size
    head = jax.jit(lambda x, w: x @ w)
    rev = git_rev()
    def first_step(kv, batch) -> tuple[object, object, float]:
        """(a synchronous step on `batch`, the same step without the wait (it returns its logits: for the GPU
        trace), the first call's seconds: the compile). Both carry the page pool from step to step. The batch is
        on the device before the first step, as the engine's one packed copy a step puts it: given as host
        arrays, each of its eight fields was a copy of its own at every step, and the device sat idle for them
        (~0.3 ms a step on the H100, docs/benchmarks.md)."""
        batch = jax.device_put(batch)
        state = {"kv": kv}

        def step_only():
            out = model.step(state["kv"], batch)
            state["kv"] = out.kv
            return out.logits

        def run() -> None:
            jax.block_until_ready(step_only())

        t = time.perf_counter()
        run()
        return run, step_only, time.perf_counter() - t

    def measure(B: int) -> dict:
        width = -(-(args.context + 2) // ps)
        key = jax.random.key(B)
        kv = model.new_pages(1 + B * width)
        # Random K/V/index-K in every page: selection then drops real blocks, as at a long context.
        kv.k = [jax.random.normal(jax.random.fold_in(key, i), a.shape, a.dtype) for i, a in enumerate(kv.k)]
        kv.v = [jax.random.normal(jax.random.fold_in(key, 100 + i), a.shape, a.dtype) for i, a in enumerate(kv.v)]
        kv.index_k = [None if a is None else jax.random.normal(jax.random.fold_in(key, 200 + i), a.shape, a.dtype)
                      for i, a in enumerate(kv.index_k)]
        rows = [RowPlan([int(t)], args.context, range(1 + b * width, 1 + (b + 1) * width))
                for b, t in enumerate(np.random.default_rng(B).integers(0, cfg.vocab_size, B))]
        batch, _ = build_batch(rows, ps, B, B, width)
        run, step_only, compile_s = first_step(kv, batch)
        step_s = timeit(run)
        back_to_back_s = pipelined_time(step_only)
        # No host sync per step: the GPU trace's kernel-busy time of one step.
        prof = device_profile(step_only, [()], calls=10, top=16)
        x = jnp.ones((B, cfg.hidden_size), jnp.bfloat16)
        head_s = timeit(lambda: jax.block_until_ready(head(x, params["lm_head"])))
        head_busy = device_profile(head, [(x, params["lm_head"])], calls=10).get("device_busy_s", head_s)
        b = step_bytes(cfg, B, args.context, moe_format=args.moe_format)
        bw = args.hbm_tbps * 1e12
        floor_s = b["total"] / bw
        layer_floor = (b["total"] - b["lm_head"]) / cfg.num_layers / bw
        per_layer = (step_s - head_s) / cfg.num_layers
        return {"op": "m3_slice_decode_step", "shape": {"batch": B, "context": args.context, "layers": cfg.num_layers},
                "moe_format": args.moe_format, "batch_invariant": args.batch_invariant, "kernels": kernels_name,
                "time_s": step_s, "floor_s": floor_s, "ratio": step_s / floor_s,
                "back_to_back_time_s": back_to_back_s, "back_to_back_ratio": back_to_back_s / floor_s,
                "lm_head_time_s": head_s, "per_layer_time_s": per_layer, "per_layer_floor_s": layer_floor,
                "per_layer_ratio": per_layer / layer_floor, "bytes": b, "compile_s": compile_s,
                "device": jax.devices()[0].device_kind, "git_rev": rev, "jax": jax.__version__,
                "reference_time_s": None, **prof,
                **({"timeline": tl} if (tl := device_timeline(step_only)) else {}),
                **({"lm_head_busy_s": head_busy, "busy_ratio": prof["device_busy_s"] / floor_s,
                    "per_layer_busy_s": (prof["device_busy_s"] - head_busy) / cfg.num_layers,
                    "per_layer_busy_ratio": (prof["device_busy_s"] - head_busy) / cfg.num_layers / layer_floor}
                   if "device_busy_s" in prof else {})}

    def measure_prefill(n: int) -> dict:
        """One request's n-token prompt as a single step from position 0 (fresh pages), its last token sampled."""
        width = -(-(n + 2) // ps)
        kv = model.new_pages(1 + width)
        tokens = np.random.default_rng(n).integers(0, cfg.vocab_size, n).tolist()
        batch, _ = build_batch([RowPlan(tokens, 0, range(1, 1 + width))], ps, n, 1, width)
        run, step_only, compile_s = first_step(kv, batch)
        time_s = timeit(run)
        return {"op": "m3_slice_prefill", "shape": {"tokens": n, "layers": cfg.num_layers},
                "moe_format": args.moe_format, "batch_invariant": args.batch_invariant, "kernels": kernels_name,
                "time_s": time_s,
                "compile_s": compile_s, **device_profile(step_only, [()], calls=4, top=40),
                **({"timeline": tl} if (tl := device_timeline(step_only)) else {}),
                "device": jax.devices()[0].device_kind, "git_rev": rev, "jax": jax.__version__}

    results = []
    for B in args.batches:
        results.append(measure(B))
        print(json.dumps(results[-1]), flush=True)
    for n in args.prefill_lens:
        results.append(measure_prefill(n))
        print(json.dumps(results[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
