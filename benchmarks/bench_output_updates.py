"""What one output update of a request costs the host, by how far into its output the request is.

Two places pay per generated token and request, on the CPU:
- the servers' reader thread (`engine_process._Stream.apply`): the engine process's `OutputDelta` in, a
  `RequestOutput` out. With `RequestOutputKind.CUMULATIVE` (the Python API's default) each update carries the
  whole text, ids and logprobs so far, so it copies them; with `DELTA` (what both servers ask for) it carries
  the delta alone.
- the engine core's text state (`stopping.TextState`): each token's text added, and the new tail read back for
  the update (`since`).

Each is timed over `--updates` consecutive updates starting at each output position in `--positions` (a token of
4 characters each; with `--logprobs`, 5 top entries per token), median per update in microseconds.

    PYTHONPATH=. python benchmarks/bench_output_updates.py [--out benchmarks/results/output-updates-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from benchmarks.timing import git_rev
from serving.core import OutputDelta, Prepared
from serving.engine_process import _Stream
from serving.outputs import Logprob, RequestOutputKind, SamplingParams
from serving.stopping import TextState
from serving.tokenizer import StopChecker

TOKEN_TEXT = "abcd"


def _delta(i: int, logprobs: bool) -> OutputDelta:
    lp = [Logprob(i, -0.5, {i: -0.5, i + 1: -1.0, i + 2: -2.0, i + 3: -3.0, i + 4: -4.0})] if logprobs else None
    return OutputDelta("r", [i], TOKEN_TEXT, None, None, None, False, {}, lp, None)


def time_stream(kind: RequestOutputKind, position: int, updates: int, logprobs: bool) -> float:
    params = SamplingParams(max_tokens=position + updates + 1, output_kind=kind, logprobs=5 if logprobs else None)
    stream = _Stream(Prepared("r", list(range(64)), params, None), lambda out: None)
    for i in range(position):
        stream.apply(_delta(i, logprobs))
    times = []
    for i in range(position, position + updates):
        d = _delta(i, logprobs)
        t0 = time.perf_counter()
        stream.apply(d)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


class _Detok:
    """A detokeniser whose every token is TOKEN_TEXT (what the text state does with it is what is timed)."""

    def push(self, token_id: int) -> str:
        return TOKEN_TEXT

    def flush(self) -> str:
        return ""


def time_text(position: int, updates: int) -> float:
    state = TextState(_Detok(), StopChecker([]))  # type: ignore[arg-type]
    sent = 0
    for i in range(position):
        state.push(i, final=False)
        sent += len(state.since(sent))
    times = []
    for i in range(position, position + updates):
        t0 = time.perf_counter()
        state.push(i, final=False)
        sent += len(state.since(sent))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, nargs="+", default=[0, 500, 2000, 8000, 32000])
    ap.add_argument("--updates", type=int, default=400)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for position in args.positions:
        row = {"position": position}
        for kind in RequestOutputKind:
            for logprobs in (False, True):
                key = f"stream_{kind.name.lower()}{'_logprobs' if logprobs else ''}_us"
                row[key] = round(time_stream(kind, position, args.updates, logprobs), 2)
        row["text_state_us"] = round(time_text(position, args.updates), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "output_updates", "git_rev": git_rev(), "machine": platform.processor()
                       or platform.machine(), "python": platform.python_version(), "token_text": TOKEN_TEXT,
                       "updates_per_position": args.updates, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
