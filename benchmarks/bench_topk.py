"""The MSA index's Pallas top-k (`msa.kernel.topk_blocks`) at an 8k prefill chunk: rows per program x warps.

At an 8k chunk the top-k is the index op's second kernel (24 us kernel-busy on an H100 beside the scoring
kernel's 55 us), far above what it reads (8192 tokens x 4 index heads x 64 block scores in fp32: 8.4 MB, ~2.5 us
at HBM bandwidth). This sweeps its launch shape: each configuration's kernel-busy time (the GPU trace), and its
ids against the default configuration's, bit for bit. One request of `--tokens` tokens at positions 0.. (a
causal chunk: token t sees blocks 0 .. t // page), random scores on the visible blocks.

    PYTHONPATH=. python benchmarks/bench_topk.py --out benchmarks/results/topk-h100.json
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.devicewarm import gpu_state, warm_up_device
from benchmarks.timing import device_profile
from pallas_kernels.msa import kernel as msa_kernel

HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=4, help="index heads")
    ap.add_argument("--page", type=int, default=128)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--local-blocks", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--small", action="store_true", help="a CPU dry run in interpret mode (256 tokens)")
    ap.add_argument("--git-rev", default=os.environ.get("M3JAX_GIT_REV", "unknown"))
    ap.add_argument("--out", default="benchmarks/results/topk.json")
    a = ap.parse_args()
    T = 256 if a.small else a.tokens
    P = -(-T // a.page)
    W = 32 * -(-P // 32)  # the scoring kernel's output width (pages per program, a multiple of 32)
    rng = np.random.default_rng(0)
    pos = np.arange(T, dtype=np.int32)
    visible = np.arange(W)[None, :] <= (pos // a.page)[:, None]
    scores = np.where(visible[:, None, :], rng.normal(size=(T, a.heads, W)), -np.inf).astype(np.float32)
    scores_j, pos_j = jnp.asarray(scores), jnp.asarray(pos)
    device = jax.devices()[0].device_kind
    if not a.small:
        warm_up_device(2.0)
    bw = next((v for k, v in HBM_BYTES_PER_S.items() if k in device), None)
    floor_s = None if bw is None else (T * a.heads * W * 4 + T * a.heads * a.topk * 4) / bw

    def select(rows: int | None, warps: int):
        return jax.jit(lambda s, p: msa_kernel.topk_blocks(
            s, p, block_size=a.page, num_blocks=P, topk=a.topk, local_blocks=a.local_blocks, interpret=a.small,
            rows_per_program=rows, num_warps=warps))

    want = np.asarray(select(None, 4)(scores_j, pos_j))
    out: list[dict[str, Any]] = []
    for rows in a.rows:
        for warps in a.warps:
            row: dict[str, Any] = {"op": "msa_topk", "case": f"prefill-{T}", "variant": f"rows={rows} warps={warps}",
                                   "shape": {"tokens": T, "heads": a.heads, "width": W, "pages": P, "topk": a.topk},
                                   "device": device, "git_rev": a.git_rev, "floor_s": floor_s, "floor_kind": "bytes"}
            try:
                fn = select(rows, warps)
                row["same_ids_as_default"] = bool(np.array_equal(np.asarray(fn(scores_j, pos_j)), want))
                prof = device_profile(fn, [(scores_j, pos_j)], calls=2 if a.small else 20)
                row.update(prof)
                busy = prof.get("device_busy_s")
                row["time_s"] = busy
                row["ratio"] = None if busy is None or floor_s is None else busy / floor_s
            except Exception as e:  # noqa: BLE001 - one configuration failing must not end the sweep
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps({k: row.get(k) for k in ("variant", "time_s", "ratio", "same_ids_as_default", "error")}),
                  flush=True)
            out.append(row)
    if out and not a.small:
        out[0]["gpu_state"] = gpu_state()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
