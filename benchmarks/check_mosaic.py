"""GPU correctness of the Mosaic GPU kernels at M3's shapes, each case in a process of its own.

CI cannot run a GPU kernel, and the GPU interpreter the CPU tests use is not the GPU: it runs wgmma from shared
memory only and knows nothing of registers, barrier timing or TMA. So on the GPU, against the Triton kernels (the
table's, themselves checked against the references) and the jnp references on the same inputs:
- `dense`: `attention/kernel_mgpu.py` over a mixed batch (a 1,000-token chunk behind a 3,000-token prefix, two
  decodes with 3 drafts, a 300-token prompt, padding), whole- and half-page key steps;
- `index`: `msa/kernel_mgpu.py` block scores bit for bit against the Triton kernel's on integer data (every dot
  exact), and the selected ids, with the top-k as its own launch and fused into the kernel, against the reference;
- `moe-bf16`, `moe-mxfp8-each`, `-split`, `-swap`: `moe/kernel_mgpu.py` at M3's widths (16 experts + the shared one,
  T = 600) against the Triton kernels and the reference.
A case that crashes or hangs (a barrier never reached) loses only itself: each runs in a subprocess under its own
timeout, and the JSON is written after every case.

    PYTHONPATH=. python benchmarks/check_mosaic.py [--cases dense index ...] [--timeout-s 90] \
        [--out benchmarks/results/mosaic-check-h200.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CASES = ("index", "dense", "sparse", "moe-bf16", "moe-mxfp8-swap", "moe-mxfp8-split", "moe-mxfp8-each")
# M3's shapes on the GPU; --small: toy shapes in jax's GPU interpreter, a dry run of this script on the CPU.
# Odd token counts: a step's tokens need not fill the kernels' tiles (T = 921 once failed to compile).
SHAPES = {"full": {"H": 64, "K": 4, "D": 128, "ps": 128, "G": 4, "Di": 128, "topk": 16,
                   "rows": [(1000, 3000), (4, 2600), (4, 700), (300, 0)], "tokens": 1343,
                   "E": 16, "Dm": 6144, "F": 3072, "T": 600},
          "small": {"H": 32, "K": 2, "D": 64, "ps": 64, "G": 4, "Di": 64, "topk": 4,
                    "rows": [(37, 90), (4, 200), (9, 0)], "tokens": 55, "E": 4, "Dm": 256, "F": 128, "T": 200}}
S = SHAPES["full"]
INTERPRET = False


def _attention_batch():
    import numpy as np

    from m3jax.batch import RowPlan, build_batch

    rng = np.random.default_rng(0)
    ps = S["ps"]
    pages_per_row = max(-(-(n + start) // ps) for n, start in S["rows"])
    perm = iter(rng.permutation(np.arange(1, 1 + len(S["rows"]) * pages_per_row)).tolist())
    rows = [RowPlan([1] * n, start, [next(perm) for _ in range(-(-(n + start) // ps))]) for n, start in S["rows"]]
    batch, _ = build_batch(rows, ps, S["tokens"], len(rows) + 1, pages_per_row)
    return batch, 1 + len(rows) * pages_per_row, rng


def case_dense() -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import rel_err
    from pallas_kernels.attention import kernel as attn_kernel
    from pallas_kernels.attention import reference as attn_ref
    from pallas_kernels.attention import tuning

    H, K, D, ps = S["H"], S["K"], S["D"], S["ps"]
    batch, num_pages, rng = _attention_batch()
    q = jnp.asarray(rng.normal(size=(batch.num_tokens, H, D)), jnp.bfloat16)
    kp, vp = (jnp.asarray(rng.normal(size=(num_pages, ps, K, D)), jnp.bfloat16) for _ in range(2))
    args = (batch.page_table, batch.token_row, batch.positions)
    scale = D ** -0.5
    want = attn_ref.paged_dense_attention(*(x.astype(jnp.float32) for x in (q, kp, vp)), *args, scale)

    def attend(tiles: tuning.AttentionTiles) -> jax.Array:
        return jax.jit(lambda *a: attn_kernel.paged_dense_attention(*a, scale, tiles=tiles,
                                                                    interpret=INTERPRET))(q, kp, vp, *args)

    triton_tiles = tuning.dense_tiles(batch.num_tokens, batch.page_table.shape[0], batch.page_table.shape[1], K,
                                      H // K)
    tri = attend(triton_tiles)
    out: dict[str, Any] = {"triton_tiles": str(triton_tiles), "triton_rel_err_vs_reference": rel_err(tri, want)}
    for key_tile, stages in ((64, 3), (128, 2)):
        got = attend(tuning.AttentionTiles(bt=8, pages_per_split=64, key_tile=key_tile, num_stages=stages,
                                           backend="mosaic"))
        out[f"mosaic_kt{key_tile}_s{stages}"] = {"rel_err_vs_reference": rel_err(got, want),
                                                 "rel_err_vs_triton": rel_err(got, tri)}
    worst = max(v["rel_err_vs_reference"] for k, v in out.items() if k.startswith("mosaic"))
    return {**out, "ok": worst < 8e-3}  # bf16 P and output (the CPU test's bound is 4e-3 on a smaller batch)


def case_sparse() -> dict:
    """The Mosaic union block-sparse attention (both forms) against the reference and the Triton union kernel, on
    each token's own random selection (its own block always among them, so the causal cutoff inside a page runs)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.timing import rel_err
    from pallas_kernels.attention import tuning
    from pallas_kernels.msa import kernel as msa_kernel
    from pallas_kernels.msa import reference as msa_ref

    H, K, D, ps, topk = S["H"], S["K"], S["D"], S["ps"], S["topk"]
    batch, num_pages, rng = _attention_batch()
    T = batch.num_tokens
    pos = np.asarray(batch.positions)
    blocks = np.full((T, K, topk), -1, np.int32)
    for t in range(T):
        for g in range(K):
            own = pos[t] // ps
            pick = [own] + [b for b in rng.permutation(own + 1) if b != own][:topk - 1]  # distinct, as top-k's
            blocks[t, g, :len(pick)] = pick
    blocks = jnp.asarray(blocks)
    q = jnp.asarray(rng.normal(size=(T, H, D)), jnp.bfloat16)
    kp, vp = (jnp.asarray(rng.normal(size=(num_pages, ps, K, D)), jnp.bfloat16) for _ in range(2))
    args = (batch.page_table, batch.token_row, batch.positions)
    scale = D ** -0.5
    want = msa_ref.paged_block_sparse_attention(*(x.astype(jnp.float32) for x in (q, kp, vp)), *args, blocks,
                                                scale=scale)

    def attend(tiles: tuning.AttentionTiles) -> jax.Array:
        return jax.jit(lambda *a: msa_kernel.paged_block_sparse_attention(
            *a, scale=scale, tiles=tiles, interpret=INTERPRET))(q, kp, vp, *args, blocks)

    triton_tiles = tuning.sparse_tiles(T, batch.page_table.shape[0], topk, H // K, union=True)
    tri = attend(triton_tiles)
    out: dict[str, Any] = {"triton_tiles": str(triton_tiles), "triton_rel_err_vs_reference": rel_err(tri, want)}
    # bt 4: the two warpgroups split the pages; bt 8: each its own 4 tokens on one page stream (shared).
    for bt, key_tile, stages in ((4, 64, 4), (4, 128, 2), (8, 128, 3), (8, 64, 4)):
        got = attend(dataclasses.replace(triton_tiles, bt=bt, key_tile=key_tile, num_stages=stages,
                                         backend="mosaic"))
        name = f"mosaic_kt{key_tile}_s{stages}" + ("_shared" if bt == 8 else "")
        out[name] = {"rel_err_vs_reference": rel_err(got, want), "rel_err_vs_triton": rel_err(got, tri)}
    worst = max(v["rel_err_vs_reference"] for k, v in out.items() if k.startswith("mosaic"))
    return {**out, "ok": worst < 8e-3}


def case_index() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.attention.ragged import query_blocks
    from pallas_kernels.attention.tuning import IndexTiles
    from pallas_kernels.msa import kernel as msa_kernel
    from pallas_kernels.msa import kernel_mgpu
    from pallas_kernels.msa import reference as msa_ref

    G, Di, ps = S["G"], S["Di"], S["ps"]
    batch, num_pages, rng = _attention_batch()
    # Small integers: every dot is exact in fp32, so the two kernels' block maxima must be equal bit for bit.
    iq = jnp.asarray(rng.integers(-2, 3, (batch.num_tokens, G, Di)), jnp.bfloat16)
    ik = jnp.asarray(rng.integers(-2, 3, (num_pages, ps, Di)), jnp.bfloat16)
    pt, tr, pos = (jnp.asarray(x) for x in (batch.page_table, batch.token_row, batch.positions))
    P = pt.shape[1]
    qbs = query_blocks(tr, pos, bt=16, num_rows=pt.shape[0])
    tri = jax.jit(lambda: msa_kernel.block_scores(iq, ik, pt, pos, qbs, tiles=IndexTiles(bt=16, bp=32),
                                                  interpret=INTERPRET))()
    kw = dict(topk=S["topk"], local_blocks=1)
    want_ids = np.asarray(msa_ref.paged_select_blocks(iq, ik, pt, tr, pos, **kw))
    out: dict[str, Any] = {"pages_per_row": P}
    ok = True
    for bp, stages in ((32, 4), (64, 3)):
        if bp > ps:
            continue
        got = jax.jit(lambda bp=bp, st=stages: kernel_mgpu.block_scores(iq, ik, pt, tr, pos, bp=bp, stages=st,
                                                                         interpret=INTERPRET))()
        same = bool(np.array_equal(np.asarray(got)[..., :P], np.asarray(tri)[..., :P]))
        out[f"scores_bp{bp}_s{stages}_equal_triton"] = same
        ok &= same
    tiles = IndexTiles(bt=16, bp=32, num_stages=4, backend="mosaic")
    for name, t in (("ids_pallas_topk", tiles),
                    ("ids_fused_topk", dataclasses.replace(tiles, bp=32 * -(-P // 32), topk="fused"))):
        ids = jax.jit(lambda t=t: msa_kernel.paged_select_blocks(iq, ik, pt, tr, pos, tiles=t, interpret=INTERPRET,
                                                                 **kw))()
        same = bool(np.array_equal(np.asarray(ids), want_ids))
        out[f"{name}_equal_reference"] = same
        ok &= same
    return {**out, "ok": ok}


def case_moe(fmt: str, widen: str | None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.timing import rel_err
    from checkpoints.prepare import prepare_moe
    from pallas_kernels.moe import kernel, layout, reference
    from pallas_kernels.moe.tiles import KernelTiles, MoeTiles, pick_tiles

    E, D, F, T = S["E"], S["Dm"], S["F"], S["T"]
    kw = {"top_k": 4, "routed_scaling": 2.0, "alpha": 1.702, "limit": 7.0}
    ks = jax.random.split(jax.random.PRNGKey(0), 9)
    n = lambda k, *s, std: (jax.random.normal(k, s, jnp.float32) * std).astype(jnp.bfloat16)  # noqa: E731
    params = {"router": n(ks[0], D, E, std=D ** -0.5), "router_bias": jnp.zeros((E,), jnp.float32),
              "w_gate": n(ks[1], E, D, F, std=3 * D ** -0.5), "w_up": n(ks[2], E, D, F, std=3 * D ** -0.5),
              "w_down": n(ks[3], E, F, D, std=F ** -0.5),
              "shared": {"w_gate": n(ks[4], D, F, std=3 * D ** -0.5), "w_up": n(ks[5], D, F, std=3 * D ** -0.5),
                         "w_down": n(ks[6], F, D, std=F ** -0.5)}}
    p = prepare_moe(params, fmt, keep_reference=False)
    h = (jax.random.normal(ks[7], (T, D), jnp.float32) * 2.0).astype(jnp.bfloat16)
    k = KernelTiles
    if fmt == "bf16":
        dn = k(128, 64, 4, 2) if INTERPRET else k(256, 64, 4, 3)
        mosaic = MoeTiles("prefill", bm=128, gu=k(128, 64, 4, 3), dn=dn, group=2, backend="mosaic")
    elif widen == "swap":
        mosaic = MoeTiles("prefill", bm=128, gu=k(128, 128, 4, 2), dn=k(128, 128, 4, 3), group=1, backend="mosaic",
                          mx_widen="swap")
    else:
        mosaic = MoeTiles("prefill", bm=128, gu=k(64, 128, 4, 2), dn=k(128, 128, 4, 2), group=1, backend="mosaic",
                          mx_widen=widen)
    triton = pick_tiles(T, fmt, interpret=INTERPRET)
    run = jax.jit(lambda h, p, t: kernel.moe_pallas(h, p, tiles=t, interpret=INTERPRET, **kw), static_argnums=2)
    got, tri = run(h, p, mosaic).astype(jnp.float32), run(h, p, triton).astype(jnp.float32)
    want = reference.moe(h, layout.reference_params(p, jnp.bfloat16), **kw).astype(jnp.float32)
    out = {"mosaic_tiles": str(mosaic), "triton_tiles": str(triton), "rel_err_vs_triton": rel_err(got, tri),
           "rel_err_vs_reference": rel_err(got, want), "triton_rel_err_vs_reference": rel_err(tri, want),
           "finite": bool(np.isfinite(np.asarray(got)).all())}
    return {**out, "ok": out["finite"] and out["rel_err_vs_triton"] < 2e-3 and out["rel_err_vs_reference"] < 2e-2}


def run_case(name: str) -> dict:
    if name == "dense":
        return case_dense()
    if name == "index":
        return case_index()
    if name == "sparse":
        return case_sparse()
    fmt, _, widen = name.removeprefix("moe-").partition("-")
    return case_moe(fmt, widen or None)


def main() -> None:
    global S, INTERPRET
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--timeout-s", type=float, default=90.0, help="per case (compiles included)")
    ap.add_argument("--small", action="store_true", help="toy shapes in jax's GPU interpreter (a CPU dry run)")
    ap.add_argument("--out", default="benchmarks/results/mosaic-check.json")
    ap.add_argument("--one", choices=CASES, help=argparse.SUPPRESS)  # the child process: one case, JSON on stdout
    a = ap.parse_args()
    if a.one:
        S, INTERPRET = SHAPES["small" if a.small else "full"], a.small
        import jax

        from benchmarks.timing import git_rev

        t = time.perf_counter()
        rec = {"device": jax.devices()[0].device_kind, "git_rev": git_rev(), **run_case(a.one)}
        print("RESULT " + json.dumps({**rec, "seconds": round(time.perf_counter() - t, 1)}), flush=True)
        return
    # No jax in this process: each child has the device (and its memory) to itself.
    records: list[dict] = []
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in a.cases:
        t = time.perf_counter()
        rec: dict[str, Any] = {"case": name}
        cmd = [sys.executable, __file__, "--one", name] + (["--small"] if a.small else [])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if lines:
                rec.update(json.loads(lines[-1].removeprefix("RESULT ")))
            else:
                rec.update(ok=False, error=f"exit {p.returncode}: {(p.stderr or p.stdout)[-800:]}")
        except subprocess.TimeoutExpired:
            rec.update(ok=False, error=f"no result in {a.timeout_s:.0f} s (a hang, or compiles past the timeout)")
        rec["wall_s"] = round(time.perf_counter() - t, 1)
        records.append(rec)
        print(f"[check-mosaic] {name}: ok={rec.get('ok')} {json.dumps(rec)[:600]}", flush=True)
        out.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
