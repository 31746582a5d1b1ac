"""Engine sizes that are not powers of two start and serve on the GPU: the smoke matrix of model lengths, row
counts and step budgets (a model length of 1280 used to crash start-up in the Triton lowering).

For each combination an engine core is built over one shared model (weights drawn once) and serves a ragged
batch of greedy requests, prompts from a few tokens to longer than the step budget (chunked prefill); one
request is checked against itself run alone. Each record says whether it started, served and freed every
page, with its timings.

    PYTHONPATH=. python benchmarks/smoke_sizes.py [--model m3-slice] [--out benchmarks/results/smoke-sizes-h200.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.timing import git_rev


def serve(core: Any, batch: list[list[int]], params: Any) -> list[list[int]]:
    """Greedy token ids of a batch of requests, stepping the (unstarted) core from this thread."""
    ids, done = [], {}
    for p in batch:
        req, text = core.prepare(p, params)
        ids.append(core.submit(req, text))
    while core.has_work():
        for out in core.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i].outputs[0].token_ids for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="m3-slice")
    ap.add_argument("--max-model-len", type=int, nargs="+", default=[1000, 1280, 4097])
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[3, 32])
    ap.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[100, 2048])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax

    from m3jax.settings import Settings
    from serving.core import EngineCore, load
    from serving.outputs import SamplingParams

    base = Settings(model=args.model, progress=False)
    t0 = time.perf_counter()
    model, tokenizer = load(base)
    print(f"model ready in {time.perf_counter() - t0:.1f}s", flush=True)
    device = jax.devices()[0].device_kind
    rev = git_rev()
    records = []
    out = Path(args.out or f"benchmarks/results/smoke-sizes-{device.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for max_len, seqs, budget in itertools.product(args.max_model_len, args.max_num_seqs,
                                                   args.max_num_batched_tokens):
        rec = {"op": "smoke_sizes", "model": args.model, "max_model_len": max_len, "max_num_seqs": seqs,
               "max_num_batched_tokens": budget, "device": device, "git_rev": rev}
        try:
            t = time.perf_counter()
            core = EngineCore(base.replace(max_model_len=max_len, max_num_seqs=seqs,
                                           max_num_batched_tokens=budget), model, tokenizer)
            rec["start_s"] = time.perf_counter() - t
            rng = np.random.default_rng(max_len + seqs + budget)
            longest = min(max_len - args.max_tokens - 1, 2 * budget + 37)
            lengths = np.linspace(3, longest, args.requests).astype(int)
            prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in lengths]
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            t = time.perf_counter()
            outs = serve(core, prompts, params)
            rec["serve_s"] = time.perf_counter() - t
            rec["equal_alone"] = serve(core, [prompts[-1]], params)[0] == outs[-1]
            rec["ok"] = all(len(o) == args.max_tokens for o in outs) and core.pages_in_use == 0
            rec["executables"] = core.num_executables
        except Exception as e:  # noqa: BLE001 - a size that fails is the finding: record it, go on
            rec["ok"] = False
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        print(json.dumps(rec), flush=True)
        records.append(rec)
        out.write_text(json.dumps(records, indent=2) + "\n")  # after each size: a run cut short keeps its part
    print(f"{sum(r['ok'] for r in records)} of {len(records)} sizes started and served", flush=True)


if __name__ == "__main__":
    main()
