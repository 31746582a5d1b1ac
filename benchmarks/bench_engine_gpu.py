"""The whole serving engine on one GPU: `m3-slice` (real M3 widths, random weights drawn on the device) behind
the scheduler, runner, on-device sampling and the Pallas kernels.

Measures bucket compilation at start-up, then serves a batch of requests (ragged prompts, greedy), checks that
each output equals the same request served alone (batch invariance on the GPU), and reports output throughput
and the mean decode-step time. Writes benchmarks/results/engine-<device>.json.

    PYTHONPATH=. python benchmarks/bench_engine_gpu.py [--requests 16] [--prompt-len 512] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.timing import git_rev


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="m3-slice")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--alone", type=int, default=3, help="requests re-run alone for the exactness check")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from serving import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=args.prompt_len + args.output_len + 128,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, progress=False)
    startup_s = time.perf_counter() - t0
    eng = llm.core
    print(f"start-up {startup_s:.1f}s ({eng.num_executables} executables, warm-up {eng.warmup_seconds:.1f}s)",
          flush=True)
    rng = np.random.default_rng(0)
    vocab = eng.model.cfg.vocab_size
    prompts = [rng.integers(0, vocab, int(rng.integers(args.prompt_len // 2, args.prompt_len))).tolist()
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    steps0 = eng.stats["steps"]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    batch_s = time.perf_counter() - t
    steps = eng.stats["steps"] - steps0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[: args.alone]]
    same = [a == o.outputs[0].token_ids for a, o in zip(alone, outs, strict=False)]
    # Decode-only steps: time a batch whose prompts are already prefilled is not separable here, so report the
    # mean step time over the whole run and the step count.
    rev = git_rev()
    result = {"op": "engine_generate", "model": args.model, "device": jax.devices()[0].device_kind,
              "git_rev": rev, "startup_s": startup_s, "warmup_s": eng.warmup_seconds,
              "buckets": eng.num_executables, "requests": args.requests,
              "prompt_tokens": sum(map(len, prompts)), "output_tokens": n_out, "batch_s": batch_s,
              "output_tok_per_s": n_out / batch_s, "steps": steps, "mean_step_s": batch_s / max(steps, 1),
              "alone_equal": same, "pages_in_use_after": eng.pages_in_use,
              "no_new_compiles": eng.num_executables == len(eng.runner.shapes())}
    print(json.dumps(result), flush=True)
    out = Path(args.out or f"benchmarks/results/engine-{result['device'].replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
