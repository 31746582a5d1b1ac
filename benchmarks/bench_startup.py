"""Engine start-up at the real model's depth: compile cost per step shape, and process start to ready.

Three measurements, each run in fresh processes so that only what is on disk can help:

- `shapes`: one step executable per token bucket, for m3-slice (4 layers) and m3-full (60 layers), built from
  abstract weights (shapes only: nothing is allocated, so m3-full fits anywhere). Per bucket: tracing +
  lowering, and XLA's compile when a GPU is present (without one it lowers for an abstract H200: the Pallas
  machine: the Pallas Triton lowering runs, the compile does not). The projected cold start of m3-full is the
  sum over its buckets.
- `serve`: `m3jax serve` from process start to its ready line, with an empty cache (cold) and again (warm).
- `depth`: the same, on tiny checkpoints of 6 and 48 layers with the embedded model's widths (the CPU check
  that start-up does not grow with depth).

    PYTHONPATH=. python benchmarks/bench_startup.py shapes [--presets m3-slice m3-full] [--buckets 256 8192]
    PYTHONPATH=. python benchmarks/bench_startup.py serve --model m3-slice --max-num-seqs 128 \\
        --max-num-batched-tokens 8192
    PYTHONPATH=. python benchmarks/bench_startup.py depth
    ... --out benchmarks/results/startup-h200.json (records are appended to the file's list)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.timing import git_rev

ROOT = Path(__file__).resolve().parents[1]


def _device() -> str:
    import jax

    return jax.devices()[0].device_kind


# ---- shapes: per-bucket trace + lower + compile with abstract weights ---------------------------------------

def abstract_model(preset_name: str, moe_format: str) -> Any:
    """An M3Model whose params are shapes only (what tracing needs), laid out as the kernels want them."""
    from m3jax.api import M3Model
    from m3jax.config import preset
    from pallas_kernels.choice import KernelChoice

    return M3Model.abstract(preset(preset_name), "bfloat16", moe_format, KernelChoice("pallas", "pallas"))


def measure_shapes(args: argparse.Namespace) -> list[dict[str, Any]]:
    import jax

    from serving.runner import ModelRunner

    gpu = jax.default_backend() == "gpu"
    records = []
    for name in args.presets:
        model = abstract_model(name, args.moe_format)
        runner = ModelRunner(model, num_pages=args.num_pages, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=max(args.buckets), max_model_len=args.max_model_len,
                             cache_dir=None)
        for tokens in args.buckets:
            abstract = runner._abstract_args("forward", tokens)
            if not gpu:  # shapes only: CPU placements would not match the abstract GPU
                abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract)
            t0 = time.perf_counter()
            if gpu:
                traced = runner.jitted("forward", tokens).trace(*abstract)
                t1 = time.perf_counter()
                lowered = traced.lower()
            else:
                from pallas_kernels.gpu_lowering import abstract_gpu

                with abstract_gpu():
                    traced = runner.jitted("forward", tokens).trace(*abstract)
                    t1 = time.perf_counter()
                    lowered = traced.lower(lowering_platforms=("cuda",))
            t2 = time.perf_counter()
            compile_s = None
            if gpu:
                lowered.compile()
                compile_s = time.perf_counter() - t2
            rec = {"op": "step_compile", "preset": name, "layers": model.cfg.num_layers,
                   "runs": len(model.cfg.layer_runs), "tokens": tokens, "rows": runner.rows_for(tokens),
                   "trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": compile_s,
                   "total_s": t2 - t0 + (compile_s or 0.0), "moe_format": args.moe_format,
                   "lowered_for": "gpu" if gpu else "abstract H200", "device": _device(), "git_rev": git_rev()}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    by = {(r["preset"], r["tokens"]): r["total_s"] for r in records}
    for tokens in args.buckets:
        if ("m3-full", tokens) in by and ("m3-slice", tokens) in by:
            ratio = by[("m3-full", tokens)] / by[("m3-slice", tokens)]
            records.append({"op": "step_compile_depth_ratio", "tokens": tokens, "full_over_slice": ratio,
                            "device": _device(), "git_rev": git_rev()})
            print(json.dumps(records[-1]), flush=True)
    return records


# ---- serve / depth: process start to ready ------------------------------------------------------------------

def time_to_ready(serve_args: list[str], cache: str, timeout: float) -> dict[str, Any]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "M3JAX_COMPILATION_CACHE": cache, "PYTHONPATH": path, "M3JAX_NO_PROGRESS": "1"}
    cmd = [sys.executable, "-m", "m3jax", "serve", "--grpc-port", "0", "--http-port", "0", *serve_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "ready:" in line:
                ready = time.perf_counter() - t0
                break
            if time.perf_counter() - t0 > timeout:
                break
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    if ready is None:
        raise RuntimeError(f"the server did not get ready; its log ends:\n{err[-3000:]}")
    m = re.search(r"engine ready in ([0-9.]+)s.*?(\d+) step executables", err)
    return {"ready_s": ready, "engine_s": float(m.group(1)) if m else None,
            "executables": int(m.group(2)) if m else None}


def measure_serve(args: argparse.Namespace, label: str, serve_args: list[str]) -> list[dict[str, Any]]:
    """Cold (empty cache directory) then warm. `--cache-dir` keeps the cache for later commands; it must not
    exist yet, so the cold start is cold."""
    records = []
    keep = getattr(args, "cache_dir", None)
    if keep and Path(keep).exists():
        raise SystemExit(f"--cache-dir {keep} exists: a cold start needs an empty one")
    with (contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="m3jax-startup-")) as cache:
        for start in ("cold", "warm"):
            rec = {"op": "serve_startup", "case": label, "start": start, "args": serve_args,
                   **time_to_ready(serve_args, cache, args.timeout), "device": _device(), "git_rev": git_rev()}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    return records


def deep_tiny_checkpoint(directory: Path, num_layers: int) -> Path:
    """The embedded model's widths at another depth: a dense first layer, then MSA; two dense MLPs, then MoE."""
    from checkpoints import make_tiny_checkpoint, read_config
    from m3jax.api import embedded_model_path

    cfg = read_config(embedded_model_path())
    cfg = cfg.replace(num_layers=num_layers, attn_types=("dense",) + ("sparse",) * (num_layers - 1),
                      mlp_types=("dense", "dense") + ("moe",) * (num_layers - 2))
    out = directory / f"tiny-{num_layers}"
    make_tiny_checkpoint(out, cfg)
    return out


def measure_depth(args: argparse.Namespace) -> list[dict[str, Any]]:
    records = []
    with tempfile.TemporaryDirectory(prefix="m3jax-depth-") as tmp:
        for layers in args.depths:
            path = deep_tiny_checkpoint(Path(tmp), layers)
            records += measure_serve(args, f"tiny-{layers}-layers", ["--model", str(path), *args.engine_args])
    by = {(r["case"], r["start"]): r["ready_s"] for r in records}
    lo, hi = min(args.depths), max(args.depths)
    for start in ("cold", "warm"):
        ratio = by[(f"tiny-{hi}-layers", start)] / by[(f"tiny-{lo}-layers", start)]
        records.append({"op": "serve_startup_depth_ratio", "start": start, "layers": [lo, hi],
                        "deep_over_shallow": ratio, "device": _device(), "git_rev": git_rev()})
        print(json.dumps(records[-1]), flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sh = sub.add_parser("shapes")
    sh.add_argument("--presets", nargs="+", default=["m3-slice", "m3-full"])
    sh.add_argument("--buckets", type=int, nargs="+", default=[256, 8192])
    sh.add_argument("--max-num-seqs", type=int, default=128)
    sh.add_argument("--max-model-len", type=int, default=8192)
    sh.add_argument("--num-pages", type=int, default=64, help="abstract only: the pool is never allocated")
    sh.add_argument("--moe-format", default="bf16", choices=("bf16", "mxfp8", "mxfp4"))
    sv = sub.add_parser("serve")
    sv.add_argument("--model", default="m3-slice")
    sv.add_argument("--max-num-seqs", type=int, default=128)
    sv.add_argument("--max-num-batched-tokens", type=int, default=8192)
    sv.add_argument("--max-model-len", type=int, default=None)
    sv.add_argument("--cache-dir", default=None, help="keep the compiled steps here (a new directory)")
    dp = sub.add_parser("depth")
    dp.add_argument("--depths", type=int, nargs="+", default=[6, 48])
    for p in (sh, sv, dp):
        p.add_argument("--timeout", type=float, default=1800.0)
        p.add_argument("--out", default=None)
    args = ap.parse_args()

    if args.what == "shapes":
        records = measure_shapes(args)
    elif args.what == "serve":
        extra = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
        records = measure_serve(args, args.model, ["--model", args.model, "--max-num-seqs", str(args.max_num_seqs),
                                                   "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                                   *extra])
    else:
        args.engine_args = ["--dtype", "float32", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                            "--max-model-len", "512"]
        records = measure_depth(args)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"startup-{_device().replace(' ', '_')}.json")
    old = json.loads(out.read_text()) if out.is_file() else []
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([*(old if isinstance(old, list) else [old]), *records], indent=2) + "\n")


if __name__ == "__main__":
    main()
