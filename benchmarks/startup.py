"""Engine start-up time with a cold and a warm persistent compilation cache.

Each start runs in a fresh process (so only the on-disk cache can help): load the model, compile every
(token, row) bucket of the step, serve one request. Writes benchmarks/results/startup-<device>.json.

    python benchmarks/startup.py [--model DIR|preset] [--max-num-seqs 8] [--max-num-batched-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from serving import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
llm = LLM(**cfg, progress=False)
t1 = time.perf_counter()
llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps({"startup_s": t1 - t0, "warmup_s": llm.engine.warmup_seconds,
                  "buckets": len(llm.engine.runner.bucket_shapes()), "first_request_s": time.perf_counter() - t1}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = {"model": args.model, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
           "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len}
    root = Path(__file__).resolve().parents[1]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="m3jax-xla-") as cache:
        env = {**os.environ, "M3JAX_COMPILATION_CACHE": cache, "PYTHONPATH": str(root)}
        for name in ("cold", "warm"):
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], env=env, capture_output=True,
                                 text=True, check=True)
            runs[name] = {**json.loads(out.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t}
    import jax

    device = jax.devices()[0].device_kind
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root).stdout
    result = {"op": "engine_startup", "config": cfg, "device": device, "git_rev": rev.strip(), "runs": runs,
              "warm_over_cold": runs["warm"]["startup_s"] / runs["cold"]["startup_s"]}
    out_path = Path(args.out or root / "benchmarks" / "results" / f"startup-{device.replace(' ', '_')}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
