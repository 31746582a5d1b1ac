"""Where the host's time goes while it dispatches a compiled step: the engine's forward executables (a 1k-token
prefill and a batch-1 decode step) dispatched in a loop, each waited for before the next, so that the host's
share of a call is the dispatch alone. Records each executable's dispatch time, and, while the loop runs, prints
READY and the process id so that py-spy can sample it (`--native`: XLA's and the runtime's C++ frames too):

    python benchmarks/profile_dispatch.py --model m3-slice-1moe --seconds 20 --out dispatch.json &
    (wait for READY) py-spy record --pid PID --native --rate 250 --duration 10 --format raw -o dispatch.txt
    python benchmarks/profile_dispatch.py --summarise dispatch.txt --out dispatch-native.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_engine_step import recorded_launches
from benchmarks.timing import git_rev, triton_kernels_only


def summarise(raw: str, top: int = 60) -> dict[str, Any]:
    """py-spy raw stacks -> the frames with the most samples, self (the leaf) and inclusive, over all threads
    busy at a sample."""
    self_n: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        n = int(count)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")[1:]]
        if not frames:
            continue
        total += n
        self_n[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    return {"samples": total,
            "self": [{"frame": f, "share": n / total} for f, n in self_n.most_common(top)],
            "inclusive": [{"frame": f, "share": n / total} for f, n in incl.most_common(top)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="m3-slice")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--summarise", default=None, help="a py-spy raw file to summarise instead")
    ap.add_argument("--moe-format", default="bf16", choices=("bf16", "mxfp8", "mxfp4"),
                    help="the experts' format on the device (`m3jax serve --moe-weight-format`)")
    ap.add_argument("--no-mosaic", action="store_true",
                    help="the Triton kernels where the Hopper dispatch would pick the Mosaic GPU ones (to compare)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.summarise:
        rec = {"op": "dispatch_profile", **summarise(Path(args.summarise).read_text()), "git_rev": git_rev()}
        Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
        for row in rec["self"][:25]:
            print(f"{row['share']:6.1%}  {row['frame'][:160]}")
        return

    import jax

    from m3jax.settings import Settings
    from serving.core import EngineCore
    from serving.outputs import SamplingParams

    if args.no_mosaic:
        triton_kernels_only()

    # The executable cache's key does not see the kernel patch above: --no-mosaic compiles its own.
    settings = Settings(model=args.model, moe_weight_format=args.moe_format, max_num_seqs=128, max_model_len=2176,
                        max_num_batched_tokens=8192, progress=False, enable_compilation_cache=not args.no_mosaic)
    core = EngineCore(settings)  # never started: this thread steps it
    runner, cfg = core.runner, core.model.cfg
    with recorded_launches(runner) as launched:
        req, _ = core.prepare(np.random.default_rng(0).integers(0, cfg.vocab_size, args.context).tolist(),
                              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        core.submit(req)
        while core.has_work():
            core.step()
    prefill, decode = launched[0], launched[-1]

    calls = {}
    for name, scheduled in (("prefill", prefill), ("decode", decode)):
        num_tokens, forward_args, _, _ = runner.inputs(scheduled)
        host = jax.device_put(runner.host_pack("forward", num_tokens).pack(forward_args))
        calls[name] = (runner.executable("forward", num_tokens), host, num_tokens)

    waited: dict[str, list[float]] = {name: [] for name in calls}

    def dispatch(name: str) -> float:
        fwd, host, _ = calls[name]
        t0 = time.perf_counter()
        runner.kv, runner.history, _, greedy_out = fwd(runner.model.params, runner.kv, runner.history,
                                                       runner.prev_tokens, host)
        t = time.perf_counter() - t0
        jax.block_until_ready(greedy_out)
        waited[name].append(time.perf_counter() - t0)
        return t

    for name in calls:
        for _ in range(3):
            dispatch(name)
    for v in waited.values():  # the warm-up's calls are not counted
        v.clear()
    print(f"READY pid={os.getpid()}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in calls}
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:  # the profile's samples: mostly the prefill's dispatch
        for name in ("prefill", "prefill", "prefill", "decode"):
            times[name].append(dispatch(name))
    rec = {"op": "dispatch_time", "model": args.model, "moe_format": args.moe_format, "context": args.context,
           **{f"{n}_tokens": calls[n][2] for n in calls},
           **{f"{n}_dispatch_s": statistics.median(v) for n, v in times.items()},
           **{f"{n}_calls": len(v) for n, v in times.items()},
           # dispatch + the wait for its result: the call's wall time, one at a time
           **{f"{n}_call_s": statistics.median(v) for n, v in waited.items()},
           "kernels": "triton" if args.no_mosaic else "table", "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "device": jax.devices()[0].device_kind, "git_rev": git_rev()}
    print(json.dumps(rec), flush=True)
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
