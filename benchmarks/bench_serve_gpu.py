"""The benchmark contract (../shared/benchmark-contract.md) served end to end on one GPU: `m3jax serve` in a
subprocess, `m3jax bench serve` against it from the same machine, then the bare model's decode step at the same
batches and its prefill of one prompt (`bench_slice_decode.py`), so that the served figures sit beside the step
the engine could reach.

Writes one record per (lengths, concurrency) in the issue's format to `--out` (a JSON list):
`op: "serve"`, moe_format, isl, osl, concurrency, num_prompts, output/total tok/s per GPU, TTFT and TPOT medians,
`engine_step_s` (the server's own mean decode step over the level, from its /metrics), `bare_step_s` (the bare
decode step at the level's mean decode batch, interpolated between the measured batches), their ratio, and at
concurrency 1 `ttft_over_bare_prefill`. The per-level `m3jax bench serve` JSON and the PNG land beside it.

    PYTHONPATH=. python benchmarks/bench_serve_gpu.py --moe-format bf16 \\
        --sweep 1024x1024:1,8,32,64,128 --sweep 8192x1024:8,32 --prompts-per-concurrency 2
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def parse_sweep(text: str) -> tuple[int, int, list[int]]:
    """'1024x1024:1,8,32' -> (1024, 1024, [1, 8, 32])."""
    lengths, _, levels = text.partition(":")
    isl, _, osl = lengths.partition("x")
    return int(isl), int(osl), [int(c) for c in levels.split(",") if c]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the server was not ready within {timeout:.0f} s")


def _s(ms: float | None) -> float | None:
    return ms / 1e3 if ms is not None else None


def bare_at(bare: dict[int, float], rows: float) -> float:
    """The bare decode step at a (fractional) mean batch, linear between the measured batches."""
    xs = sorted(bare)
    return float(np.interp(rows, xs, [bare[x] for x in xs]))


def _py_spy() -> str | None:
    """py-spy's binary: on PATH, or in a `bin/` beside a PYTHONPATH entry (a `pip install --target` of its wheel)."""
    found = shutil.which("py-spy")
    if found:
        return found
    candidates = (Path(e) / "bin" / "py-spy" for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e)
    return next((str(c) for c in candidates if c.exists()), None)


def _children(pid: int) -> list[int]:
    """The process's Python children but multiprocessing's resource tracker: the engine process of `m3jax serve`
    (`--engine-process`, the default)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                if b"resource_tracker" not in cmdline:
                    out.append(int(child))
    return out


def gil_profile(pid: int, cmd: list[str], env: dict, raw_path: Path, rate: int = 250,
                mode: str = "gil") -> dict | None:
    """Run `cmd` (a bench level) while py-spy samples the process `pid` and each of its children (the engine
    process: `<raw_path stem>-engine`); write the raw stacks to `raw_path` and a summary beside each (`.json`).
    mode "gil": only samples where a thread holds the GIL (the GIL's busy fraction, per thread, and the functions
    that hold it most); "native": every thread at every sample, idle and native (C/C++) frames included (where a
    thread's time goes while it does not hold the GIL)."""
    spy = _py_spy()
    if spy is None:
        print("[serve-gpu] py-spy not found: no GIL profile", flush=True)
        return None
    # Native stacks need the process paused at each sample: a lower rate keeps that from pacing the steps.
    how = ["--gil", "--nonblocking"] if mode == "gil" else ["--idle", "--native"]
    rate = rate if mode == "gil" else min(rate, 100)
    paths = {pid: raw_path}
    for i, child in enumerate(_children(pid)):
        paths[child] = raw_path.with_name(f"{raw_path.stem}-engine{i or ''}{raw_path.suffix}")
    recs = [subprocess.Popen([spy, "record", "--pid", str(p), *how, "--threads", "--rate", str(rate), "--format",
                              "raw", "-o", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            for p, path in paths.items()]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=False)
    seconds = time.perf_counter() - t0
    for rec in recs:
        rec.send_signal(signal.SIGINT)  # py-spy writes its samples on SIGINT
    for rec in recs:
        try:
            rec.wait(timeout=60)
        except subprocess.TimeoutExpired:
            rec.kill()
    summaries = {}
    for path in paths.values():
        if not path.exists():
            print(f"[serve-gpu] py-spy wrote nothing to {path.name} (no ptrace permission?)", flush=True)
            continue
        summary = summarise_stacks(path.read_text(), rate * seconds)
        summary.update(mode=mode, seconds=seconds, rate_hz=rate, command=cmd)
        path.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"[serve-gpu] py-spy ({mode}) {path.name}: {summary['samples']} samples over {seconds:.1f} s "
              f"({summary['gil_busy_fraction']:.0%} of the possible per thread): {summary['by_thread']}", flush=True)
        summaries[path.stem] = summary
    return summaries or None


def summarise_stacks(raw: str, possible_samples: float, top: int = 40) -> dict:
    """py-spy raw stacks ("thread (tid): name;frame;frame... count" per line) -> per-thread sample shares and, per
    thread with 5% of the samples or more, its `top` functions by inclusive samples."""
    by_thread: dict[str, int] = {}
    inclusive: dict[tuple[str, str], int] = {}
    for line in raw.splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        by_thread[thread] = by_thread.get(thread, 0) + int(count)
        for fn in {re.sub(r":\d+\)$", ")", f) for f in frames[1:]}:
            inclusive[(thread, fn)] = inclusive.get((thread, fn), 0) + int(count)
    total = sum(by_thread.values())
    ranked = sorted(inclusive.items(), key=lambda kv: -kv[1])
    major = [t for t, n in by_thread.items() if n >= 0.05 * total]
    return {"gil_busy_fraction": total / possible_samples if possible_samples else None, "samples": total,
            "by_thread": {t: n / max(total, 1) for t, n in sorted(by_thread.items(), key=lambda kv: -kv[1])},
            "top_inclusive": {t: [{"function": f, "share_of_thread": n / by_thread[t]}
                                  for (th, f), n in ranked if th == t][:top] for t in major}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="m3-slice")
    ap.add_argument("--moe-format", default="bf16", choices=("bf16", "mxfp8", "mxfp4"))
    ap.add_argument("--sweep", action="append", default=None, help="ISLxOSL:c1,c2,... (repeatable)")
    ap.add_argument("--prompts-per-concurrency", type=float, default=10.0)
    ap.add_argument("--warmups-per-concurrency", type=float, default=2.0)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--port", type=int, default=18000)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--server-args", default="", help="more `m3jax serve` flags, space separated")
    ap.add_argument("--result-dir", default="benchmarks/results")
    ap.add_argument("--gpu-name", default="h200", help="names the result files")
    ap.add_argument("--out", default=None, help="default: <result-dir>/serve-<gpu-name>-<moe-format>.json")
    ap.add_argument("--profile-concurrency", type=int, default=None,
                    help="after the sweeps, one more 1k/1k level at this concurrency with py-spy sampling the "
                         "server's threads while they hold the GIL (who sets the pace of a host-bound step)")
    ap.add_argument("--profile-mode", default="gil", choices=("gil", "native"),
                    help="gil: sample only while a thread holds the GIL (who holds it, and how busy it is); "
                         "native: every thread all the time, idle and native frames too (where the rest goes), "
                         "but py-spy pauses the process for each sample: on the H100 a c128 level ran about 5x "
                         "slower under it")
    ap.add_argument("--bare-from", default=None,
                    help="the bare step records of an earlier run on this machine (same model and format), "
                         "instead of measuring them again")
    args = ap.parse_args()
    sweeps = [parse_sweep(s) for s in (args.sweep or ["1024x1024:1,8,32,64,128", "8192x1024:8,32"])]
    max_len = max(isl + osl for isl, osl, _ in sweeps) + 128
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    url = f"http://127.0.0.1:{args.port}"
    server_cmd = [sys.executable, "-m", "m3jax", "serve", "--model", args.model, "--moe-weight-format",
                  args.moe_format, "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                  str(args.max_num_batched_tokens), "--max-model-len", str(max_len), "--host", "127.0.0.1",
                  "--http-port", str(args.port), "--grpc-port", str(args.port + 1), "--no-progress",
                  *args.server_args.split()]
    log_path = result_dir / f"serve-{args.gpu_name}-{args.moe_format}-server.log"
    print("[serve-gpu] " + " ".join(server_cmd), flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready_s = wait_ready(url, proc, args.ready_timeout)
            print(f"[serve-gpu] ready in {ready_s:.1f} s", flush=True)
            tags = []
            for isl, osl, levels in sweeps:
                tag = f"serve-{args.gpu_name}-{args.moe_format}-{isl}x{osl}"
                tags.append((isl, osl, levels, tag))
                cmd = [sys.executable, "-m", "m3jax", "bench", "serve", "--base-url", url, "--input-len", str(isl),
                       "--output-len", str(osl), "--concurrency", ",".join(map(str, levels)),
                       "--prompts-per-concurrency", str(args.prompts_per_concurrency),
                       "--warmups-per-concurrency", str(args.warmups_per_concurrency),
                       "--result-dir", str(result_dir), "--tag", tag,
                       *([] if importlib.util.find_spec("matplotlib") else ["--no-plot"])]
                subprocess.run(cmd, cwd=REPO, env=env, check=False)
            if args.profile_concurrency:
                isl, osl = sweeps[0][:2]
                tag = f"serve-{args.gpu_name}-{args.moe_format}-profile"
                cmd = [sys.executable, "-m", "m3jax", "bench", "serve", "--base-url", url, "--input-len", str(isl),
                       "--output-len", str(osl), "--concurrency", str(args.profile_concurrency),
                       "--prompts-per-concurrency", "1", "--warmups-per-concurrency", "0.25",
                       "--result-dir", str(result_dir), "--tag", tag, "--no-plot"]
                gil_profile(proc.pid, cmd, env, result_dir / f"{tag}-{args.profile_mode}.txt",
                            mode=args.profile_mode)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()

    # The bare step at the decode batches the levels ran, at the 1k sweep's mean context, and the bare prefill.
    served = []
    for isl, osl, levels, tag in tags:
        for c in levels:
            path = result_dir / f"{tag}-c{c}.json"
            if path.exists():
                served.append((isl, osl, c, json.loads(path.read_text())))
    batches = sorted({1, *[c for *_, c, _ in served]})
    bare_path = result_dir / f"serve-{args.gpu_name}-{args.moe_format}-bare.json"
    context = int(0.9 * sweeps[0][0] + sweeps[0][1] / 2)  # mean prompt (range 0.8-1.0) plus half the output
    prefill_len = int(0.9 * sweeps[0][0])  # the median prompt of the first sweep
    bare_cmd = [sys.executable, "benchmarks/bench_slice_decode.py", "--preset", args.model, "--batches",
                *map(str, batches), "--context", str(context), "--moe-format", args.moe_format,
                "--prefill-lens", str(prefill_len), "--out", str(bare_path)]
    if args.bare_from:
        bare_path = Path(args.bare_from)
    else:
        subprocess.run(bare_cmd, cwd=REPO, env=env, check=True)
    bare_records = json.loads(bare_path.read_text())
    bare = {r["shape"]["batch"]: r["time_s"] for r in bare_records if r["op"] == "m3_slice_decode_step"}
    prefill = {r["shape"]["tokens"]: r["time_s"] for r in bare_records if r["op"] == "m3_slice_prefill"}

    records = []
    for isl, osl, c, rec in served:
        m = rec["metrics"]
        engine_s = m["engine_decode_step_ms"] / 1e3 if m.get("engine_decode_step_ms") else None
        rows = m.get("engine_decode_rows_mean") or c
        bare_s = bare_at(bare, rows)
        out = {"op": "serve", "moe_format": args.moe_format, "isl": isl, "osl": osl, "concurrency": c,
               "num_prompts": rec["config"]["num_prompts"], "num_warmups": rec["config"]["num_warmups"],
               "output_tok_s_per_gpu": m["output_throughput_per_gpu"],
               "total_tok_s_per_gpu": m["total_token_throughput_per_gpu"],
               "ttft_median_s": m["median_ttft_ms"] / 1e3, "tpot_median_s": m["median_tpot_ms"] / 1e3,
               "itl_median_s": m["median_itl_ms"] / 1e3, "e2e_median_s": m["median_e2el_ms"] / 1e3,
               "ttft_mean_s": m["mean_ttft_ms"] / 1e3, "server_ttft_mean_s": _s(m.get("server_ttft_mean_ms")),
               "server_queue_mean_s": _s(m.get("server_queue_mean_ms")),
               "server_prefill_mean_s": _s(m.get("server_prefill_mean_ms")),
               "server_handoff_mean_s": _s(m.get("server_handoff_mean_ms")),
               "server_delivery_mean_s": _s(m.get("server_delivery_mean_ms")),
               "engine_step_period_s": _s(m.get("engine_step_period_ms")),
               "engine_device_wait_per_step_s": _s(m.get("engine_device_wait_ms_per_step")),
               "engine_tokens_per_step": m.get("engine_tokens_per_step"),
               "ttft_p99_s": m["p99_ttft_ms"] / 1e3, "tpot_p99_s": m["p99_tpot_ms"] / 1e3,
               "engine_step_s": engine_s, "engine_decode_rows_mean": rows, "bare_step_s": bare_s,
               "bare_context": context, "engine_step_ratio": engine_s / bare_s if engine_s else None,
               "failed": m["failed"], "device": rec["device"], "git_rev": os.environ.get("M3JAX_GIT_REV")
               or rec.get("git_revision"), "server_ready_s": ready_s}
        if c == 1 and int(0.9 * isl) in prefill:
            out["bare_prefill_s"] = prefill[int(0.9 * isl)]
            out["ttft_over_bare_prefill"] = out["ttft_median_s"] / out["bare_prefill_s"]
        records.append(out)
        print(json.dumps(out), flush=True)
    dest = Path(args.out or result_dir / f"serve-{args.gpu_name}-{args.moe_format}.json")
    dest.write_text(json.dumps(records, indent=2) + "\n")
    print(f"[serve-gpu] {len(records)} records -> {dest}", flush=True)


if __name__ == "__main__":
    main()
