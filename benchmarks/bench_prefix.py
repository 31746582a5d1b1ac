"""Time to first token for requests that share a long prompt prefix, with the prefix cache and without it.

A conversation's later turns, or many requests behind one system prompt: each request is the same
`--prefix-len`-token prefix plus its own `--suffix-len` tokens. The first request computes the prefix; each
later one, sent alone after the previous finished, finds the prefix's full pages in the cache and computes only
its last partial page and its suffix. TTFT is measured from submission to the first streamed token.

    PYTHONPATH=. python benchmarks/bench_prefix.py [--model DIR|preset] [--prefix-len 4000] [--requests 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.timing import git_rev


def ttfts(llm: Any, prompts: list[list[int]]) -> list[float]:
    from serving.outputs import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = []
    for p in prompts:
        t0 = time.perf_counter()
        stream = llm.stream(p, params)
        next(stream)
        out.append(time.perf_counter() - t0)
        for _ in stream:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory or preset (default: the embedded model)")
    ap.add_argument("--prefix-len", type=int, default=4000)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax

    from serving import LLM

    rng = np.random.default_rng(0)
    length = args.prefix_len + args.suffix_len + 8
    records = []
    for cached in (False, True):
        with LLM(args.model, max_model_len=length, max_num_seqs=4, max_num_batched_tokens=args.max_num_batched_tokens,
                 enable_prefix_caching=cached, progress=False) as llm:
            vocab = llm.core.model.cfg.vocab_size
            prefix = rng.integers(3, vocab - 1, args.prefix_len).tolist()
            prompts = [prefix + rng.integers(3, vocab - 1, args.suffix_len).tolist() for _ in range(args.requests)]
            first, *later = ttfts(llm, prompts)
            rec = {"op": "prefix_ttft", "prefix_cache": cached, "prefix_len": args.prefix_len,
                   "suffix_len": args.suffix_len, "first_ttft_s": first, "later_ttft_s": later,
                   "median_later_ttft_s": statistics.median(later), "hits_tokens": llm.core.prefix_cache_hits,
                   "queries_tokens": llm.core.prefix_cache_queries, "model": args.model or "embedded",
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "device": jax.devices()[0].device_kind, "git_rev": git_rev()}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    gain = records[0]["median_later_ttft_s"] / records[1]["median_later_ttft_s"]
    records.append({"op": "prefix_ttft_gain", "uncached_over_cached": gain, "prefix_len": args.prefix_len})
    print(f"TTFT with a {args.prefix_len}-token shared prefix: {records[0]['median_later_ttft_s'] * 1e3:.1f} ms "
          f"without the cache, {records[1]['median_later_ttft_s'] * 1e3:.1f} ms with it ({gain:.1f}x)")
    device = records[0]["device"].replace(" ", "_")
    out = Path(args.out or f"benchmarks/results/prefix-ttft-{device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
