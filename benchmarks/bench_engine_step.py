"""The engine's decode step against the bare compiled step, in one process.

A batch of B requests with ~`--context`-token prompts is prefilled through the engine core, then, decode only:
- engine: `EngineCore.step()` back to back (scheduling, batch assembly, dispatch, collecting the previous step's
  tokens, stop checks, detokenisation and outputs: everything the serving loop does per token);
- bare: the same compiled executables called back to back on a fixed decode batch (the forward and the sampling
  executable the engine picks for those rows, on the device; no host work but the dispatch).
The ratio engine / bare is the host's cost per step once async scheduling has overlapped it with the device; the
engine's own split of its step (time blocked on the device's tokens, and the host work around it) goes beside it. On a
GPU both loops are also traced: kernel-busy time per step tells device work from the device waiting on the host.

    PYTHONPATH=. python benchmarks/bench_engine_step.py [--model m3-slice] [--batches 32 128] [--context 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.timing import git_rev


def measure(core: Any, batch: int, context: int, steps: int) -> dict[str, Any]:
    import jax

    from serving.outputs import SamplingParams
    from serving.runner import InFlight
    from serving.sampling import GREEDY_VARIANT, variant
    from serving.scheduler import ScheduledRow, SchedulerOutput

    cfg = core.model.cfg
    rng = np.random.default_rng(batch)
    # Long enough that no request finishes while the last ones are still prefilling (one token a step each): the
    # requests already decoding take one token of each step's budget, the prompts get the rest.
    prefill_steps = -(-batch * context // max(1, core.runner.token_buckets[-1] - batch))
    params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + steps * 3 + 8, ignore_eos=True)
    for _ in range(batch):
        req, _ = core.prepare(rng.integers(0, cfg.vocab_size, context).tolist(), params)
        core.submit(req)
    # Prefill, until every request decodes one token per step. Submitted requests join at the next step, so the
    # first step comes before the test (without it the loop never ran, and the "decode" steps timed were prefill
    # chunks in the largest bucket).
    core.step()
    while core.num_waiting or any(r.num_computed < r.num_prompt for r in core.scheduler.running):
        core.step()
    core.step()
    if core.num_running != batch:
        raise SystemExit(f"{core.num_running} of {batch} requests running after prefill: raise --max-num-seqs or "
                         "the KV pool")
    t_engine, t_wait = [], []
    tokens_before = core.stats["step_tokens"]
    for _ in range(steps):
        t, w = time.perf_counter(), core.stats["device_wait_us"]
        core.step()
        t_engine.append(time.perf_counter() - t)
        t_wait.append((core.stats["device_wait_us"] - w) / 1e6)

    if core.stats["step_tokens"] - tokens_before != steps * batch:  # decode only: one token per request a step
        raise SystemExit(f"the timed steps ran {core.stats['step_tokens'] - tokens_before} tokens, not "
                         f"{steps} x {batch}")

    # The bare step: the same executable on a fixed decode batch, dispatched back to back.
    runner = core.runner
    # Each row at its next position, or its last one when that would need a page it does not hold yet.
    ps = core.model.page_size
    rows = [ScheduledRow(r.seq, [int(rng.integers(0, cfg.vocab_size))], min(r.num_computed, len(r.pages) * ps - 1),
                         list(r.pages), True, r.slot, r.sampling, r.num_prompt, r.num_output)
            for r in core.scheduler.running]
    num_tokens, forward_args, sampling_host, _ = runner.inputs(SchedulerOutput(rows, []))
    # The sampling the engine picks for these rows (greedy: the forward's own output), as the engine runs it.
    how = (GREEDY_VARIANT if sampling_host is None else
           variant(sampling_host, runner.max_num_seqs, cfg.vocab_size, constrained=False, want_logprobs=False))
    host, sampling = jax.device_put((runner.host_pack("forward", num_tokens).pack(forward_args), sampling_host))
    fwd = runner.executable("forward", num_tokens)

    def bare_step() -> Any:
        runner.kv, runner.history, logits, greedy_out = fwd(runner.model.params, runner.kv, runner.history,
                                                             runner.prev_tokens, host)
        step = InFlight(SchedulerOutput([], []), [], logits, sampling, False, greedy=greedy_out)
        runner.prev_tokens, out = runner.run_sampling(how, step, None)
        return out

    outs = [bare_step() for _ in range(2)]
    jax.block_until_ready(outs[-1].tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        outs.append(bare_step())
    jax.block_until_ready(outs[-1].tokens)
    bare = (time.perf_counter() - t0) / steps
    engine = statistics.median(t_engine[steps // 4:])
    # The GPU's own record of both loops (empty on the CPU): kernel-busy time per step. Engine busy ~ bare busy
    # with a longer engine period means the device waits for the host between steps; a larger engine busy means
    # the engine's steps run more device work (copies, other shapes).
    from benchmarks.timing import device_profile

    prof = {"engine": device_profile(core.step, [()], calls=steps, top=6),
            "bare": device_profile(bare_step, [()], calls=steps, top=6)}
    busy = {f"{k}_busy_s": v["device_busy_s"] for k, v in prof.items() if "device_busy_s" in v}
    kernels = {f"{k}_kernels_us": v.get("kernels_us") for k, v in prof.items() if v}
    core.abort_all()
    while core.has_work():
        core.step()
    return {"op": "engine_decode_step", "batch": batch, "context": context, "engine_step_s": engine,
            "bare_step_s": bare, "engine_over_bare": engine / bare, "steps": steps, "bare_sampling": how,
            # Mean per step: blocked on the device's tokens, and the rest (host work, dispatch included).
            "engine_device_wait_s": statistics.median(t_wait[steps // 4:]),
            "engine_host_s": statistics.median(e - w for e, w in zip(t_engine[steps // 4:], t_wait[steps // 4:],
                                                                       strict=True)),
            "executables": core.num_executables, **busy, **kernels}


@contextlib.contextmanager
def recorded_launches(runner: Any) -> Iterator[list[Any]]:
    """The SchedulerOutput of every step the runner launches inside the block, in order."""
    launched: list[Any] = []
    launch = runner.launch

    def recording_launch(scheduled: Any, *a: Any, **k: Any) -> Any:
        launched.append(scheduled)
        return launch(scheduled, *a, **k)

    runner.launch = recording_launch
    try:
        yield launched
    finally:
        runner.launch = launch


def measure_prefill(core: Any, context: int, repeats: int = 6) -> dict[str, Any]:
    """Time to first token of one `context`-token prompt on an idle engine (submit -> its first output, stepping
    the core as its loop does) against the bare forward of that same prefill step (the executable the engine
    ran, its inputs made once, dispatched and waited for), and the engine's split: the first launch's host time
    (batch assembly + dispatch) and the time blocked on the device."""
    import jax

    from serving.outputs import SamplingParams

    cfg, runner = core.model.cfg, core.runner
    rng = np.random.default_rng(context)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ttft, first_launch, waits, steps = [], [], [], []
    with recorded_launches(runner) as launched:
        for i in range(repeats + 1):
            req, _ = core.prepare(rng.integers(0, cfg.vocab_size, context).tolist(), params)  # no prefix hit
            got: list[Any] = []
            launched.clear()
            core.submit(req, sink=got.append)
            t0, w0, n = time.perf_counter(), core.stats["device_wait_us"], 0
            while not got:
                core.step()
                n += 1
                if n == 1:
                    launch_s = core.last_step_seconds
            t = time.perf_counter() - t0
            prefill = launched[0]
            while core.has_work():
                core.step()
            if i:  # the first one warms up
                ttft.append(t)
                first_launch.append(launch_s)
                waits.append((core.stats["device_wait_us"] - w0) / 1e6)
                steps.append(n)
    num_tokens, forward_args, _, _ = runner.inputs(prefill)
    host_args = runner.host_pack("forward", num_tokens).pack(forward_args)
    forward_args = jax.device_put(host_args)
    fwd = runner.executable("forward", num_tokens)

    def bare(args: Any = forward_args) -> Any:
        runner.kv, runner.history, _, greedy_out = fwd(runner.model.params, runner.kv, runner.history,
                                                       runner.prev_tokens, args)
        return greedy_out[1].tokens

    jax.block_until_ready(bare())
    # Inputs already on the device (bare), and as the engine passes them (one packed host array: its copy is
    # part of the dispatch); `dispatch`: until the call returns (the host's launch), the rest is the device's.
    timed: dict[str, list[float]] = {"bare": [], "bare_host_args": [], "bare_dispatch": [],
                                     "bare_host_args_dispatch": []}
    for _ in range(repeats):
        for name, args in (("bare", forward_args), ("bare_host_args", host_args)):
            t0 = time.perf_counter()
            tokens = bare(args)
            timed[name + "_dispatch"].append(time.perf_counter() - t0)
            np.asarray(tokens)
            timed[name].append(time.perf_counter() - t0)
    bare_s = timed["bare"]
    from benchmarks.timing import device_profile, device_timeline

    # Kernel by kernel, to set beside bench_slice_decode.py's one-row prefill (what the padding costs), and
    # where the device idles inside the call (the host launching the step's kernels behind the device).
    prof = device_profile(bare, [()], calls=4, top=40)
    timeline = device_timeline(lambda: bare(host_args))
    return {"op": "engine_prefill_ttft", "context": context, "token_bucket": num_tokens,
            "rows": runner.rows_for(num_tokens), "engine_ttft_s": statistics.median(ttft),
            "bare_prefill_s": statistics.median(bare_s), "engine_over_bare": statistics.median(ttft) /
            statistics.median(bare_s), "engine_first_launch_host_s": statistics.median(first_launch),
            "engine_device_wait_s": statistics.median(waits), "engine_steps_to_first_token": max(steps),
            "repeats": repeats, "pages_per_row": runner.pages_per_row,
            **{f"{k}_s": statistics.median(v) for k, v in timed.items() if k != "bare"},
            **{"bare_" + k: v for k, v in prof.items()}, **({"timeline": timeline} if timeline else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="m3-slice")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prefill", action="store_true",
                    help="also the time to first token of one --context-token prompt on an idle engine against "
                         "the bare forward of that prefill step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax

    from m3jax.settings import Settings
    from serving.core import EngineCore

    # The serve benchmark's settings by default, so its compiled steps load from the same cache.
    settings = Settings(model=args.model, max_num_seqs=max(args.max_num_seqs, *args.batches),
                        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                        progress=False)
    t0 = time.perf_counter()
    core = EngineCore(settings)  # never started: this thread steps it
    startup = time.perf_counter() - t0
    device = jax.devices()[0].device_kind
    records = []
    for b in args.batches:
        rec = {**measure(core, b, args.context, args.steps), "model": args.model, "startup_s": startup,
               "device": device, "git_rev": git_rev()}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    if args.prefill:
        rec = {**measure_prefill(core, args.context), "model": args.model, "device": device, "git_rev": git_rev()}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    out = Path(args.out or f"benchmarks/results/engine-step-{device.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
