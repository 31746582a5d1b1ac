"""What a step's host arrays cost to hand to an executable: the forward's 12 numpy arguments (a step's Batch,
prev_index and HistoryRows) passed one by one, against the same values packed into one int32 array that the
executable slices apart. Host seconds per call (the dispatch, which includes the host-to-device copies) and
seconds to a ready result, at a decode step's and a 1k prefill's shapes.

    python benchmarks/probe_host_args.py --out benchmarks/results/host-args-<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import git_rev


def host_arrays(T: int, R: int, P: int) -> list[np.ndarray]:
    rng = np.random.default_rng(T)
    ints = lambda *s: rng.integers(0, 1000, s).astype(np.int32)  # noqa: E731
    # Batch: token_ids, positions, token_row, slot_mapping [T]; page_table [R, P]; logit_rows [R];
    # query_start [R + 1]; seq_lens [R]; prev_index [T]; HistoryRows: slot, prompt_len [R], reset bool [R].
    return [ints(T), ints(T), ints(T), ints(T), ints(R, P), ints(R), ints(R + 1), ints(R), ints(T), ints(R),
            ints(R), rng.integers(0, 2, R).astype(bool)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--pages-per-row", type=int, default=136)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 1024])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    def consume(*xs):  # touches every array, as the forward does
        return sum(jnp.sum(x.astype(jnp.int32)) for x in xs)

    records = []
    for T in args.tokens:
        arrays = host_arrays(T, args.rows, args.pages_per_row)
        shapes = [(a.shape, a.dtype) for a in arrays]

        def unpack(flat, shapes=shapes):
            out, at = [], 0
            for shape, dtype in shapes:
                n = int(np.prod(shape))
                out.append(flat[at:at + n].reshape(shape).astype(dtype))
                at += n
            return out

        separate = jax.jit(consume)
        packed = jax.jit(lambda flat: consume(*unpack(flat)))
        rec = {"op": "host_args", "tokens": T, "rows": args.rows, "pages_per_row": args.pages_per_row,
               "arrays": len(arrays)}
        for name, fn, make in [("separate", separate, lambda arrays=arrays: arrays),
                               ("packed", packed, lambda arrays=arrays: [np.concatenate(
                                   [a.astype(np.int32).ravel() for a in arrays])])]:
            jax.block_until_ready(fn(*make()))
            host, total = [], []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                a = make()  # packing is part of the packed path's cost
                y = fn(*a)
                t1 = time.perf_counter()
                jax.block_until_ready(y)
                host.append(t1 - t0)
                total.append(time.perf_counter() - t0)
            rec[f"{name}_host_s"] = statistics.median(host)
            rec[f"{name}_ready_s"] = statistics.median(total)
        rec |= {"device": jax.devices()[0].device_kind, "git_rev": git_rev()}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
