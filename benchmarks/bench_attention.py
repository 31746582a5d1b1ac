"""Attention-family kernels on the GPU: correctness against the jnp references, then time against the roofline.

    PYTHONPATH=. python benchmarks/bench_attention.py --out benchmarks/results/attention-h200.json --git-rev REV

M3 shapes (64 q heads / 4 KV heads / head_dim 128, index dim 128, page 128, top-16), bf16 pools. Decode: batch 64
at contexts 8k, 32k, 128k (one query row per request); prefill: one 8k chunk. Per op: the kernel path that
`pallas_kernels.attention.dispatch` takes (tiles from `tuning.py`), its floor (bytes over the HBM copy ceiling or
FLOPs over the bf16 matrix rate, the larger), the ratio, and the jnp reference's time in the same run. Inputs
rotate over several sets whose pages are spread over a pool larger than the 60 MB L2. Then tile variants, so
the table can be re-tuned from one run. `--small` runs everything at toy shapes in interpret mode on the CPU
(a dry run of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.devicewarm import gpu_state, warm_up_device
from benchmarks.timing import IN_GRAPH_COPIES, device_profile, fresh_like, in_graph_time, rel_err
from pallas_kernels.attention import dispatch, tuning
from pallas_kernels.attention import kernel as attn_kernel
from pallas_kernels.attention import reference as attn_ref
from pallas_kernels.attention.kv_write import write_pages_pallas, write_pages_xla
from pallas_kernels.attention.ragged import query_blocks
from pallas_kernels.attention.tuning import AttentionTiles, IndexTiles
from pallas_kernels.msa import kernel as msa_kernel
from pallas_kernels.msa import reference as msa_ref

HBM_BYTES_PER_S = 4.3e12  # H200 device-to-device copy, read + write (shared/gpu.md)
MATMUL_FLOPS_PER_S = 790e12  # bf16 8192^3 through PyTorch on the same card (shared/gpu.md)


@dataclasses.dataclass(frozen=True)
class Shapes:
    H: int
    K: int
    D: int
    Di: int
    ps: int
    topk: int
    local_blocks: int = 1

    @property
    def hg(self) -> int:
        return self.H // self.K


M3 = Shapes(H=64, K=4, D=128, Di=128, ps=128, topk=16)
SMALL = Shapes(H=8, K=2, D=32, Di=32, ps=16, topk=4)


class Recorder:
    def __init__(self, path: str, meta: dict[str, Any]):
        self.path, self.meta, self.rows = path, meta, []

    def add(self, **row: Any) -> None:
        row = {**row, **self.meta}
        self.rows.append(row)
        with open(self.path, "w") as f:
            json.dump(self.rows, f, indent=1)
        t, fl, r, ref = (row.get(k) for k in ("time_s", "floor_s", "ratio", "reference_time_s"))
        g = row.get("time_in_graph_s")
        in_graph = "" if g is None else f" in-graph={_us(g)} ({row['ratio_in_graph']:.2f})"
        if row.get("device_busy_s") is not None:
            in_graph += f" busy={_us(row['device_busy_s'])} ({row['ratio_device']:.2f}) {row.get('kernels_us')}"
        print(f"{row['op']:<24} {row.get('case', ''):<14} {row.get('variant', ''):<34} "
              f"t={_us(t)} floor={_us(fl)} ratio={'-' if r is None else f'{r:.2f}'}{in_graph} ref={_us(ref)} "
              f"{row.get('check', '')}", flush=True)


# The attention implementation every dispatch call here takes ("pallas" on the GPU, "interpret" with --small).
IMPL = "pallas"
INVARIANT = False  # --batch-invariant: the ops with the tiles of batch-invariant serving
IN_GRAPH_PREFILL = False  # --in-graph-prefill: prefill ops timed inside a jitted graph too (the closing run)

def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:9.1f}us"


def timeit(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, samples: int, inner: int) -> float:
    """Median seconds per call over `samples` batches of `inner` back-to-back calls (rotating argument sets):
    the device stays busy across a batch, so host dispatch hides behind kernel time as it does in serving."""
    for a in arg_sets:
        jax.block_until_ready(fn(*a))
    ts = []
    k = 0
    for _ in range(samples):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*arg_sets[k % len(arg_sets)])
            k += 1
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / inner)
    return statistics.median(ts)


def guarded(check: dict[str, Any], key: str, thunk: Callable[[], Any]) -> None:
    """check[key] = thunk(), or the error where the reference cannot run (out of memory at 128k)."""
    try:
        check[key] = thunk()
    except Exception as e:  # noqa: BLE001
        check[key] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        print(f"check {key} failed: {check[key]}", flush=True)


def kernel_time(fn: Callable[..., Any], arg_sets: Sequence[tuple], small: bool) -> tuple[float | None, str | None]:
    """(time, None), or (None, error) where the kernel fails to compile or run: one op's failure must not end the
    run (each GPU call is scarce), and the error is recorded next to the op."""
    try:
        return time_auto(fn, arg_sets, small), None
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e)[:1500]}"
        print(f"kernel failed: {msg}", flush=True)
        return None, msg


def device_timings(fn: Callable[..., Any], arg_sets: Sequence[tuple], small: bool, floor_s: float, *,
                   in_graph: bool = True) -> dict:
    """The in-graph time (decode ops, where host dispatch could matter) and the GPU trace's kernel-busy time and
    top kernels of `fn` (benchmarks/timing.py), with their ratios to `floor_s`."""
    t_g = graph_time(fn, arg_sets, small) if in_graph else None
    try:
        prof = device_profile(fn, arg_sets, calls=2 if small else 20)
    except Exception as e:  # noqa: BLE001 - a profiler that cannot start must not end the run
        prof = {"profile_error": f"{type(e).__name__}: {str(e)[:200]}"}
    busy = prof.get("device_busy_s")
    return dict(time_in_graph_s=t_g, ratio_in_graph=_ratio(t_g, floor_s), ratio_device=_ratio(busy, floor_s),
                **prof)


def graph_time(fn: Callable[..., Any], arg_sets: Sequence[tuple], small: bool) -> float | None:
    """timing.in_graph_time of `fn` over IN_GRAPH_COPIES calls, each with fresh queries (argument 0) and the
    rotation sets' other arguments; None where it fails (recorded as missing, the run goes on)."""
    copies = 2 if small else IN_GRAPH_COPIES
    fresh = fresh_like(arg_sets[0][0], copies, seed=1000)
    copy_args = [(f, *arg_sets[i % len(arg_sets)][1:]) for i, f in enumerate(fresh)]
    try:
        return in_graph_time(fn, copy_args, samples=2 if small else 15)
    except Exception as e:  # noqa: BLE001
        print(f"in-graph timing failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None


def _ratio(t: float | None, floor_s: float) -> float | None:
    return None if t is None else t / floor_s


def try_time(fn: Callable[..., Any], arg_sets: Sequence[tuple], small: bool) -> float | None:
    """A reference's time, or None where it cannot run (the 128k references allocate tens of GB)."""
    try:
        return time_auto(fn, arg_sets, small)
    except Exception as e:  # noqa: BLE001 - an out-of-memory reference must not end the run
        print(f"reference failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def time_auto(fn: Callable[..., Any], arg_sets: Sequence[tuple], small: bool) -> float:
    """Many runs for fast ops, few for slow references (a 128k reference call takes tens of ms)."""
    if small:
        return timeit(fn, arg_sets, samples=2, inner=1)
    t_one = timeit(fn, arg_sets[:1], samples=1, inner=1)
    if t_one > 5e-3:
        return timeit(fn, arg_sets, samples=3, inner=1)
    inner = max(1, min(50, int(5e-3 / max(t_one, 1e-6))))
    # 0.25 s of the op itself first: the device warm-up at start is not enough for the sub-100 us ops (the
    # first case of a fresh machine measured 20-50% slow after it, the same case later in a warm run not).
    timeit(fn, arg_sets, samples=max(1, int(0.25 / (inner * max(t_one, 1e-6)))), inner=inner)
    return timeit(fn, arg_sets, samples=25, inner=inner)


# ---- inputs --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    name: str
    kind: str  # "decode" | "prefill"
    batch: int
    context: int
    k_pages: jax.Array
    v_pages: jax.Array
    ik_pages: jax.Array
    sets: list[dict[str, jax.Array]]  # rotation sets: q, iq, page_table, token_row, pos


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Standard normal in chunks along axis 0: one draw of more than 2^32 elements (the 128k pool) overflows."""
    per_row = int(np.prod(shape[1:]))
    rows = max(1, (1 << 30) // per_row)
    parts = [jax.random.normal(jax.random.fold_in(key, i), (min(rows, shape[0] - i), *shape[1:]), dtype)
             for i in range(0, shape[0], rows)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def make_case(key: jax.Array, s: Shapes, kind: str, batch: int, context: int, n_rot: int, pool_factor: int,
              dtype: Any, locality: float = 0.0, shared_step_inputs: bool = False) -> Case:
    """Decode: `batch` requests at `context` tokens, one query row each (position context - 1).
    Prefill: one request, a chunk of `context` rows at positions 0 .. context - 1.

    `locality` > 0 (prefill): index queries that drift over that many tokens (iq_t = u cos(t / L) + v sin(t / L)
    plus 5% noise), so neighbouring tokens select overlapping blocks, as a trained indexer's neighbouring queries
    may; 0: independent random queries. On the CPU reference at a 4k chunk (tokens 2048-4095, M3 shapes), 4
    consecutive tokens select 23.8 distinct blocks per group with independent queries and 17.2 with locality 256
    (64 tokens: 24.5 and 19.7), against 16 each: the overlap that decides between the union and the block-major
    prefill kernels (recorded per prefill row as `selection_overlap`).

    `shared_step_inputs`: every set holds the same `token_row` / `pos` arrays (their values are equal anyway), so
    that the in-graph timing's copies compute what depends on them alone (the query-block metadata) once, as a
    model step does (`ragged.step_query_blocks`: on the GPU, XLA does not hoist it out of a layer scan, so the
    forward computes it before its scans); the case name ends in "-shared"."""
    P = -(-context // s.ps)
    R = batch if kind == "decode" else 1
    T = batch if kind == "decode" else context
    per_set = R * P
    n_pool = 1 + per_set * pool_factor  # page 0: the sink
    ks = jax.random.split(key, 4 + 2 * n_rot)
    k_pages = _normal(ks[0], (n_pool, s.ps, s.K, s.D), dtype)
    v_pages = _normal(ks[1], (n_pool, s.ps, s.K, s.D), dtype)
    ik_pages = _normal(ks[2], (n_pool, s.ps, s.Di), dtype)
    rng = np.random.default_rng(int(context) + batch)
    sets = []
    for r in range(n_rot):
        base = 1 + (r % pool_factor) * per_set
        table = (base + rng.permutation(per_set)).reshape(R, P).astype(np.int32)
        if kind == "decode":
            pos = np.full(T, context - 1, np.int32)
            row = np.arange(T, dtype=np.int32)
        else:
            pos = np.arange(T, dtype=np.int32)
            row = np.zeros(T, np.int32)
        row, pos = jnp.asarray(row), jnp.asarray(pos)
        if shared_step_inputs and sets:  # the first set's arrays themselves
            row, pos = sets[0]["token_row"], sets[0]["pos"]
        iq = jax.random.normal(ks[5 + 2 * r], (T, s.K, s.Di), jnp.float32)
        if locality > 0:
            u, v = (jax.random.normal(k, (1, s.K, s.Di), jnp.float32) for k in jax.random.split(ks[5 + 2 * r]))
            phase = (jnp.arange(T, dtype=jnp.float32) / locality)[:, None, None]
            iq = u * jnp.cos(phase) + v * jnp.sin(phase) + 0.05 * iq
        sets.append(dict(q=jax.random.normal(ks[4 + 2 * r], (T, s.H, s.D), dtype), iq=iq.astype(dtype),
                         page_table=jnp.asarray(table), token_row=row, pos=pos))
    name = f"{kind}-b{batch}-{context // 1024}k" if context >= 1024 else f"{kind}-b{batch}-{context}"
    name += (f"-loc{locality:g}" if locality > 0 else "") + ("-shared" if shared_step_inputs else "")
    return Case(name, kind, batch, context, k_pages, v_pages, ik_pages, sets)


def _ints_like(x: jax.Array) -> jax.Array:
    """Small integers in x's dtype: fp32 sums of their products are exact in any order, so block scores (and
    their ties) are bit-equal between kernel and reference and block ids must match exactly."""
    return jnp.clip(jnp.round(x.astype(jnp.float32) * 1.2), -2, 2).astype(x.dtype)


def _shape_dict(case: Case, s: Shapes, T: int) -> dict[str, Any]:
    return dict(batch=case.batch, context=case.context, tokens=T, q_heads=s.H, kv_heads=s.K, head_dim=s.D,
                index_dim=s.Di, page_size=s.ps, topk=s.topk, dtype=str(case.k_pages.dtype))


def _selection_overlap(blocks_TGN: np.ndarray, span: int = 4) -> dict[str, float]:
    """How much neighbouring tokens' selections overlap: the mean number of distinct blocks that `span`
    consecutive tokens select per group, against their mean number of selected blocks in all (what a query block
    of `span` tokens reads as its union, against what it uses)."""
    T, G, N = blocks_TGN.shape
    b = blocks_TGN[:T - T % span].reshape(-1, span, G, N).transpose(0, 2, 1, 3).reshape(-1, span * N)
    srt = np.sort(b, axis=1)
    distinct = ((srt >= 0) & np.concatenate([np.ones_like(srt[:, :1], bool), srt[:, 1:] != srt[:, :-1]], 1)).sum(1)
    ratio = float(distinct.sum() / max(1, (b >= 0).sum()))  # union pages per selected pair
    return {"span_tokens": span, "distinct_blocks": float(distinct.mean()),
            "selected_blocks": float((b >= 0).sum(1).mean()), "union_page_ratio": ratio}


def _selected_keys(blocks_TGN: np.ndarray, pos_T: np.ndarray, ps: int) -> np.ndarray:
    """[T, G] causal keys inside each (token, group)'s selected blocks (top-k ids are distinct)."""
    b = blocks_TGN.astype(np.int64)
    keys = np.clip(pos_T[:, None, None].astype(np.int64) - b * ps + 1, 0, ps)
    return np.where(b >= 0, keys, 0).sum(-1)


def _no_ref(with_reference: bool) -> dict[str, str]:
    if with_reference:
        return {}
    return {"reference_note": "not timed: the jnp reference gathers every token's whole context ([T, S, ...], "
                              "tens of GB at an 8k chunk); checked on a subset of the chunk's tokens instead"}


def _floor(bytes_: float, flops: float) -> tuple[float, str]:
    tb, tf = bytes_ / HBM_BYTES_PER_S, flops / MATMUL_FLOPS_PER_S
    return (tb, "hbm") if tb >= tf else (tf, "flops")


# ---- the measurements ----------------------------------------------------------------------------------------

def bench_case(case: Case, s: Shapes, rec: Recorder, *, small: bool, interpret: bool,
               with_reference: bool) -> Callable[[float], None]:
    """Check and time the three ops on `case` with the table's tiles; returns a function that later times the
    tile variants on the same inputs (run last, under a deadline: each variant is one more compile)."""
    T = case.sets[0]["q"].shape[0]
    R, P = case.sets[0]["page_table"].shape
    shape = _shape_dict(case, s, T)
    itemsize = case.k_pages.dtype.itemsize
    scale = s.D ** -0.5
    sel_kw = dict(topk=s.topk, local_blocks=s.local_blocks)
    args = lambda st, *names: tuple(st[n] for n in names)  # noqa: E731
    pos_np = np.asarray(case.sets[0]["pos"])
    decode = case.kind == "decode"  # in-graph timing where host dispatch could matter (ops of tens of us)

    # --- MSA index + top-k (the op the model calls: dispatch -> kernel with the table's tiles) ---
    select = jax.jit(lambda iq, ik, pt, tr, pos: dispatch.paged_select_blocks(iq, ik, pt, tr, pos, **sel_kw,
                                                                                 impl=IMPL, invariant=INVARIANT))
    select_ref = jax.jit(lambda iq, ik, pt, tr, pos: msa_ref.paged_select_blocks(iq, ik, pt, tr, pos, **sel_kw))
    sel_sets = [(st["iq"], case.ik_pages, *args(st, "page_table", "token_row", "pos")) for st in case.sets]

    check: dict[str, Any] = {}
    if with_reference:
        st = case.sets[0]

        def exact_ints() -> bool:
            a = (_ints_like(st["iq"]), _ints_like(case.ik_pages), *args(st, "page_table", "token_row", "pos"))
            return bool((select(*a) == select_ref(*a)).all())

        guarded(check, "ids_exact_int_data", exact_ints)

        def normal() -> tuple[float, float]:
            got, want = np.asarray(select(*sel_sets[0])), np.asarray(select_ref(*sel_sets[0]))
            return (float((got == want).all(-1).mean()),
                    float((np.sort(got, -1) == np.sort(want, -1)).all(-1).mean()))

        guarded(check, "rows_equal_ids_and_sets_normal_data", normal)
    elif case.kind == "prefill":
        guarded(check, "prefill_token_subset", lambda: _prefill_subset_check_select(case, select, select_ref))

    visible_keys = float(np.sum(pos_np + 1))  # token-exact causal keys per (token, index head)
    idx_bytes = (R * min(P * s.ps, int(pos_np.max()) + 1) * s.Di * itemsize  # index-K actually visible
                 + T * s.K * s.Di * itemsize + 2 * T * s.K * P * 4)  # index-q, block scores out and in
    idx_flops = 2.0 * s.K * s.Di * visible_keys
    floor_s, floor_kind = _floor(idx_bytes, idx_flops)
    t, err = kernel_time(select, sel_sets, small)
    t_ref = try_time(select_ref, sel_sets[:2], small) if with_reference else None
    tiles = tuning.index_tiles(T, R, P, s.K, invariant=INVARIANT,
                               mosaic=dispatch.mosaic_for("index", s.K, s.Di, s.ps, interpret=small))
    rec.add(op="msa_index_topk", case=case.name, variant=f"table {_fmt(tiles)}", shape=shape, time_s=t,
            floor_s=floor_s, floor_kind=floor_kind, bytes=idx_bytes, flops=idx_flops, ratio=_ratio(t, floor_s),
            reference_time_s=t_ref, check=check, error=err, **_no_ref(with_reference),
            **device_timings(select, sel_sets, small, floor_s, in_graph=decode or IN_GRAPH_PREFILL))
    select_ok = err is None

    # Kernel stage alone (block scores; the query-block metadata, the forcing and lax.top_k excluded).
    def scores_fn(tiles: IndexTiles) -> Callable[..., Any]:
        def f(iq, ik, pt, tr, pos):
            qbs = query_blocks(tr, pos, bt=tiles.bt, num_rows=pt.shape[0])
            return qbs, iq, ik, pt, pos
        pre = jax.jit(f)
        run = jax.jit(lambda qbs, iq, ik, pt, pos: msa_kernel.block_scores(iq, ik, pt, pos, qbs, tiles=tiles,
                                                                           interpret=interpret))
        return pre, run

    pre, run = scores_fn(tiles)
    sc_sets = [pre(*a) for a in sel_sets]
    t_k, err = kernel_time(run, sc_sets, small)
    rec.add(op="msa_block_scores_kernel", case=case.name, variant=f"table {_fmt(tiles)}", shape=shape, time_s=t_k,
            floor_s=floor_s, floor_kind=floor_kind, ratio=_ratio(t_k, floor_s), reference_time_s=None, error=err)
    del sc_sets

    # --- block-sparse attention over the selected pages ---
    blocks_sets = [(select if select_ok else select_ref)(*a) for a in sel_sets]
    sp = jax.jit(lambda q, k, v, pt, tr, pos, b: dispatch.paged_block_sparse_attention(q, k, v, pt, tr, pos, b,
                                                                                        scale=scale, impl=IMPL,
                                                                                        invariant=INVARIANT))
    sp_ref = jax.jit(lambda q, k, v, pt, tr, pos, b: msa_ref.paged_block_sparse_attention(q, k, v, pt, tr, pos, b,
                                                                                           scale=scale))
    sp_sets = [(st["q"], case.k_pages, case.v_pages, *args(st, "page_table", "token_row", "pos"), b)
               for st, b in zip(case.sets, blocks_sets, strict=True)]
    check = {}
    if with_reference:
        guarded(check, "rel_err", lambda: rel_err(sp(*sp_sets[0]), sp_ref(*sp_sets[0])))
    elif case.kind == "prefill":
        guarded(check, "prefill_token_subset", lambda: _prefill_subset_check_attn(case, sp, sp_ref, blocks_sets[0]))
    keys_TG = _selected_keys(np.asarray(blocks_sets[0]), pos_np, s.ps)
    pages_read = float(np.sum(np.asarray(blocks_sets[0]) >= 0))
    sp_bytes = pages_read * s.ps * s.D * 2 * itemsize + 2 * T * s.H * s.D * itemsize
    sp_flops = 4.0 * s.hg * s.D * float(keys_TG.sum())
    floor_s, floor_kind = _floor(sp_bytes if case.kind == "decode" else 0.0, sp_flops)
    if case.kind == "prefill":  # K/V of one 8k request fit in L2; the unique bytes are a few MB
        floor_s, floor_kind = _floor(case.context * s.K * s.D * 2 * itemsize, sp_flops)
    t, err = kernel_time(sp, sp_sets, small)
    t_ref = try_time(sp_ref, sp_sets[:2], small) if with_reference else None
    stiles = tuning.sparse_tiles(T, R, s.topk, s.hg, num_kv_heads=s.K, invariant=INVARIANT,
                                 mosaic=dispatch.mosaic_for("sparse", s.hg, s.D, s.ps, interpret=small))
    rec.add(op="msa_sparse_attention", case=case.name, variant=f"table {_fmt(stiles)}", shape=shape, time_s=t,
            floor_s=floor_s, floor_kind=floor_kind, bytes=sp_bytes, flops=sp_flops, ratio=_ratio(t, floor_s),
            reference_time_s=t_ref, check=check, error=err, **_no_ref(with_reference),
            **device_timings(sp, sp_sets, small, floor_s, in_graph=decode or IN_GRAPH_PREFILL),
            **({"selection_overlap": _selection_overlap(np.asarray(blocks_sets[0]))} if not decode else {}))

    # --- dense ragged paged attention (the 3 dense layers) ---
    dn = jax.jit(lambda q, k, v, pt, tr, pos: dispatch.paged_dense_attention(q, k, v, pt, tr, pos, scale,
                                                                           impl=IMPL, invariant=INVARIANT))
    dn_ref = jax.jit(lambda q, k, v, pt, tr, pos: attn_ref.paged_dense_attention(q, k, v, pt, tr, pos, scale))
    dn_sets = [x[:6] for x in sp_sets]
    check = {}
    if with_reference:
        guarded(check, "rel_err", lambda: rel_err(dn(*dn_sets[0]), dn_ref(*dn_sets[0])))
    elif case.kind == "prefill":
        guarded(check, "prefill_token_subset", lambda: _prefill_subset_check_dense(case, dn, dn_ref))
    dn_bytes = R * case.context * s.K * s.D * 2 * itemsize + 2 * T * s.H * s.D * itemsize
    dn_flops = 4.0 * s.H * s.D * visible_keys
    floor_s, floor_kind = _floor(dn_bytes, dn_flops)
    t, err = kernel_time(dn, dn_sets, small)
    t_ref = try_time(dn_ref, dn_sets[:2], small) if with_reference else None
    dtiles = tuning.dense_tiles(T, R, P, s.K, s.hg, invariant=INVARIANT,
                                mosaic=dispatch.mosaic_for("dense", s.hg, s.D, s.ps, interpret=small))
    rec.add(op="dense_attention", case=case.name, variant=f"table {_fmt(dtiles)}", shape=shape, time_s=t,
            floor_s=floor_s, floor_kind=floor_kind, bytes=dn_bytes, flops=dn_flops, ratio=_ratio(t, floor_s),
            reference_time_s=t_ref, check=check, error=err, **_no_ref(with_reference),
            **device_timings(dn, dn_sets, small, floor_s, in_graph=decode or IN_GRAPH_PREFILL))

    i_floor, _ = _floor(idx_bytes, idx_flops)
    s_floor = rec.rows[-2]["floor_s"]
    d_floor = rec.rows[-1]["floor_s"]

    def run_variants(deadline: float) -> None:
        base = (lambda: select(*sel_sets[0]), lambda: sp(*sp_sets[0]), lambda: dn(*dn_sets[0]))
        _variants(case, s, rec, small=small, interpret=interpret, deadline=deadline, sel_sets=sel_sets,
                  sp_sets=sp_sets, dn_sets=dn_sets, base=base, floors=(i_floor, s_floor, d_floor),
                  tiles=(tiles, stiles, dtiles))

    return run_variants


def _variants(case: Case, s: Shapes, rec: Recorder, *, small: bool, interpret: bool, deadline: float,
              sel_sets: list[tuple], sp_sets: list[tuple], dn_sets: list[tuple],
              base: tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]], floors: tuple[float, float, float],
              tiles: tuple[IndexTiles, AttentionTiles, AttentionTiles]) -> None:
    """Tile variants on the same inputs, each checked against the table variant's output."""
    T = case.sets[0]["q"].shape[0]
    P = case.sets[0]["page_table"].shape[1]
    shape = _shape_dict(case, s, T)
    scale = s.D ** -0.5
    sel_kw = dict(topk=s.topk, local_blocks=s.local_blocks)
    itiles, stiles, dtiles = tiles

    def select_v(v: IndexTiles) -> Callable[..., Any]:
        return jax.jit(lambda iq, ik, pt, tr, pos: msa_kernel.paged_select_blocks(
            iq, ik, pt, tr, pos, tiles=v, interpret=interpret, **sel_kw))

    def sparse_v(v: AttentionTiles) -> Callable[..., Any]:
        return jax.jit(lambda q, k, vv, pt, tr, pos, b: msa_kernel.paged_block_sparse_attention(
            q, k, vv, pt, tr, pos, b, scale=scale, tiles=v, interpret=interpret))

    def dense_v(v: AttentionTiles) -> Callable[..., Any]:
        return jax.jit(lambda q, k, vv, pt, tr, pos: attn_kernel.paged_dense_attention(
            q, k, vv, pt, tr, pos, scale, tiles=v, interpret=interpret))

    same_ids = lambda got, want: {"same_as_table": bool((np.asarray(got) == np.asarray(want)).all())}  # noqa: E731
    close = lambda got, want: {"rel_err_vs_table": rel_err(got, want)}  # noqa: E731
    ctx = case.context
    plan = [("msa_sparse_attention", _sparse_variants(case.kind, ctx, stiles), sparse_v, sp_sets, base[1], close, 1),
            ("msa_index_topk", _index_variants(case.kind, ctx, itiles, P), select_v, sel_sets, base[0], same_ids, 0),
            ("dense_attention", _dense_variants(case.kind, ctx, dtiles, P), dense_v, dn_sets, base[2], close, 2)]
    for op, variants, make, sets, want_fn, compare, fi in plan:
        try:
            want = want_fn()
        except Exception as e:  # noqa: BLE001 - the table variant failed: time the others unchecked
            print(f"{op}: no table output to compare ({type(e).__name__})", flush=True)
            want = None
        for v in variants:
            if time.perf_counter() > deadline:
                print("deadline: skipping remaining variants", flush=True)
                return
            f = make(v)
            check: dict[str, Any] = {}
            if want is not None:
                guarded(check, "vs_table", lambda f=f, want=want, c=compare, a=sets[0]: c(f(*a), want))
            t, err = kernel_time(f, sets, small)
            # Prefill variants run for milliseconds: their trace (kernel split) costs little. The split variants
            # are decode ops of tens of microseconds, judged in graph as the engine runs them.
            prof = (device_timings(f, sets, small, floors[fi], in_graph=VARIANTS == "split")
                    if (case.kind == "prefill" or VARIANTS == "split") and err is None else {})
            rec.add(op=op, case=case.name, variant=_fmt(v), shape=shape, time_s=t, floor_s=floors[fi],
                    ratio=_ratio(t, floors[fi]), reference_time_s=None, check=check, error=err, **prof)
    if case.kind == "decode" and VARIANTS == "tune" and time.perf_counter() < deadline:
        _layout_experiment(case, rec, shape, sp_sets, base[1], stiles, s_floor=floors[1], small=small,
                           interpret=interpret)


def _layout_experiment(case: Case, rec: Recorder, shape: dict[str, Any], sp_sets: list[tuple],
                       want_fn: Callable[[], Any], tiles: AttentionTiles, *, s_floor: float, small: bool,
                       interpret: bool) -> None:
    """The same block-sparse decode over pages laid out [pages, K, page_size, hd]: one (page, group) tile is a
    contiguous 32 KB block instead of page_size rows of 256 B spaced K * hd apart (KVPages' layout)."""
    scale = case.sets[0]["q"].shape[-1] ** -0.5
    k_hm = jnp.swapaxes(case.k_pages, 1, 2)
    v_hm = jnp.swapaxes(case.v_pages, 1, 2)
    f = jax.jit(lambda q, k, v, pt, tr, pos, b: msa_kernel.paged_block_sparse_attention(
        q, k, v, pt, tr, pos, b, scale=scale, tiles=tiles, interpret=interpret, heads_major=True))
    sets = [(a[0], k_hm, v_hm, *a[3:]) for a in sp_sets]
    check: dict[str, Any] = {}
    guarded(check, "rel_err_vs_table", lambda: rel_err(f(*sets[0]), want_fn()))
    t, err = kernel_time(f, sets, small)
    rec.add(op="msa_sparse_attention", case=case.name, variant=f"{_fmt(tiles)} layout=[pages,K,ps,hd]",
            shape=shape, time_s=t, floor_s=s_floor, ratio=_ratio(t, s_floor), reference_time_s=None, check=check,
            error=err)
    del k_hm, v_hm


def _fmt(t: IndexTiles | AttentionTiles) -> str:
    return " ".join(f"{f.name}={getattr(t, f.name)}" for f in dataclasses.fields(t))


VARIANTS = "tune"  # "tune": the sets the table was chosen from (and the KV-layout experiment); "final": the fused
#                    index top-k and page-stream variants at decode; "depth": pipeline depths; "prefill": the 8k
#                    chunk's tiles; "split": decode page lists split over more programs; "none"


def _index_variants(kind: str, context: int, base: IndexTiles, pages: int) -> list[IndexTiles]:
    r = dataclasses.replace
    if VARIANTS == "prefill":
        # Prefill scoring reads each index-K page from L2 once per query block: more rows per block (M = bt * 4)
        # means fewer page reads; one or two page splits let the top-k run inside the kernel.
        if kind != "prefill":
            return []
        # (attention-h200-prefill-1/-2/-3.json: bt 32 / 64, the fused top-k and half-page dots, which IndexTiles
        # no longer offers, were all slower than the table's bt 16: 167-305 against 164 us.)
        # (attention-h200-prefill-4/-5.json: 32 pages per program beat 16 and 8; 8 warps and 2 stages were slower.)
        # The Mosaic GPU scoring (msa/kernel_mgpu.py) first: with its own top-k (every page in one program), then
        # 32-token query blocks over 32 or 64 pages per program with the top-k as a second launch.
        every_page = 32 * -(-pages // 32)
        mosaic = [r(base, backend="mosaic", bp=every_page, num_stages=4, topk="fused"),
                  *(r(base, backend="mosaic", bp=bp, num_stages=st) for bp, st in ((32, 4), (64, 4), (32, 3)))]
        # The Triton scoring beside them (on a Hopper GPU the table's entry is the Mosaic one): its table tiles
        # (bt 16, 32 pages), then 16 and 64 pages a program.
        triton = IndexTiles(bt=base.bt, bp=32)
        out = [*mosaic, triton, r(triton, bp=16), r(triton, bp=64)]
        return [t for t in dict.fromkeys(out) if t != base]
    if VARIANTS == "final":
        # The top-k inside the scoring kernel (no second launch) or as a second launch, and longer page streams
        # per program. (8 or 2 rows per top-k program were timed too, attention-h200-final.json: no better;
        # that knob is gone.)
        if kind != "decode":
            return []
        out = [r(base, topk="fused"), r(base, topk="pallas"), r(base, topk="fused", bp=base.bp * 2),
               r(base, topk="pallas", bp=base.bp * 2)]
        return [t for t in dict.fromkeys(out) if t != base]
    if VARIANTS == "depth":
        return [r(base, num_stages=4), r(base, num_stages=2), r(base, num_warps=2)] if kind == "decode" else []
    if VARIANTS != "tune":
        return []
    if kind == "decode":
        out = [r(base, bp=bp) for bp in (base.bp // 2, base.bp * 2) if 8 <= bp <= 128]
        return [*out, r(base, topk="xla"), r(base, num_warps=8)]
    return [r(base, topk="xla"), r(base, bt=base.bt * 2), r(base, num_warps=8)]


def _sparse_variants(kind: str, context: int, base: AttentionTiles) -> list[AttentionTiles]:
    r = dataclasses.replace
    if VARIANTS == "prefill":
        if kind != "prefill":
            return []
        # The table picks KV-block-major (msa/block_major.py); against it, the query-block kernel over the union
        # of 4 tokens' selections, which wins where neighbouring tokens' selections overlap (the case's
        # `union_page_ratio`). (attention-h200-prefill-2/-3/-4.json: 1 / 4 / 8 tiles per page read and 8-token
        # tiles with 8 warps were slower than 16 tiles of 4 tokens.)
        # The Mosaic GPU union kernel (msa/sparse_mgpu.py) first: whole pages at 2 stages, half pages at 4.
        # Where the table picks it (a Hopper GPU): its shared-pages form (8-token blocks, each warpgroup its
        # own 4 tokens on one page stream) at the dense kernel's tiles and at half pages, the split-pages form
        # (4-token blocks), then block-major.
        if base.backend == "mosaic":
            mosaic = r(base, bt=8, key_tile=128, num_stages=3)  # M3's shared form (heads per group 16)
            out = [mosaic, r(mosaic, key_tile=64, num_stages=4), r(mosaic, bt=4, key_tile=64, num_stages=4),
                   tuning.AttentionTiles(bt=4, pages_per_split=base.pages_per_split, num_stages=2, block_major=16)]
            return [t for t in dict.fromkeys(out) if t != base]
        if not base.block_major:
            return []
        union = r(base, block_major=0, num_stages=3, key_tile=64)
        return [r(union, backend="mosaic", key_tile=128, num_stages=2), r(union, backend="mosaic", num_stages=4),
                union]
    if VARIANTS == "final":
        return []
    if VARIANTS == "split":
        # At small batches a decode step's block-sparse attention unsplit is one program per (request, KV group):
        # 4 of them at batch 1 on a 132-multiprocessor GPU. M3's 16 selected pages unsplit (16) or split over
        # 2-8 programs each, the partials merged after.
        return [r(base, pages_per_split=n) for n in (16, 8, 4, 2) if kind == "decode" and n != base.pages_per_split]
    if VARIANTS == "depth":
        # More loads in flight per multiprocessor: narrower key steps with deeper pipelines, or 3 stages so that
        # two programs fit per multiprocessor (the 8k rows of the earlier sweep caught the GPU's clock ramp).
        if kind != "decode":
            return []
        return [r(base, num_stages=3), r(base, key_tile=32, num_stages=6), r(base, key_tile=32, num_stages=8),
                r(base, key_tile=32, num_stages=4)]
    if VARIANTS != "tune":
        return []
    if kind == "decode":
        out = [r(base, key_tile=64), r(base, num_warps=8), r(base, key_tile=64, num_stages=4)]
        if context == 32768:
            out += [r(base, num_stages=2), r(base, pages_per_split=base.pages_per_split // 2),
                    r(base, key_tile=64, num_warps=8)]
        return out
    return [r(base, key_tile=64), r(base, bt=8, pages_per_split=128), AttentionTiles(bt=1, pages_per_split=16)]


def _dense_variants(kind: str, context: int, base: AttentionTiles, P: int) -> list[AttentionTiles]:
    r = dataclasses.replace
    if VARIANTS == "prefill":
        if kind != "prefill":
            return []
        # (attention-h200-prefill-1.json: half-page key tiles, bt 16 and bt 4 were slower; -4.json: 4 warps.)
        # The Mosaic GPU kernel (attention/kernel_mgpu.py, FA3-style) first: whole-page or half-page key steps,
        # 2-4 K/V buffers (a whole page at 3 stages is the most that fits 227 KB).
        mosaic = [r(base, backend="mosaic", key_tile=kt, num_stages=st) for kt, st in ((128, 2), (128, 3), (64, 4))]
        # The Triton kernel's table tiles beside them (on a Hopper GPU the table's entry is the Mosaic one), and
        # at 2 stages.
        triton = AttentionTiles(bt=base.bt, pages_per_split=base.pages_per_split, num_warps=8, num_stages=3)
        out = [*mosaic, triton, r(triton, num_stages=2)]
        return [t for t in dict.fromkeys(out) if t != base]
    if VARIANTS == "split":  # the dense decode's split below its 16-page minimum (see _sparse_variants)
        return [r(base, pages_per_split=n) for n in (16, 8, 4) if kind == "decode" and n != base.pages_per_split
                and n < P]
    if VARIANTS != "tune":
        return []
    if kind == "decode":
        if context != 32768:
            return []
        return [r(base, pages_per_split=max(8, base.pages_per_split // 2)), r(base, key_tile=64)]
    return [r(base, key_tile=64), r(base, num_stages=2), r(base, bt=base.bt * 2, num_warps=8)]


# ---- prefill: the references gather each token's whole context ([T, S, K, hd]: tens of GB at 8k), so they
# ---- run on a subset of the chunk's tokens (a token's output depends only on its row, position and pages).

def _subset(case: Case, n: int = 48) -> np.ndarray:
    T = case.sets[0]["q"].shape[0]
    rng = np.random.default_rng(0)
    fixed = [0, 1, T // 2, T - 1] + [x for x in (127, 128, 2047, 2048, 2049) if x < T]
    return np.unique(np.concatenate([fixed, rng.choice(T, n, replace=False)])).astype(np.int32)


def _prefill_subset_check_select(case: Case, select, select_ref) -> dict[str, Any]:
    st = case.sets[0]
    sub = _subset(case)
    iq_i, ik_i = _ints_like(st["iq"]), _ints_like(case.ik_pages)
    got = np.asarray(select(iq_i, ik_i, st["page_table"], st["token_row"], st["pos"]))[sub]
    want = np.asarray(select_ref(iq_i[sub], ik_i, st["page_table"], st["token_row"][sub], st["pos"][sub]))
    return {"ids_exact_int_data_token_subset": bool((got == want).all()), "subset_tokens": len(sub)}


def _prefill_subset_check_attn(case: Case, sp, sp_ref, blocks) -> dict[str, Any]:
    st = case.sets[0]
    sub = _subset(case)
    got = np.asarray(sp(st["q"], case.k_pages, case.v_pages, st["page_table"], st["token_row"], st["pos"],
                        blocks), np.float32)[sub]
    want = sp_ref(st["q"][sub], case.k_pages, case.v_pages, st["page_table"], st["token_row"][sub], st["pos"][sub],
                  blocks[sub])
    return {"rel_err_token_subset": rel_err(got, want), "subset_tokens": len(sub)}


def _prefill_subset_check_dense(case: Case, dn, dn_ref) -> dict[str, Any]:
    st = case.sets[0]
    sub = _subset(case)
    got = np.asarray(dn(st["q"], case.k_pages, case.v_pages, st["page_table"], st["token_row"], st["pos"]),
                     np.float32)[sub]
    want = dn_ref(st["q"][sub], case.k_pages, case.v_pages, st["page_table"], st["token_row"][sub], st["pos"][sub])
    return {"rel_err_token_subset": rel_err(got, want), "subset_tokens": len(sub)}


KV_WRITES_PER_CALL = 32


def bench_kv_write(s: Shapes, rec: Recorder, *, small: bool, interpret: bool, dtype: Any) -> None:
    """K (or V) write of one layer: XLA scatter vs the Pallas row store, timed as `KV_WRITES_PER_CALL` writes
    inside one jitted loop (the pool carried and donated, so both update in place) so that launch and host
    dispatch do not hide the difference, as they did with one write per call."""
    n_pages = 64 if small else 1 + 64 * 1024  # 8.6 GB pool at M3 shapes: the 128k-context batch
    pool = _normal(jax.random.key(9), (n_pages, s.ps, s.K, s.D), dtype)
    n = KV_WRITES_PER_CALL

    def looped(write: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
        def f(p, new, sl):
            return jax.lax.fori_loop(0, n, lambda i, p: write(p, new * (i + 1).astype(new.dtype), sl), p)
        return jax.jit(f, donate_argnums=0)

    impls = (("xla_scatter", looped(write_pages_xla)),
             ("pallas", looped(lambda p, nw, sl: write_pages_pallas(p, nw, sl, interpret=interpret))))
    for T in ((4, 64) if small else (64, 8192)):
        new = jax.random.normal(jax.random.key(T), (T, s.K, s.D), dtype)
        slots = jnp.asarray(np.random.default_rng(T).choice(np.arange(s.ps, n_pages * s.ps), T, replace=False)
                            .astype(np.int32))
        want = np.asarray(new * jnp.asarray(n, dtype), np.float32)  # the last write of the loop
        bytes_ = 2.0 * T * s.K * s.D * jnp.dtype(dtype).itemsize  # rows read + written
        floor_s = bytes_ / HBM_BYTES_PER_S
        for name, fn in impls:
            pool = fn(pool, new, slots)
            ok = bool((np.asarray(pool.reshape(-1, s.K, s.D)[slots], np.float32) == want).all())
            box = [pool]

            def step(nw, sl, fn=fn, box=box):
                box[0] = fn(box[0], nw, sl)
                return box[0]

            t_call = time_auto(step, [(new, slots)], small)
            pool = box[0]
            t = t_call / n
            rec.add(op="kv_write", case=f"T{T}", variant=name, shape=dict(tokens=T, pool_pages=n_pages,
                                                                          kv_heads=s.K, head_dim=s.D),
                    time_s=t, floor_s=floor_s, ratio=t / floor_s, reference_time_s=None,
                    check={"correct": ok, "writes_per_call": n})
    del pool


def render_markdown(path: str) -> str:
    """The docs/benchmarks.md table of a results file: the table-tile row of each op and case, then variants."""
    with open(path) as f:
        rows = json.load(f)

    def us(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e6:,.1f}"

    out = ["| op | case | tiles | time (us) | floor (us) | bound | ratio | in-graph (us) | in-graph ratio | "
           "kernel-busy (us) | busy ratio | jnp reference (us) | check |",
           "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for main_rows in (True, False):
        for r in rows:
            if r["variant"].startswith("table") != main_rows and r["op"] != "kv_write":
                continue
            if r["op"] == "kv_write" and not main_rows:
                continue
            check = r.get("check") or {}
            if r.get("error"):
                check = {"error": r["error"][:80]}
            ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}"
            g_ratio = "-" if r.get("ratio_in_graph") is None else f"{r['ratio_in_graph']:.2f}"
            b_ratio = "-" if r.get("ratio_device") is None else f"{r['ratio_device']:.2f}"
            out.append(f"| {r['op']} | {r['case']} | {r['variant']} | {us(r.get('time_s'))} | {us(r.get('floor_s'))} "
                       f"| {r.get('floor_kind', '')} | {ratio} | {us(r.get('time_in_graph_s'))} | {g_ratio} | "
                       f"{us(r.get('device_busy_s'))} | {b_ratio} | "
                       f"{us(r.get('reference_time_s'))} | "
                       f"{json.dumps(check)[:120]} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/attention-h200.json")
    ap.add_argument("--git-rev", default=os.environ.get("M3JAX_GIT_REV", "unknown"))
    ap.add_argument("--small", action="store_true", help="toy shapes in interpret mode (CPU dry run)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--prefill-locality", type=float, nargs="+", default=[0.0],
                    help="prefill cases' index-query drift length in tokens (0: independent random queries)")
    ap.add_argument("--variants", choices=("tune", "final", "depth", "prefill", "split", "none"), default="tune",
                    help="tune: the tile sets the table was chosen from, and the KV-layout experiment; final: "
                         "the fused index top-k and page streams at decode; depth: pipeline-depth variants; "
                         "prefill: the 8k chunk's tile variants; split: decode page lists over more programs")
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip tile variants after this many seconds")
    ap.add_argument("--warm-up-s", type=float, default=5.0, help="seconds of matmuls before the first timing")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the tiles of --batch-invariant serving (KernelChoice.batch_invariant) instead of the table's")
    ap.add_argument("--in-graph-prefill", action="store_true",
                    help="time the prefill ops inside a jitted graph too (IN_GRAPH_COPIES calls on fresh queries)")
    ap.add_argument("--shared-step-inputs", action="store_true",
                    help="prefill cases whose copies share token_row / pos (make_case's shared_step_inputs)")
    ap.add_argument("--render", metavar="JSON", help="print the markdown table of a results file and exit")
    a = ap.parse_args()
    global VARIANTS
    VARIANTS = a.variants
    if a.render:
        print(render_markdown(a.render))
        return
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    start = time.perf_counter()
    deadline = start + a.budget_s
    interpret = a.small
    global IMPL, INVARIANT, IN_GRAPH_PREFILL
    INVARIANT = a.batch_invariant
    IN_GRAPH_PREFILL = a.in_graph_prefill
    IMPL = "interpret" if a.small else "pallas"
    s = SMALL if a.small else M3
    dtype = jnp.bfloat16
    dev = jax.devices()[0]
    meta = dict(device=getattr(dev, "device_kind", str(dev)), backend=jax.default_backend(), jax=jax.__version__,
                git_rev=a.git_rev, impl=IMPL, batch_invariant=INVARIANT)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    rec = Recorder(a.out, meta)
    print(f"device={meta['device']} jax={jax.__version__} impl={meta['impl']}", flush=True)
    if not a.small:
        warm_up_device(a.warm_up_s)
        rec.meta["gpu_state"] = gpu_state()
        print(f"gpu state after warm-up: {rec.meta['gpu_state']}", flush=True)

    batch = 4 if a.small else a.batch
    contexts = [64, 256] if a.small else [int(c) for c in a.contexts.split(",") if c]
    for ctx in contexts:
        # Pools several times the L2 where memory allows; the 128k pool (19 GB) is far beyond it already.
        factor = 4 if ctx <= 8192 else (2 if ctx <= 32768 else 1)
        case = make_case(jax.random.key(ctx), s, "decode", batch, ctx, n_rot=4, pool_factor=factor, dtype=dtype)
        run_variants = bench_case(case, s, rec, small=a.small, interpret=interpret, with_reference=True)
        run_variants(deadline)
        del case, run_variants
        print(f"[{time.perf_counter() - start:.0f}s]", flush=True)
    for locality in (a.prefill_locality if a.prefill else []):
        ctx = 128 if a.small else a.prefill
        case = make_case(jax.random.key(1), s, "prefill", 1, ctx, n_rot=2, pool_factor=2, dtype=dtype,
                         locality=locality, shared_step_inputs=a.shared_step_inputs)
        run_variants = bench_case(case, s, rec, small=a.small, interpret=interpret, with_reference=False)
        run_variants(deadline)
        del case, run_variants
        print(f"[{time.perf_counter() - start:.0f}s]", flush=True)
    bench_kv_write(s, rec, small=a.small, interpret=interpret, dtype=dtype)
    print(f"done in {time.perf_counter() - start:.0f}s; {len(rec.rows)} rows -> {a.out}", flush=True)


if __name__ == "__main__":
    main()
