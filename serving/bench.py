"""`m3jax bench serve`: the serving benchmark of ../shared/benchmark-contract.md (the InferenceX / `vllm bench
serve` contract) against our server or any OpenAI-compatible one.

    m3jax bench serve --base-url http://127.0.0.1:8000 --input-len 1024 --output-len 1024 --concurrency 1,4,8

Per concurrency level: 2 x concurrency warm-up requests (not counted), then `--num-prompts` (default
10 x concurrency; both multiples can be lowered to fit a time budget) requests kept `concurrency` at a time in
flight, each streamed over SSE from /v1/completions (or /v1/chat/completions) with ignore_eos so that it produces
its full output length. Lengths are drawn uniformly in [range_ratio x L, L]. Prompts are random token ids when the
server is ours (it says so in /v1/models and reports its vocabulary) and random words otherwise, where the prompt
length is then approximate (the usage the server reports is what counts).

Each level is saved as JSON (config, git revision, device, metrics; against our server also
the engine's mean decode step over the level, from its /metrics) in `--result-dir`, and the sweep is plotted
as output tok/s/GPU against interactivity (1000 / median TPOT in ms, i.e. tok/s per user).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_RESULT_DIR = "benchmarks/results"

# Random-text prompts for servers that are not ours: common short words, roughly one token each in BPE
# vocabularies, so that the prompt length in tokens is near the number of words.
_WORD_TEXT = ("the of and to in is was for on that with as by at from his her they this have are not but had "
          "one all were when there can more time will some what about which their out up into been other "
          "than them these two may then first any now only its over new very also after most just where "
          "before same through back much good well many way even because each those people world year day "
          "work life hand part place case point group number water light house order power state line city")
_WORDS = _WORD_TEXT.split()


@dataclasses.dataclass
class RequestResult:
    ok: bool
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


@dataclasses.dataclass
class Workload:
    prompts: list[str | list[int]]
    input_lens: list[int]
    output_lens: list[int]


def _lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    lo = max(1, min(length, int(np.ceil(ratio * length))))
    return [rng.randint(lo, length) for _ in range(n)]


def make_workload(n: int, input_len: int, output_len: int, range_ratio: float, seed: int, vocab_size: int | None,
                  avoid_ids: frozenset[int] = frozenset()) -> Workload:
    """n random prompts: token ids when `vocab_size` is given, else random words."""
    rng = random.Random(seed)
    ins, outs = _lengths(rng, n, input_len, range_ratio), _lengths(rng, n, output_len, range_ratio)
    prompts: list[str | list[int]] = []
    for length in ins:
        if vocab_size is not None:
            ids: list[int] = []
            while len(ids) < length:
                t = rng.randrange(vocab_size)
                if t not in avoid_ids:  # a random EOS / BOS in the prompt would be a strange request
                    ids.append(t)
            prompts.append(ids)
        else:
            prompts.append(" ".join(rng.choice(_WORDS) for _ in range(length)))
    return Workload(prompts, ins, outs)


def _summary(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def compute_metrics(results: list[RequestResult], duration: float, num_gpus: int) -> dict[str, Any]:
    """The contract's metrics (latencies in ms) with vLLM's names: mean_/median_/p99_ ttft, tpot, itl, e2el."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        m[f"{key}_per_gpu"] = m[key] / num_gpus
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.e2e for r in ok],
    }
    for name, values in series.items():
        for stat, v in _summary(values).items():
            m[f"{stat}_{name}_ms"] = v
    median_tpot = m["median_tpot_ms"]
    m["interactivity"] = 1000.0 / median_tpot if median_tpot and np.isfinite(median_tpot) else float("nan")
    return m


class Client:
    def __init__(self, base_url: str, model: str, endpoint: str, api_key: str | None, temperature: float):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.chat = endpoint == "chat"
        self.url = self.base_url + ("/v1/chat/completions" if self.chat else "/v1/completions")
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.temperature = temperature

    def payload(self, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": self.temperature,
                                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def request(self, session: Any, prompt: str | list[int], prompt_len: int, max_tokens: int) -> RequestResult:
        """One streamed request: TTFT at the first token chunk, ITL between token chunks, E2E at the end."""
        t0 = time.perf_counter()
        ttft: float | None = None
        last = t0
        itl: list[float] = []
        chunks = 0
        usage: dict[str, Any] | None = None
        try:
            async with session.post(self.url, json=self.payload(prompt, max_tokens), headers=self.headers) as resp:
                if resp.status != 200:
                    return RequestResult(False, error=f"HTTP {resp.status}: {(await resp.text())[:500]}")
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        return RequestResult(False, error=str(obj["error"]))
                    if obj.get("usage"):
                        usage = obj["usage"]
                    choices = obj.get("choices") or []
                    if not choices or (self.chat and "role" in (choices[0].get("delta") or {})):
                        continue  # the usage chunk, or chat's opening role-only chunk: no token in it
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
        except (TimeoutError, OSError, ValueError) as e:
            return RequestResult(False, error=f"{type(e).__name__}: {e}")
        e2e = time.perf_counter() - t0
        if ttft is None:
            return RequestResult(False, error="the stream carried no tokens")
        out_len = int(usage["completion_tokens"]) if usage else chunks
        in_len = int(usage["prompt_tokens"]) if usage else prompt_len
        return RequestResult(True, in_len, out_len, ttft, e2e, itl)


async def _run_level(client: Client, workload: Workload, warmup: Workload, concurrency: int) -> tuple[
        list[RequestResult], float, list[RequestResult], tuple | None, tuple | None]:
    """(results, seconds, warm-up results, and the server's SPEC_COUNTERS + DECODE_COUNTERS + PHASE_COUNTERS +
    STEP_COUNTERS before and after the measured requests: None where it exports none)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def run(w: Workload) -> list[RequestResult]:
            sem = asyncio.Semaphore(concurrency)

            async def one(i: int) -> RequestResult:
                async with sem:
                    return await client.request(session, w.prompts[i], w.input_lens[i], w.output_lens[i])

            return list(await asyncio.gather(*(one(i) for i in range(len(w.prompts)))))

        warm = await run(warmup)
        names = SPEC_COUNTERS + DECODE_COUNTERS + PHASE_COUNTERS + STEP_COUNTERS
        before = await asyncio.to_thread(server_counters, client.base_url, client.api_key, names)
        t0 = time.perf_counter()
        results = await run(workload)
        duration = time.perf_counter() - t0
        after = await asyncio.to_thread(server_counters, client.base_url, client.api_key, names)
        return results, duration, warm, before, after


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")
# Our server's decode-only steps (serving/core.py): count, summed periods in seconds, summed rows.
DECODE_COUNTERS = ("m3jax_engine_decode_steps_total", "m3jax_engine_decode_step_seconds_total",
                   "m3jax_engine_decode_step_rows_total")

# What the server's TTFT is made of (serving/metrics.py): sums and counts of the time to the first token, the
# queue time (arrival to the first chunk's scheduling) and the prefill time (from there to the first token).
PHASE_COUNTERS = (*(f"vllm:{h}_{part}" for h in ("time_to_first_token_seconds", "request_queue_time_seconds",
                                                  "request_prefill_time_seconds") for part in ("sum", "count")),
                  *(f"m3jax_{h}_{part}" for h in ("request_handoff_seconds", "first_token_delivery_seconds")
                    for part in ("sum", "count")))

# All of the engine's steps (prefills and mixed ones too): count, the engine thread's time blocked on the device,
# tokens. Little wait per step means the host, not the device, sets the pace.
STEP_COUNTERS = ("m3jax_engine_steps_total", "m3jax_engine_device_wait_seconds_total",
                 "m3jax_engine_step_tokens_total")


def server_counters(base_url: str, api_key: str | None, names: tuple[str, ...]) -> tuple[float, ...] | None:
    """The named counters from the server's /metrics, each summed over its label sets; None when the server
    exports none of them (or has no /metrics)."""
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/metrics",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return None
    totals = dict.fromkeys(names, 0.0)
    seen = False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
            seen = True
    return tuple(totals.values()) if seen else None


def decode_step(before: tuple[float, ...] | None, after: tuple[float, ...] | None) -> tuple[float, float] | None:
    """(mean decode step in seconds, mean rows per decode step) between two DECODE_COUNTERS readings; None when
    the server does not report them or ran no back-to-back decode step."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    steps = after[0] - before[0]
    return (after[1] - before[1]) / steps, (after[2] - before[2]) / steps


def phase_means(before: tuple[float, ...] | None, after: tuple[float, ...] | None) -> dict[str, float | None]:
    """The server's mean TTFT, queue and prefill time, and the request's hand-off to the engine and its first
    token's delivery back, in ms between two PHASE_COUNTERS readings (None where the server does not report one)."""
    out: dict[str, float | None] = {}
    for i, key in enumerate(("server_ttft_mean_ms", "server_queue_mean_ms", "server_prefill_mean_ms",
                             "server_handoff_mean_ms", "server_delivery_mean_ms")):
        n = after[2 * i + 1] - before[2 * i + 1] if before and after else 0
        out[key] = (after[2 * i] - before[2 * i]) / n * 1e3 if n > 0 else None
    return out


def step_means(before: tuple[float, ...] | None, after: tuple[float, ...] | None,
               duration: float) -> dict[str, float | None]:
    """Between two STEP_COUNTERS readings `duration` seconds apart: the engine's steps, their mean period, the
    engine thread's mean wait for the device per step, and tokens per step (None without the counters)."""
    steps = after[0] - before[0] if before and after else 0
    if steps <= 0:
        return dict.fromkeys(("engine_steps", "engine_step_period_ms", "engine_device_wait_ms_per_step",
                              "engine_tokens_per_step"))
    return {"engine_steps": steps, "engine_step_period_ms": duration / steps * 1e3,
            "engine_device_wait_ms_per_step": (after[1] - before[1]) / steps * 1e3,
            "engine_tokens_per_step": (after[2] - before[2]) / steps}


def acceptance_length(before: tuple[float, ...] | None, after: tuple[float, ...] | None) -> float | None:
    """Mean tokens a verification emits (1 + accepted drafts), between two SPEC_COUNTERS readings."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return 1.0 + (after[1] - before[1]) / (after[0] - before[0])


def server_card(base_url: str, api_key: str | None) -> dict[str, Any] | None:
    """The first model of /v1/models (ours carries an `m3jax` entry with its vocabulary and device)."""
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            data = json.loads(resp.read())
    except (OSError, ValueError) as e:
        print(f"[bench] cannot read {base_url}/v1/models: {e}", file=sys.stderr)
        return None
    models = data.get("data") or []
    return models[0] if models else None


def git_revision() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    xs = [r["metrics"]["interactivity"] for r in runs]
    ys = [r["metrics"]["output_throughput_per_gpu"] for r in runs]
    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=120)
    ax.plot(xs, ys, marker="o")
    for r, x, y in zip(runs, xs, ys, strict=True):
        ax.annotate(f"c={r['config']['concurrency']}", (x, y), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("interactivity (tok/s/user = 1000 / median TPOT ms)")
    ax.set_ylabel("output tok/s/GPU")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--range-ratio", type=float, default=0.8,
                   help="lengths are drawn uniformly in [ratio x len, len] (the contract uses 0.8)")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated levels")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="per level (default: --prompts-per-concurrency x concurrency)")
    p.add_argument("--prompts-per-concurrency", type=float, default=10.0,
                   help="the contract's 10; fewer to fit a time budget (say so with the figures)")
    p.add_argument("--warmups-per-concurrency", type=float, default=2.0,
                   help="warm-up requests per level, in multiples of the concurrency (the contract's 2)")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs the server uses, for per-GPU figures")
    p.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                   help="auto: token ids for an m3jax server (exact lengths), random words otherwise")
    p.add_argument("--vocab-size", type=int, default=None, help="for --prompt-format ids against another server")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="device description for the results (default: the server's)")
    p.add_argument("--api-key", default=os.environ.get("M3JAX_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--result-dir", default=DEFAULT_RESULT_DIR)
    p.add_argument("--tag", default=None, help="file name prefix (default: derived from model, lengths, time)")
    p.add_argument("--no-plot", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        print(f"error: --concurrency must be comma-separated integers, got {args.concurrency!r}", file=sys.stderr)
        return 2
    if not levels or min(levels) < 1 or args.input_len < 1 or args.output_len < 1 or args.num_gpus < 1:
        print("error: concurrency, lengths and --num-gpus must be positive", file=sys.stderr)
        return 2
    if not 0.0 < args.range_ratio <= 1.0:
        print(f"error: --range-ratio must be in (0, 1], got {args.range_ratio}", file=sys.stderr)
        return 2
    card = server_card(args.base_url, args.api_key)
    ours = (card or {}).get("m3jax")
    model = args.model or (card or {}).get("id")
    if model is None:
        print("error: the server lists no model; pass --model", file=sys.stderr)
        return 2
    fmt = args.prompt_format
    if fmt == "auto":
        fmt = "ids" if ours and args.endpoint == "completions" else "text"
    vocab = args.vocab_size or (ours or {}).get("vocab_size")
    if fmt == "ids" and (vocab is None or args.endpoint == "chat"):
        print("error: token-id prompts need /v1/completions and a vocabulary size (--vocab-size)", file=sys.stderr)
        return 2
    avoid = frozenset((ours or {}).get("eos_token_ids") or ())
    device = args.device or (ours or {}).get("device") or "unknown"
    client = Client(args.base_url, model, args.endpoint, args.api_key, args.temperature)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    safe_model = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_")[-60:]
    tag = args.tag or f"serve-{safe_model}-{args.input_len}x{args.output_len}-{stamp}"
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    revision = git_revision()

    runs = []
    for c in levels:
        n = args.num_prompts or max(1, round(args.prompts_per_concurrency * c))
        n_warm = max(1, round(args.warmups_per_concurrency * c))
        vocab_arg = vocab if fmt == "ids" else None
        workload = make_workload(n, args.input_len, args.output_len, args.range_ratio, args.seed + c, vocab_arg,
                                 avoid)
        warmup = make_workload(n_warm, args.input_len, args.output_len, args.range_ratio, args.seed + 10**6 + c,
                               vocab_arg, avoid)
        results, duration, warm, before, after = asyncio.run(_run_level(client, workload, warmup, c))
        metrics = compute_metrics(results, duration, args.num_gpus)
        spec = len(SPEC_COUNTERS)
        accept = acceptance_length(before and before[:spec], after and after[:spec])
        metrics["spec_acceptance_length"] = accept  # None: the server does not speculate
        phase = len(SPEC_COUNTERS) + len(DECODE_COUNTERS)
        decode = decode_step(before and before[spec:phase], after and after[spec:phase])
        # The engine's part of the TTFT the client saw (the rest is HTTP, the front end and the stream).
        step = phase + len(PHASE_COUNTERS)
        metrics.update(phase_means(before and before[phase:step], after and after[phase:step]))
        metrics.update(step_means(before and before[step:], after and after[step:], duration))
        # The engine's own mean decode step over the level (None: a server that does not report it).
        metrics["engine_decode_step_ms"] = decode[0] * 1e3 if decode else None
        metrics["engine_decode_rows_mean"] = decode[1] if decode else None
        errors = [r.error for r in results + warm if not r.ok][:5]
        record = {
            "config": {"base_url": args.base_url, "model": model, "endpoint": args.endpoint,
                       "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
                       "concurrency": c, "num_prompts": n, "num_warmups": n_warm, "num_gpus": args.num_gpus,
                       "prompt_format": fmt, "temperature": args.temperature, "ignore_eos": True, "seed": args.seed},
            "git_revision": revision,
            "device": device,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "server": card,
            "metrics": metrics,
            "errors": errors,
        }
        path = out_dir / f"{tag}-c{c}.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
        runs.append(record)
        print(f"[bench] c={c:<4} ok={metrics['completed']}/{n} req/s={metrics['request_throughput']:.2f} "
              f"out tok/s/GPU={metrics['output_throughput_per_gpu']:.1f} TTFT med={metrics['median_ttft_ms']:.1f}ms "
              f"TPOT med={metrics['median_tpot_ms']:.2f}ms ITL p99={metrics['p99_itl_ms']:.2f}ms "
              f"interactivity={metrics['interactivity']:.1f}"
              + (f" acceptance length={accept:.2f}" if accept is not None else "")
              + (f" engine decode step={decode[0] * 1e3:.2f}ms at {decode[1]:.1f} rows" if decode else "")
              + f" -> {path}", flush=True)
        for e in errors:
            print(f"[bench]   error: {e}", file=sys.stderr)
    if not args.no_plot:
        png = out_dir / f"{tag}.png"
        plot(runs, png, f"{model[-40:]} {args.input_len}/{args.output_len}\n{device}, {(revision or 'no git')[:18]}")
        print(f"[bench] plot -> {png}")
    return 0 if all(r["metrics"]["failed"] == 0 for r in runs) else 1
