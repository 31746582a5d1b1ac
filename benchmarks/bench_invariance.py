"""Greedy batch invariance of the serving engine on the GPU (issue 27), and what it costs.

Engine part: 32 ragged requests on `m3-slice` in bf16 with random weights (near-flat logits flip on the smallest
difference), greedy with ignore_eos. Per mode (`--modes default invariant`: `batch_invariant` off / on), the batch
is served `--repeats` times (median throughput and the engine's mean decode step are the cost figures; every
repeat must give the same tokens), then every request alone; with `--chunked`, also the whole batch again under a
64-token step budget (a second engine). Counts the requests whose tokens equal their batch tokens.

Ops part (`--ops`): which XLA ops give a row a result that depends on how many rows share the call. Row 0 of
x[:M] @ w for the model's GEMM shapes (a bf16 projection, the fp32 router, the lm_head) and of the RMS norm,
bitwise against M = 1, for M from 1 to 4096; and the same for the Pallas linear kernel's batch-invariant tiles.

    PYTHONPATH=. python benchmarks/bench_invariance.py [--modes default invariant] [--chunked] [--ops]
        [--baseline earlier-default-run.json]   (each mode in its own process: a failure keeps the other's figures)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import git_rev


def ops_probe(model: str, ms: list[int]) -> list[dict]:
    """Row 0 of each op at M rows, bitwise equal to M = 1 or not."""
    from m3jax.config import preset
    from m3jax.model import rms_norm
    from pallas_kernels.linear.dispatch import linear

    cfg = preset(model)
    d, v, e = cfg.hidden_size, cfg.vocab_size, cfg.num_experts
    key = jax.random.key(0)
    x = jax.random.normal(key, (max(ms), d), jnp.bfloat16)
    wq = (jax.random.normal(jax.random.fold_in(key, 1), (d, cfg.num_heads * cfg.head_dim)) * d ** -0.5).astype(
        jnp.bfloat16)
    router = jax.random.normal(jax.random.fold_in(key, 2), (d, e), jnp.float32) * d ** -0.5
    head = (jax.random.normal(jax.random.fold_in(key, 3), (d, v)) * d ** -0.5).astype(jnp.bfloat16)
    norm_w = jnp.ones((d,), jnp.bfloat16)
    impl = "pallas" if jax.default_backend() == "gpu" else "interpret"
    cases = {
        "xla_bf16_projection": jax.jit(lambda a: a @ wq),
        "xla_fp32_router": jax.jit(lambda a: a.astype(jnp.float32) @ router),
        "xla_lm_head": jax.jit(lambda a: jnp.einsum("td,dv->tv", a, head, preferred_element_type=jnp.float32)),
        "xla_rms_norm": jax.jit(lambda a: rms_norm(a, norm_w, 1e-6)),
        "pallas_invariant_projection": jax.jit(lambda a: linear(a, wq, impl=impl, invariant=True)),
        "pallas_invariant_lm_head": jax.jit(lambda a: linear(a.astype(jnp.float32), head, impl=impl,
                                                             invariant=True)),
    }
    out = []
    for name, fn in cases.items():
        ref = np.asarray(fn(x[:1]))[0]
        diff = {}
        for m in ms:
            row = np.asarray(fn(x[:m]))[0]
            diff[m] = float(np.max(np.abs(row.astype(np.float64) - ref.astype(np.float64))))
        rec = {"op": "row_invariance", "case": name, "max_abs_diff_by_m": diff,
               "invariant": all(v == 0.0 for v in diff.values()), "device": jax.devices()[0].device_kind,
               "git_rev": git_rev()}
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def first_diffs(got: list[list[int]], want: list[list[int]]) -> list[int | None]:
    """Per request, the first output position where `got` differs from `want` (None: equal)."""
    return [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            for a, b in zip(got, want, strict=True)]


def engine_run(args: argparse.Namespace, invariant: bool, prompts: list[list[int]]) -> dict:
    from serving import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    max_len = max(map(len, prompts)) + args.output_len + 64

    def engine(budget: int) -> LLM:
        t = time.perf_counter()
        llm = LLM(model=args.model, dtype="bfloat16", max_model_len=max_len, max_num_seqs=args.requests,
                  max_num_batched_tokens=budget, batch_invariant=invariant, progress=False)
        print(f"[invariance] engine (invariant={invariant}, budget {budget}) ready in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        return llm

    llm = engine(args.max_num_batched_tokens)
    stats = llm.core.stats
    def tokens(outs: list) -> list[list[int]]:
        """Each request's tokens; a failed step or a short output stops the benchmark (empty outputs would
        compare equal)."""
        for o in outs:
            if o.error or len(o.outputs[0].token_ids) != args.output_len:
                raise SystemExit(f"request {o.request_id} failed or stopped short: {o.error!r}, "
                                 f"{len(o.outputs[0].token_ids)} of {args.output_len} tokens")
        return [list(o.outputs[0].token_ids) for o in outs]

    tokens(llm.generate(prompts[:2], params, use_tqdm=False))  # first-use costs out of the timing
    # The batch `--repeats` times: a one-second batch's throughput moves by a quarter between machines, so the
    # median is the figure; every repeat must also give the same tokens (run-to-run determinism).
    before = dict(stats)
    runs, times = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        runs.append(tokens(llm.generate(prompts, params, use_tqdm=False)))
        times.append(time.perf_counter() - t)
    batch, batch_s = runs[0], float(np.median(times))
    steps = stats["decode_steps"] - before.get("decode_steps", 0)
    step_s = (stats["decode_step_us"] - before.get("decode_step_us", 0)) / 1e6 / max(steps, 1)
    alone = [tokens(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    llm.core.shutdown()
    del llm
    rec = {"op": "batch_invariance", "mode": "invariant" if invariant else "default", "model": args.model,
           "requests": len(prompts), "prompt_tokens_mean": float(np.mean([len(p) for p in prompts])),
           "prompt_lens": [len(p) for p in prompts], "output_len": args.output_len,
           "max_num_batched_tokens": args.max_num_batched_tokens,
           "equal_alone": sum(a == b for a, b in zip(alone, batch, strict=True)),
           "first_diff_alone": first_diffs(alone, batch),
           "batch_s": batch_s, "batch_s_all": times, "repeats_equal": all(r == batch for r in runs),
           "output_tok_s": len(prompts) * args.output_len / batch_s,
           "engine_decode_step_s": step_s, "device": jax.devices()[0].device_kind, "git_rev": git_rev()}
    if args.chunked:
        small = engine(args.chunk_budget)
        chunked = tokens(small.generate(prompts, params, use_tqdm=False))
        small.core.shutdown()
        rec["chunk_budget"] = args.chunk_budget
        rec["equal_chunked"] = sum(a == b for a, b in zip(chunked, batch, strict=True))
        rec["first_diff_chunked"] = first_diffs(chunked, batch)
    print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="m3-slice")
    ap.add_argument("--modes", nargs="*", default=["default", "invariant"], choices=("default", "invariant"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=580, help="mean prompt length (uniform in +-30%%)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3, help="times the batch is served (median time)")
    ap.add_argument("--chunked", action="store_true", help="also serve the batch under --chunk-budget")
    ap.add_argument("--chunk-budget", type=int, default=64)
    ap.add_argument("--ops", action="store_true", help="also probe XLA's GEMMs and norm for row invariance")
    ap.add_argument("--ops-m", type=int, nargs="*", default=[1, 2, 3, 8, 16, 33, 64, 128, 256, 1024, 4096])
    ap.add_argument("--baseline", default=None, help="a default-mode result file (another process's): the "
                    "invariant run's costs are computed against it")
    ap.add_argument("--out", default="benchmarks/results/invariance-h200.json")
    args = ap.parse_args()

    results = ops_probe(args.model, args.ops_m) if args.ops else []
    from m3jax.config import preset

    vocab = preset(args.model).vocab_size
    rng = np.random.default_rng(0)
    lo, hi = int(args.prompt_len * 0.7), int(args.prompt_len * 1.3)
    prompts = [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(args.requests)]
    by_mode = {}
    for mode in args.modes:
        by_mode[mode] = engine_run(args, mode == "invariant", prompts)
        results.append(by_mode[mode])
    if args.baseline and "default" not in by_mode:
        by_mode["default"] = next(r for r in json.loads(Path(args.baseline).read_text())
                                  if r.get("op") == "batch_invariance" and r["mode"] == "default")
    if {"default", "invariant"} <= set(by_mode):
        base, inv = by_mode["default"], by_mode["invariant"]
        inv["throughput_cost"] = 1.0 - inv["output_tok_s"] / base["output_tok_s"]
        inv["decode_step_cost"] = (inv["engine_decode_step_s"] / base["engine_decode_step_s"] - 1.0
                                   if base["engine_decode_step_s"] else None)
        print(json.dumps({"throughput_cost": inv["throughput_cost"], "decode_step_cost": inv["decode_step_cost"]}),
              flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
