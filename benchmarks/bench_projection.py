"""One GPU of a TP4, TP8 or EP8 deployment of full M3, timed per layer on one H200, and the projection of the whole
model from it: decode step time, TTFT, output and total tok/s per GPU, beside InferenceX's H200 vLLM FP8 TP8 figures.

What is timed is exactly what device 0 of the deployment runs per layer (pallas_kernels/topology.py decides it;
pallas_kernels/sharded.py runs it inside shard_maps): the same ops (`pallas_kernels.ops`, the Pallas kernels, tiles
from the shard's shapes) on the shard's weights and page pool:
  attention  q [D, H/tp * hd]; k / v [D, K/tp * hd], or at TP8 (M3's 4 KV heads replicated, one per device) the
             whole [D, K * hd] and the device's head kept; o [H/tp * hd, D]; K / V / index-K writes into the
             device's pool (K/tp or 1 KV heads); dense attention, or the MSA index branch (index q for the
             device's groups: at TP8 all 4 heads are computed, the device's group scored) + top-k + block-sparse
             attention over its KV heads' selected pages;
  MLP        dense layers: [D, F/tp] gate / up, [F/tp, D] down; MoE under TP: all 129 slots (128 experts + the
             shared one) over F/tp; under EP8: the device's 16 experts + the whole shared expert as a 17th slot,
             routed from all T tokens (its pairs, and the shared expert for T/8 of the tokens);
  lm_head    [D, V/tp] for the sampled rows.
Layers run as a `lax.scan` over `--layers` distinct layers' weights (so no layer's weights sit in L2 from the last
call), at the step's shapes: decode (one token for each of `concurrency` requests at a context of isl + osl/2) and
prefill (one request's isl-token prompt). Expert weights: bf16, or MXFP8 prepared as the loader prepares them.

The collectives are not run (one GPU); they are added from a stated model (`--allreduce-*`): per layer two
all-reduces of the [T, D] bf16 activations (after the o-projection and after the MLP / MoE), at TP8 one
all-gather of the [T, K, topk] int32 selections per MSA layer, per step one all-gather of the [rows, V / tp] fp32
logits. A ring collective over n GPUs moves 2(n-1)/n of the bytes (all-reduce) or (n-1)/n (all-gather) through
each GPU's NVLink at `--nvlink-gbps` (default 360 GB/s: 80% of NVLink 4's 450 GB/s per direction per GPU, NVIDIA
H200 datasheet, 900 GB/s bidirectional; nccl-tests report 360-480 GB/s bus bandwidth for large all-reduces on
8 x H100 / H200 NVSwitch systems), plus `--allreduce-latency-us` per collective (default 10 us, the order of NCCL's
small-message latency on NVSwitch: decode all-reduces of 0.4-1.6 MB are latency-bound).

Projection (3 dense + 57 MSA/MoE layers + the lm_head shard; sampling and host time not counted):
  decode_step_s   = 3 x dense(decode) + 57 x msa_moe(decode) + lm_head(concurrency rows) + collectives
  ttft_s          = 3 x dense(prefill isl) + 57 x msa_moe(prefill isl) + lm_head(1 row) + collectives
  continuous batching at `concurrency` requests: each request costs its prefill once and osl decode steps
  shared by `concurrency` requests, so requests/s = 1 / (ttft_s + osl * decode_step_s / concurrency); output
  tok/s = osl * requests/s, total = (isl + osl) * requests/s, per GPU / tp; TPOT = decode_step_s plus the prefill
  time that interleaves with each step (concurrency / osl prefills per step).
  InferenceX (H200, vLLM FP8, TP8, total tok/s/GPU): 1k/1k 445.8 at concurrency 32, 580.9 at 64; 8k/1k 1230.0 at
  32, 1500.6 at 64; `vs_inferencex` = ours / theirs where a figure exists.
Records: `op: "layer"` (each timed layer), `op: "linear"` (each projection at its shard shape: the Pallas
small-M kernel against XLA's GEMM, GB/s and fraction of HBM), `op: "projection"` (the figures above).

    PYTHONPATH=. python benchmarks/bench_projection.py                  # H200: TP4 / TP8 / EP8, bf16 + MXFP8
    PYTHONPATH=. python benchmarks/bench_projection.py --deployments tp8 --formats mxfp8 --append   # in parts
    PYTHONPATH=. python benchmarks/bench_projection.py --smoke --out /tmp/projection-smoke.json   # CPU check
(bf16 experts at TP4 do not fit four H200s (860 GB of weights): that case is recorded as not fitting, not timed.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import git_rev

DEPLOYMENTS = {"tp4": (4, False), "tp8": (8, False), "ep8": (8, True)}
INFERENCEX = {(1024, 1024, 32): 445.8, (1024, 1024, 64): 580.9, (8192, 1024, 32): 1230.0, (8192, 1024, 64): 1500.6}
HBM_BYTES_PER_S = 4.3e12  # H200 device-to-device copy, read + write (shared/gpu.md; records up to 47a0dfa used 4.8)
GPU_MEMORY = 141e9
EXPERT_BYTES = {"bf16": 2.0, "mxfp8": 1 + 1 / 32}  # per weight element, as the MoE kernels hold them


@dataclasses.dataclass(frozen=True)
class Shard:
    """Device 0 of a deployment: the topology and the shapes it holds."""

    name: str
    cfg: Any
    tp: int
    ep: bool
    fmt: str
    topo: Any

    @property
    def attention_mode(self) -> str:
        return self.topo.attention_mode(self.cfg.num_heads, self.cfg.num_kv_heads)

    @property
    def pool_heads(self) -> int:
        return self.topo.kv_heads(self.cfg.num_heads, self.cfg.num_kv_heads) // self.tp if \
            self.attention_mode != "replicated" else self.cfg.num_kv_heads

    @property
    def groups(self) -> int:  # MSA groups this device scores
        return self.pool_heads


def make_shard(name: str, cfg: Any, fmt: str, tp_ep: tuple[int, bool] | None = None) -> Shard:
    from m3jax.sharding import make_abstract_rules

    tp, ep = tp_ep or DEPLOYMENTS[name]
    return Shard(name, cfg, tp, ep, fmt, make_abstract_rules(tp, ep).topology)


# ---- the shard's weights ----------------------------------------------------------------------------------


def local_params(shard: Shard, layer: int, count: int, key: jax.Array) -> dict:
    """`count` distinct layers of layer `layer`'s kind, each weight at device 0's shard shape (random, bf16; the
    router fp32), MoE experts prepared in the shard's format as `checkpoints.prepare` lays them out per shard."""
    from checkpoints.prepare import prepare_run
    from m3jax.params import is_spec, layer_specs, spec_dtype
    from pallas_kernels.sharded import local_shape

    specs = layer_specs(shard.cfg, layer)
    leaves, tree = jax.tree.flatten(specs, is_leaf=is_spec)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]]
    shapes = []
    for path, s in zip(paths, leaves, strict=True):
        shape = local_shape(s.shape, s.axes, shard.topo)
        if shard.ep and "shared" in path:  # EP: every device holds the whole shared expert (its last slot)
            shape = s.shape
        shapes.append(((count, *shape), spec_dtype(s, jnp.bfloat16), s))

    @jax.jit
    def make(key: jax.Array) -> list[jax.Array]:
        keys = jax.random.split(key, len(shapes))
        out = []
        for k, (shape, dtype, s) in zip(keys, shapes, strict=True):
            std = 0.3 if s.init == "norm" else 0.05 if s.init == "zeros" else 1.0 / math.sqrt(s.fan_in)
            out.append((jax.random.normal(k, shape, jnp.float32) * std).astype(dtype))
        return out

    params = jax.tree.unflatten(tree, make(key))
    if "moe" in params:
        params["moe"] = prepare_run(params["moe"], shard.fmt, keep_reference=False)
    return params


# ---- one layer of the shard, as the sharded forward runs it on device 0 -----------------------------------


def shard_layers(shard: Shard, attn_kind: str, mlp_kind: str, impl: str):
    """(params, pages, batch) -> (x, pages): a scan over the stacked layers of device 0's shard."""
    from m3jax.model import IN_PLACE, apply_rope, rms_norm, rope_tables
    from pallas_kernels import ops
    from pallas_kernels.moe import dispatch as moe_dispatch
    from pallas_kernels.sharded import moe_ep_device

    cfg = shard.cfg
    eps = cfg.rms_norm_eps
    K_l, G_l = shard.pool_heads, shard.groups

    def run(params: dict, x: jax.Array, k_pool: jax.Array, v_pool: jax.Array, i_pool: jax.Array | None,
            batch: Any) -> tuple:
        count = k_pool.shape[0]
        pages = k_pool.shape[1]
        ps = k_pool.shape[2]
        rope = rope_tables(batch.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
        # As the model's scan: the big matrices are read in place from the stack at the layer, not sliced.
        whole = {g: {n: params[g][n] for n in names if n in params.get(g, {})} for g, names in IN_PLACE.items()}
        rp = {g: ({n: w for n, w in v.items() if n not in whole.get(g, {})} if g in whole else v)
              for g, v in params.items()}
        flat = [None if a is None else a.reshape(-1, *a.shape[2:]) for a in (k_pool, v_pool, i_pool)]

        def layer(carry, xs):
            x, kp, vp, ip = carry
            lp, j = xs
            lp = {g: {**v, **whole[g]} if g in whole else v for g, v in lp.items()}
            b = batch.with_page_offset(j * pages, ps)
            a = lp["attn"]
            h = rms_norm(x, lp["input_norm"], eps)
            q = rms_norm(ops.project(h, a["wq"], "attn.wq", impl=impl, layer=j), a["q_norm"], eps)
            k = rms_norm(ops.project(h, a["wk"], "attn.wk", impl=impl, layer=j), a["k_norm"], eps)
            v = ops.project(h, a["wv"], "attn.wv", impl=impl, layer=j)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            k, v = k[:, :K_l], v[:, :K_l]  # replicated KV heads (TP8): the device's own
            kp = ops.write_kv_pages(kp, k, b.slot_mapping, impl=impl)
            vp = ops.write_kv_pages(vp, v, b.slot_mapping, impl=impl)
            scale = cfg.head_dim ** -0.5
            if attn_kind == "dense":
                o = ops.paged_dense_attention(q, kp, vp, b.page_table, b.token_row, b.positions, scale, impl=impl)
            else:
                ix = lp["index"]
                iq = rms_norm(ops.project(h, ix["wq"], "index.wq", impl=impl, layer=j), ix["q_norm"], eps)
                ik = rms_norm(ops.project(h, ix["wk"], "index.wk", impl=impl, layer=j)[:, None, :], ix["k_norm"], eps)
                iq, ik = apply_rope(iq, *rope)[:, :G_l], apply_rope(ik, *rope)
                ip = ops.write_kv_pages(ip, ik[:, 0], b.slot_mapping, impl=impl)
                blocks = ops.paged_select_blocks(iq, ip, b.page_table, b.token_row, b.positions,
                                                 topk=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks,
                                                 init_blocks=cfg.index_init_blocks, impl=impl)
                o = ops.paged_block_sparse_attention(q, kp, vp, b.page_table, b.token_row, b.positions, blocks,
                                                     scale=scale, impl=impl)
            x = x + ops.project(o, a["wo"], "attn.wo", impl=impl, layer=j)
            h = rms_norm(x, lp["post_attn_norm"], eps)
            kw = {"top_k": cfg.num_experts_per_tok, "routed_scaling": cfg.routed_scaling_factor,
                  "alpha": cfg.swiglu_alpha, "limit": cfg.swiglu_limit, "impl": impl}
            if mlp_kind == "dense":
                m = lp["mlp"]
                y = ops.dense_mlp(h, m["w_gate"], m["w_up"], m["w_down"], alpha=cfg.swiglu_alpha,
                                  limit=cfg.swiglu_limit, impl=impl, layer=j)
            elif shard.ep:
                y = moe_ep_device(h, lp["moe"], device=0, num_devices=shard.tp, layer=j,
                                  num_valid=jnp.int32(x.shape[0]), shared_split=False, **kw)
            else:
                y = moe_dispatch.moe(h, lp["moe"], layer=j, **kw)
            return (x + y, kp, vp, ip), None

        (x, kp, vp, ip), _ = jax.lax.scan(layer, (x, *flat), (rp, jnp.arange(count, dtype=jnp.int32)))
        return x, kp.reshape(k_pool.shape), vp.reshape(v_pool.shape), None if ip is None else ip.reshape(
            i_pool.shape)

    return run


# ---- timing -----------------------------------------------------------------------------------------------


def _median_time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def time_layers(shard: Shard, attn_kind: str, mlp_kind: str, params: dict, batch: Any, num_pages: int,
                impl: str, reps: int) -> dict:
    """Seconds per layer of the scan (wall, and the GPU's kernel-busy time where it has a trace)."""
    from benchmarks.timing import device_profile

    cfg = shard.cfg
    count = jax.tree.leaves(params)[0].shape[0]
    ps = cfg.index_block_size
    key = jax.random.key(1)
    kv_shape = (count, num_pages, ps, shard.pool_heads, cfg.head_dim)
    k_pool = jax.random.normal(key, kv_shape, jnp.bfloat16)
    v_pool = jax.random.normal(jax.random.fold_in(key, 1), kv_shape, jnp.bfloat16)
    i_pool = (jax.random.normal(jax.random.fold_in(key, 2), (count, num_pages, ps, cfg.index_head_dim), jnp.bfloat16)
              if attn_kind == "sparse" else None)
    x = jax.random.normal(jax.random.fold_in(key, 3), (batch.num_tokens, cfg.hidden_size), jnp.bfloat16)
    t0 = time.perf_counter()
    step = jax.jit(shard_layers(shard, attn_kind, mlp_kind, impl), donate_argnums=(2, 3, 4)).lower(
        params, x, k_pool, v_pool, i_pool, batch).compile()
    compile_s = time.perf_counter() - t0
    # The pools are updated in place (donated): a copy of one per step would cost the KV cache's bandwidth. XLA:CPU
    # copies pools whose KV-head axis has size 1 (a layout change of a degenerate axis) even on one device.
    pool_shapes = {",".join(map(str, s)) for a in (k_pool, i_pool) if a is not None
                   for s in (a.shape, (a.shape[0] * a.shape[1], *a.shape[2:]))}
    pool_copies = sum(1 for line in step.as_text().splitlines() if " copy(" in line
                      and (m := re.search(r"\[([0-9,]+)\]", line)) and m.group(1) in pool_shapes)
    state = {"pools": (k_pool, v_pool, i_pool)}

    def call():
        out = step(params, x, *state["pools"], batch)
        state["pools"] = out[1:]
        return out[0]

    jax.block_until_ready(call())
    wall = _median_time(lambda: jax.block_until_ready(call()), reps) / count
    prof = device_profile(call, [()], calls=max(3, reps), top=10) if jax.default_backend() == "gpu" else {}
    busy = prof.get("device_busy_s")
    return {"wall_s": wall, "busy_s": None if busy is None else busy / count, "compile_s": compile_s,
            "kernels_us": prof.get("kernels_us"), "layers_timed": count, "pool_copies": pool_copies}


def decode_batch(cfg: Any, concurrency: int, context: int) -> tuple[Any, int]:
    from m3jax.batch import RowPlan, build_batch

    ps = cfg.index_block_size
    width = -(-(context + 1) // ps)
    rng = np.random.default_rng(concurrency)
    rows = [RowPlan([int(t)], context, range(1 + r * width, 1 + (r + 1) * width))
            for r, t in enumerate(rng.integers(0, cfg.vocab_size, concurrency))]
    batch, _ = build_batch(rows, ps, concurrency, concurrency, width)
    return batch, 1 + concurrency * width


def prefill_batch(cfg: Any, isl: int) -> tuple[Any, int]:
    from m3jax.batch import RowPlan, build_batch

    ps = cfg.index_block_size
    width = -(-isl // ps)
    toks = np.random.default_rng(isl).integers(0, cfg.vocab_size, isl).tolist()
    batch, _ = build_batch([RowPlan(toks, 0, range(1, 1 + width))], ps, isl, 1, width)
    return batch, 1 + width


def time_lm_head(shard: Shard, rows: int, reps: int) -> float:
    from pallas_kernels.sharded import local_shape

    cfg = shard.cfg
    d, v = local_shape((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), shard.topo)
    w = jax.random.normal(jax.random.key(5), (d, v), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(6), (rows, d), jnp.bfloat16)
    fn = jax.jit(lambda x, w: jnp.einsum("td,dv->tv", x, w, preferred_element_type=jnp.float32))
    return _median_time(lambda: jax.block_until_ready(fn(x, w)), reps)


def linear_records(shard: Shard, ms: list[int], impl: str, reps: int) -> list[dict]:
    """Each projection at the shard's shape: the small-M Pallas kernel against XLA's GEMM, each timed as it runs
    in the step: `IN_GRAPH_COPIES` calls on distinct weights in one jitted program (so the weights stream from
    HBM, not L2, and no host dispatch per call counts), and kernel-busy time from the GPU's trace beside it."""
    from benchmarks.timing import IN_GRAPH_COPIES
    from pallas_kernels.linear import kernel, reference
    from pallas_kernels.linear.tiles import pick_tiles
    from pallas_kernels.sharded import local_shape

    cfg = shard.cfg
    D, H, K, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t = shard.topo
    shapes = {
        "attn.wq": (D, math.prod(local_shape((H, hd), ("q_heads", "head_dim"), t))),
        "attn.wk": (D, math.prod(local_shape((K, hd), ("kv_heads", "head_dim"), t))),
        "attn.wo": (math.prod(local_shape((H, hd), ("q_heads", "head_dim"), t)), D),
        "index.wq": (D, math.prod(local_shape((K, cfg.index_head_dim), ("index_heads", "head_dim"), t))),
        "mlp.w_gate": (D, local_shape((cfg.dense_intermediate_size,), ("mlp",), t)[0]),
        "mlp.w_down": (local_shape((cfg.dense_intermediate_size,), ("mlp",), t)[0], D),
    }
    smoke = impl == "interpret"
    copies = 2 if smoke else IN_GRAPH_COPIES
    samples = 2 if smoke else max(5, reps)
    out = []
    for name, (k, n) in shapes.items():
        ws = [jax.random.normal(jax.random.key(k + n + i), (k, n), jnp.bfloat16) for i in range(copies)]
        floor_s = 2 * k * n / HBM_BYTES_PER_S
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            args = [(x, w) for w in ws]
            impls = {"xla": reference.linear}
            tiles = pick_tiles(m, k, n)
            if tiles is not None:
                impls["pallas"] = (lambda x, w, tiles=tiles:
                                   kernel.linear(x, w, tiles=tiles, interpret=impl == "interpret"))
            rec = {"op": "linear", "deployment": shard.name, "tp": shard.tp, "ep": shard.ep, "weight": name,
                   "m": m, "k": k, "n": n, "floor_s": floor_s, "copies": copies}
            time_impls(rec, impls, args, samples)
            if tiles is not None:
                rec.update(tiles=dataclasses.asdict(tiles), speedup=rec["xla_s"] / rec["pallas_s"])
            out.append(rec)
    out += projections_of_h(shard, shapes, ms, impl, copies, samples)
    return out


def time_impls(rec: dict, impls: dict, args: list[tuple], samples: int) -> None:
    """Each implementation's in-graph time and kernel-busy time over `args` (one tuple per copy), and both as
    fractions of the record's HBM floor, into `rec` as `<impl>_s`, `<impl>_busy_s` and their `_hbm_fraction`."""
    from benchmarks.timing import device_profile, in_graph_time

    floor_s = rec["floor_s"]
    for which, fn in impls.items():
        s_ = in_graph_time(fn, args, samples=samples)
        busy = device_profile(jax.jit(fn), args, calls=len(args)).get("device_busy_s")
        rec.update({f"{which}_s": s_, f"{which}_hbm_fraction": floor_s / s_, f"{which}_busy_s": busy,
                    f"{which}_busy_hbm_fraction": None if not busy else floor_s / busy})


def projections_of_h(shard: Shard, shapes: dict, ms: list[int], impl: str, copies: int, samples: int) -> list[dict]:
    """An MSA layer's projections of its normed input, q, k, v and the index's q and k, as the model runs them
    (`ops.project_many`): one launch of the kernel over all their columns ("one_launch"), against a launch per
    weight ("pallas", the model before) and XLA's five GEMMs ("xla"); op "linear_many"."""
    from pallas_kernels.linear import kernel, reference
    from pallas_kernels.linear.dispatch import tiles_for_many
    from pallas_kernels.linear.tiles import pick_tiles

    D = shard.cfg.hidden_size
    ns = [shapes["attn.wq"][1], shapes["attn.wk"][1], shapes["attn.wk"][1], shapes["index.wq"][1],
          shard.cfg.index_head_dim]
    floor_s = 2 * D * sum(ns) / HBM_BYTES_PER_S
    ws = [tuple(jax.random.normal(jax.random.key(17 * c + i), (D, n), jnp.bfloat16) for i, n in enumerate(ns))
          for c in range(copies)]
    interpret = impl == "interpret"
    out = []
    for m in ms:
        x = jax.random.normal(jax.random.key(m), (m, D), jnp.bfloat16)
        args = [(x, *w) for w in ws]
        many = tiles_for_many(m, D, ns, impl)
        if many is None or any(pick_tiles(m, D, n) is None for n in ns):
            continue
        impls = {
            "xla": lambda x, *w: [reference.linear(x, wi) for wi in w],
            "pallas": lambda x, *w, m=m: [kernel.linear(x, wi, tiles=pick_tiles(m, D, wi.shape[1]),
                                                        interpret=interpret) for wi in w],
            "one_launch": lambda x, *w, t=many: kernel.linear_many(x, list(w), tiles=t, interpret=interpret),
        }
        rec = {"op": "linear_many", "deployment": shard.name, "tp": shard.tp, "ep": shard.ep,
               "weights": ["attn.wq", "attn.wk", "attn.wv", "index.wq", "index.wk"], "m": m, "k": D, "ns": ns,
               "floor_s": floor_s, "copies": copies, "tiles": dataclasses.asdict(many)}
        time_impls(rec, impls, args, samples)
        rec["speedup_vs_pallas"] = rec["pallas_s"] / rec["one_launch_s"]
        # On the device, the one launch against XLA's GEMMs and bitwise against a launch per weight at its tiles.
        x0, *w0 = args[0]
        got = jax.jit(impls["one_launch"])(x0, *w0)
        ref = [r.astype(jnp.float32) for r in jax.jit(impls["xla"])(x0, *w0)]
        alone = [kernel.linear(x0, wi, tiles=many, interpret=interpret) for wi in w0]
        errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
                for g, r in zip(got, ref, strict=True)]
        same = [bool(jnp.array_equal(g, a_)) for g, a_ in zip(got, alone, strict=True)]
        rec["check"] = {"max_rel_err_vs_xla": max(errs), "equal_to_each_alone": all(same)}
        out.append(rec)
    return out


# ---- the collective model and the projection --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collectives:
    nvlink_bytes_per_s: float
    latency_s: float

    def all_reduce(self, nbytes: float, n: int) -> float:
        return self.latency_s + 2 * (n - 1) / n * nbytes / self.nvlink_bytes_per_s if n > 1 else 0.0

    def all_gather(self, nbytes: float, n: int) -> float:  # nbytes: the gathered result
        return self.latency_s + (n - 1) / n * nbytes / self.nvlink_bytes_per_s if n > 1 else 0.0

    def per_step(self, shard: Shard, tokens: int, rows: int) -> float:
        cfg = shard.cfg
        act = tokens * cfg.hidden_size * 2
        t = 2 * cfg.num_layers * self.all_reduce(act, shard.tp)
        if shard.attention_mode == "replicate_kv":
            t += len(cfg.sparse_layers) * self.all_gather(tokens * cfg.num_kv_heads * cfg.index_topk_blocks * 4,
                                                          shard.tp)
        return t + self.all_gather(rows * cfg.vocab_size * 4, shard.tp)  # logits to every device for sampling


def memory_per_gpu(shard: Shard, kv_tokens: int) -> dict:
    """Bytes one GPU holds: its weight shards (experts in the shard's format) and the KV pool for `kv_tokens`."""
    cfg = shard.cfg
    D, hd = cfg.hidden_size, cfg.head_dim
    tp = shard.tp
    attn = (D * cfg.num_heads * hd * 2 / tp + 2 * D * cfg.num_kv_heads * hd / (tp if cfg.num_kv_heads % tp == 0
                                                                               else 1)) * 2
    index = (D * cfg.index_num_heads * cfg.index_head_dim / (tp if cfg.index_num_heads % tp == 0 else 1)
             + D * cfg.index_head_dim) * 2
    dense = 3 * D * cfg.dense_intermediate_size * 2 / tp
    slots = (cfg.num_experts / tp + 1) if shard.ep else (cfg.num_experts + 1) / tp
    moe = slots * 3 * D * cfg.moe_intermediate_size * EXPERT_BYTES[shard.fmt] + D * cfg.num_experts * 4
    n_sparse = len(cfg.sparse_layers)
    n_moe = sum(m == "moe" for m in cfg.mlp_types)
    weights = (cfg.num_layers * attn + n_sparse * index + (cfg.num_layers - n_moe) * dense + n_moe * moe
               + 2 * cfg.vocab_size * D * 2 / tp)
    kv_heads = shard.pool_heads
    kv = kv_tokens * (cfg.num_layers * 2 * kv_heads * hd + n_sparse * cfg.index_head_dim) * 2
    return {"weights_bytes": weights, "kv_bytes": kv, "fits": weights + kv < 0.92 * GPU_MEMORY}


def project(shard: Shard, layer_s: dict, lm_head_s: dict, coll: Collectives, isl: int, osl: int,
            concurrency: int, assumptions: dict) -> dict:
    cfg = shard.cfg
    n_dense = sum(a == "dense" for a in cfg.attn_types)
    n_sparse = cfg.num_layers - n_dense

    def t(key: str) -> float:
        rec = layer_s[key]
        return rec["busy_s"] if rec["busy_s"] is not None else rec["wall_s"]

    decode = (n_dense * t(("dense", "decode", concurrency, isl)) + n_sparse * t(("sparse", "decode", concurrency, isl))
              + lm_head_s[concurrency] + coll.per_step(shard, concurrency, concurrency))
    ttft = (n_dense * t(("dense", "prefill", isl, isl)) + n_sparse * t(("sparse", "prefill", isl, isl))
            + lm_head_s[1] + coll.per_step(shard, isl, 1))
    req_s = 1.0 / (ttft + osl * decode / concurrency)
    out_tok_gpu = osl * req_s / shard.tp
    total_tok_gpu = (isl + osl) * req_s / shard.tp
    mem = memory_per_gpu(shard, concurrency * (isl + osl))
    rec = {"op": "projection", "deployment": shard.name, "tp": shard.tp, "ep": shard.ep, "moe_format": shard.fmt,
           "isl": isl, "osl": osl, "concurrency": concurrency, "decode_step_s": decode, "ttft_s": ttft,
           "tpot_s": decode + concurrency / osl * ttft, "output_tok_s_per_gpu": out_tok_gpu,
           "total_tok_s_per_gpu": total_tok_gpu, "collectives_decode_s": coll.per_step(shard, concurrency,
                                                                                       concurrency),
           **mem, "assumptions": assumptions}
    ref = INFERENCEX.get((isl, osl, concurrency))
    if ref is not None:
        rec.update(inferencex_total_tok_s_per_gpu=ref, vs_inferencex=total_tok_gpu / ref)
    return rec


# ---- main -------------------------------------------------------------------------------------------------


def smoke_config() -> Any:
    """Tiny shapes on which every deployment's shard is well formed (8 heads, 4 KV heads, 8 experts whose width
    splits 8 ways into MX groups of 128), for --smoke on the CPU."""
    from m3jax.config import preset

    return preset("m3-tiny").replace(hidden_size=128, num_heads=8, num_kv_heads=4, index_num_heads=4,
                                     num_experts=8, moe_intermediate_size=1024, shared_intermediate_size=1024,
                                     dense_intermediate_size=256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret-mode kernels: runs on the CPU")
    ap.add_argument("--deployments", nargs="*", default=list(DEPLOYMENTS), choices=list(DEPLOYMENTS),
                    help="none: only the linear records (--linear-tp, --linear-m)")
    ap.add_argument("--formats", nargs="+", default=["bf16", "mxfp8"], choices=list(EXPERT_BYTES))
    ap.add_argument("--workloads", nargs="+", default=["1024/1024", "8192/1024"], help="isl/osl pairs")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--layers", type=int, default=4, help="distinct layers of each kind per timed scan")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--linear-m", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--linear-tp", type=int, nargs="*", default=[1, 4, 8],
                    help="the projections' shard shapes timed as 'linear' records (1: the whole weights)")
    ap.add_argument("--nvlink-gbps", type=float, default=360.0)
    ap.add_argument("--allreduce-latency-us", type=float, default=10.0)
    ap.add_argument("--out", default="benchmarks/results/projection-h200.json")
    ap.add_argument("--append", action="store_true", help="keep the records already in --out (runs in parts)")
    args = ap.parse_args()

    from m3jax.config import preset

    if args.smoke:
        cfg, impl = smoke_config(), "interpret"
        args.workloads, args.concurrency, args.layers, args.reps, args.linear_m = ["64/32"], [2], 1, 1, [2]
    else:
        cfg, impl = preset("m3-full"), "pallas"
        from benchmarks.devicewarm import warm_up_device

        warm_up_device(10.0)
    workloads = [tuple(int(v) for v in w.split("/")) for w in args.workloads]
    coll = Collectives(args.nvlink_gbps * 1e9, args.allreduce_latency_us * 1e-6)
    rev = git_rev()
    assumptions = {
        "collectives": f"ring: all-reduce 2(n-1)/n bytes, all-gather (n-1)/n, at {args.nvlink_gbps} GB/s per GPU "
                       f"(80% of NVLink 4's 450 GB/s per direction; NVIDIA H200 datasheet: 900 GB/s "
                       f"bidirectional) + {args.allreduce_latency_us} us each; 2 bf16 [T, D] all-reduces per "
                       "layer, the [T, K, topk] selections all-gathered per MSA layer at TP8, the fp32 logits "
                       "all-gathered per step",
        "decode_context": "isl + osl / 2 tokens per request (the mean over its decode)",
        "batching": "requests/s = 1 / (ttft + osl * decode_step / concurrency); prefill of one prompt at a time",
        "not_counted": "sampling, host scheduling, the embedding lookup",
        "layer_time": "GPU kernel-busy time per layer where traced (else wall), scan over distinct layers",
        "device": jax.devices()[0].device_kind, "git_rev": rev, "jax": jax.__version__, "smoke": args.smoke,
    }
    out = Path(args.out)
    records: list[dict] = json.loads(out.read_text()) if args.append and out.is_file() else []
    out.parent.mkdir(parents=True, exist_ok=True)

    def emit(rec: dict) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)
        out.write_text(json.dumps(records, indent=2) + "\n")  # as it goes: a cut-off run keeps what it measured

    dense_layer = cfg.attn_types.index("dense")
    sparse_layer = next(i for i, (a, m) in enumerate(zip(cfg.attn_types, cfg.mlp_types, strict=True))
                        if a == "sparse" and m == "moe")
    for name in args.deployments:
        for fmt in args.formats:
            shard = make_shard(name, cfg, fmt)
            longest = max(isl + osl for isl, osl in workloads)
            mem = memory_per_gpu(shard, max(args.concurrency) * longest)
            if not args.smoke and mem["weights_bytes"] > 0.92 * GPU_MEMORY:
                emit({"op": "skipped", "deployment": name, "moe_format": fmt, "reason": "weights do not fit", **mem})
                continue
            t0 = time.perf_counter()
            params = {kind: local_params(shard, layer, args.layers if kind == "sparse" else min(args.layers, 3),
                                         jax.random.key(layer))
                      for kind, layer in (("dense", dense_layer), ("sparse", sparse_layer))}
            jax.block_until_ready(params)
            print(f"[{name} {fmt}] shard weights ready in {time.perf_counter() - t0:.1f}s", flush=True)
            layer_s: dict = {}
            for kind in ("dense", "sparse"):
                mlp = "dense" if kind == "dense" else "moe"
                cases = [("decode", c, isl) for c in args.concurrency for isl, _ in workloads]
                cases += [("prefill", isl, isl) for isl in sorted({isl for isl, _ in workloads})]
                for phase, size, isl in cases:
                    osl = dict(workloads)[isl]
                    batch, pages = (decode_batch(cfg, size, isl + osl // 2) if phase == "decode"
                                    else prefill_batch(cfg, isl))
                    rec = time_layers(shard, kind, mlp, params[kind], batch, pages, impl, args.reps)
                    layer_s[(kind, phase, size, isl)] = rec
                    emit({"op": "layer", "deployment": name, "tp": shard.tp, "ep": shard.ep, "moe_format": fmt,
                          "attention": kind, "mlp": mlp, "phase": phase, "tokens": size if phase == "decode" else isl,
                          "context": isl + osl // 2 if phase == "decode" else isl,
                          "attention_mode": shard.attention_mode, "pool_kv_heads": shard.pool_heads, **rec})
            lm_head_s = {r: time_lm_head(shard, r, args.reps) for r in (1, *args.concurrency)}
            del params
            for isl, osl in workloads:
                for c in args.concurrency:
                    emit(project(shard, layer_s, lm_head_s, coll, isl, osl, c, assumptions))
    for tp in args.linear_tp:
        shard = make_shard(f"tp{tp}", cfg, "bf16", (tp, False))
        for rec in linear_records(shard, args.linear_m, impl, args.reps):
            emit(rec)
    print(f"{len(records)} records -> {out}", flush=True)


if __name__ == "__main__":
    main()
