"""Speculative decoding with an EAGLE-3 draft (serving/speculative.py): greedy output is exactly the output
without speculation for k = 1..4 under chunked prefill, ragged batches and preemption, with the shipped draft
(mostly accepted) and a random one (mostly rejected); the acceptance rule leaves the sampling distribution
unchanged (a chi-square test of `verify`); stops inside an accepted run, logprobs, seeds, penalties and
grammars keep their meaning; aborted speculative streams leave no page behind."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import scipy.stats
from test_engine import count_compiles

from checkpoints.eagle import random_draft_params, read_draft_config, write_draft
from m3jax.settings import Settings
from serving import LLM, SamplingParams
from serving.core import EngineCore
from serving.sampling import SamplingTensors, sample
from serving.structured import StructuredOutputsParams

# The embedded model: 6 layers, vocabulary 2048, pages of 16 tokens. 11 usable pages for 8 requests of up to
# ~120 tokens (plus the draft's k-token lookahead): preemption is forced.
BASE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, progress=False,
            enable_compilation_cache=False, warmup=False)
TIGHT = dict(BASE, kv_cache_pages=12)
TEXTS = ["The capital of France is", "Once upon a time there was", "1, 2, 3, 4, 5,", "def fibonacci(n):",
         "The quick brown fox", "In the beginning", "Water boils at", "My favourite colour is"]


def _prompts() -> list[list[int] | str]:
    rng = np.random.default_rng(0)
    random_ids = [rng.integers(3, 2000, int(rng.integers(5, 60))).tolist() for _ in range(4)]
    return [*TEXTS, *random_ids]


def _params() -> list[SamplingParams]:
    lengths = np.random.default_rng(1).integers(10, 60, len(_prompts()))
    return [SamplingParams(temperature=0.0, max_tokens=int(n)) for n in lengths]


def _spec(k: int, model: str | None = None) -> str:
    """`--speculative-config` as a server operator writes it."""
    return json.dumps({"method": "eagle3", "num_speculative_tokens": k} | ({"model": model} if model else {}))


@pytest.fixture(scope="module")
def reference():
    with LLM(**dict(BASE, warmup=True)) as llm:  # warm: its features run inside the no-compile check below
        outs = llm.generate(_prompts(), _params(), use_tqdm=False)
        yield llm, [o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A draft of the shipped draft's shape with random weights: its proposals are almost always rejected."""
    import checkpoints

    shipped = checkpoints.__path__[0] + "/tiny_eagle3"
    dcfg = read_draft_config(shipped, target_num_layers=6)
    return str(write_draft(tmp_path_factory.mktemp("draft"), dcfg, random_draft_params(dcfg, seed=5)))


def _run_stepped(core: EngineCore, prompts, params) -> list:
    """Requests arrive three per step on a core this thread steps: batches are ragged and change every step."""
    ids, results, pending = [], {}, list(zip(prompts, params, strict=True))
    while pending or core.has_work():
        for _ in range(3):
            if pending:
                req, text = core.prepare(*pending.pop(0))
                ids.append(core.submit(req, text))
        for out in core.step():
            if out.finished:
                results[out.request_id] = out
    return [results[i].outputs[0] for i in ids]


@pytest.mark.parametrize("k,draft", [(1, "shipped"), (2, "random"), (3, "shipped"), (4, "random")])
def test_greedy_output_is_exactly_the_output_without_speculation(reference, random_draft, k, draft):
    _, want, want_reasons = reference
    spec = _spec(k, random_draft if draft == "random" else None)
    core = EngineCore(Settings(**TIGHT, speculative_config=spec))
    got = _run_stepped(core, _prompts(), _params())
    assert [o.token_ids for o in got] == want
    assert [o.finish_reason for o in got] == want_reasons
    s = core.stats
    assert s["preemptions"] > 0, "the pool must be small enough to force preemption"
    assert s["spec_num_draft_tokens"] > 0
    if draft == "shipped":  # mostly accepted: several tokens a step
        assert s["spec_num_accepted_tokens"] > s["spec_num_draft_tokens"] / 3
    else:  # mostly rejected: the rollback path runs
        assert s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"] / 2
    assert core.pages_in_use == 0 and core.num_running == 0 and core.num_waiting == 0
    # The step count shows the speedup: fewer steps than tokens decoded.
    assert s["steps"] < sum(len(o.token_ids) for o in got) + len(got)


@pytest.fixture(scope="module")
def spec_llm():
    settings = dict(BASE, warmup=True)  # every speculative step shape made at start-up
    with LLM(**settings, speculative_config={"method": "eagle3", "num_speculative_tokens": 3}) as llm:
        assert llm.core.runner.shapes() == [(what, size) for what in ("spec", "spec_greedy", "spec_draw", "spec_filter")
                                          for size in (8, 16, 32)]
        yield llm


def test_shipped_draft_acceptance_length(spec_llm):
    """The mean acceptance length (1 + accepted drafts per verification) of the shipped draft on the embedded
    model's own kind of text: 2.70 at k = 3 when it was trained (checkpoints/tiny_eagle3/training.json)."""
    core = spec_llm.core
    before = dict(core.stats)
    spec_llm.generate(TEXTS, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    drafts = core.stats["spec_num_drafts"] - before.get("spec_num_drafts", 0)
    accepted = core.stats["spec_num_accepted_tokens"] - before.get("spec_num_accepted_tokens", 0)
    assert 1 + accepted / drafts >= 2.0
    # Accepted by position: a draft is only accepted after all before it were.
    at = [core.stats[f"spec_accepted_at_{i}"] for i in range(3)]
    assert at[0] >= at[1] >= at[2] > 0


def test_stops_logprobs_seeds_penalties_and_grammars_under_speculation(reference, spec_llm):
    with count_compiles() as compiles:
        _check_features(reference, spec_llm)
    assert compiles == [], "speculative steps are buckets made at start-up: nothing compiles while serving"


def _check_features(reference, spec_llm):
    base, want, _ = reference
    prompt = TEXTS[2]
    full = want[2]
    # A stop token inside an accepted run ends the request there.
    stop = full[3]
    out = spec_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:full.index(stop) + 1] and out.finish_reason == "stop"
    # Logprobs: one entry per token, equal to the plain engine's.
    p = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    got = spec_llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    plain = base.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == plain.token_ids and len(got.logprobs) == len(got.token_ids)
    for a, b in zip(got.logprobs, plain.logprobs, strict=True):
        assert a.token_id == b.token_id and a.top.keys() == b.top.keys()
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    # Streaming: the deltas add up to the text even when a step emits several tokens.
    chunks = list(spec_llm.stream(prompt, SamplingParams(temperature=0.0, max_tokens=20)))
    assert "".join(c.delta_text for c in chunks) == chunks[-1].outputs[0].text
    assert sum(len(c.delta_token_ids) for c in chunks) == len(chunks[-1].outputs[0].token_ids)
    # Seeded sampling is reproducible whatever else is in the batch (the draft depends only on the request).
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20)
    alone = spec_llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batched = spec_llm.generate([TEXTS[0], prompt, TEXTS[1]], seeded, use_tqdm=False)[1].outputs[0].token_ids
    assert alone == batched
    # Penalties and grammars decode one token a step and mean what they mean without speculation.
    pen = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.5, frequency_penalty=0.5)
    assert (spec_llm.generate([prompt], pen, use_tqdm=False)[0].outputs[0].token_ids
            == base.generate([prompt], pen, use_tqdm=False)[0].outputs[0].token_ids)
    choice = SamplingParams(temperature=0.0, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert spec_llm.generate([prompt], choice, use_tqdm=False)[0].outputs[0].text in ("yes", "no")


def test_greedy_steps_run_the_executable_without_conditionals(spec_llm):
    """Each step runs its sampling variant's executable: plainly greedy rows "spec_greedy", sampled rows
    "spec_draw", filtered ones "spec_filter" (none of these has a conditional: their dispatch never waits for the
    device), and a penalised row the general "spec"."""
    runner = spec_llm.core.runner
    picked: list[str] = []
    run_spec = runner.run_spec

    def recording(what, *args, **kwargs):
        picked.append(what)
        return run_spec(what, *args, **kwargs)

    runner.run_spec = recording
    cases = {"spec_greedy": SamplingParams(temperature=0.0, max_tokens=8),
             "spec_draw": SamplingParams(temperature=0.8, seed=3, max_tokens=8),
             "spec_filter": SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8),
             "spec": SamplingParams(temperature=0.8, presence_penalty=0.5, seed=3, max_tokens=8)}
    seen = {}
    try:
        for what, params in cases.items():
            picked.clear()
            spec_llm.generate([TEXTS[0]], params, use_tqdm=False)
            seen[what] = set(picked)
    finally:
        runner.run_spec = run_spec
    assert seen == {what: {what} for what in cases}


def test_aborted_speculative_streams_leave_no_page(spec_llm):
    core = spec_llm.core
    rng = np.random.default_rng(3)
    streams = [spec_llm.stream(TEXTS[i % len(TEXTS)], SamplingParams(temperature=0.0, max_tokens=60))
               for i in range(100)]
    for s in streams:
        for _ in range(int(rng.integers(1, 5))):
            if next(s, None) is None:
                break
        s.close()  # the client leaves after a token or a few (a speculative step may bring several)
    deadline = time.monotonic() + 60
    while core.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not core.has_work()
    assert core.pages_in_use == 0


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.0, 1.0)])
def test_verification_leaves_the_distribution_unchanged(temperature, top_p):
    """Emitted tokens (the draft when accepted, the residual draw when not) follow the target's distribution
    after temperature and top-p, whatever the draft: chi-square over 20,000 draws."""
    V, L = 16, 20_000
    rng = np.random.default_rng(0)
    logits_V = rng.normal(size=V).astype(np.float32) * 2
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=int(s)) for s in rng.integers(0, 2**62, L)]
    t = SamplingTensors.build(params, [0] * L, L)
    # The most likely token as the draft (often accepted) and an unlikely one (mostly rejected).
    scaled = logits_V.astype(np.float64) / temperature
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros(V, bool)
    keep[order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]] = True
    p = np.where(keep, p, 0)
    p /= p.sum()
    for draft in (int(order[0]), int(order[4])):
        out = sample(np.broadcast_to(logits_V, (L, V)), t, 0, drafts=np.full(L, draft, np.int32))
        emitted = np.where(np.asarray(out.accept), draft, np.asarray(out.residual))
        counts = np.bincount(emitted, minlength=V)
        assert counts[~keep].sum() == 0, "a token outside top-p was emitted"
        assert np.asarray(out.accept).mean() == pytest.approx(p[draft], abs=0.02)
        result = scipy.stats.chisquare(counts[keep], counts.sum() * p[keep] / p[keep].sum())
        assert result.pvalue > 0.01, (draft, counts, L * p)


def test_speculative_config_is_checked():
    with pytest.raises(ValueError, match="method 'medusa' is not supported"):
        Settings(speculative_config='{"method": "medusa", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
        Settings(speculative_config={"method": "eagle3", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        Settings(speculative_config={"method": "eagle3", "num_speculative_tokens": 2, "draft_tp": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        Settings(speculative_config="{method: eagle3}")
    with pytest.raises(ValueError, match="give the draft's directory"):
        Settings(model="m3-tiny", speculative_config={"method": "eagle3", "num_speculative_tokens": 2}
                 ).speculative().draft_path("m3-tiny")


def test_server_with_speculation_reports_acceptance(tmp_path_factory, reference):
    """`m3jax serve --speculative-config ...` on loopback (the engine in its own process): answers greedily with
    exactly the text of the engine without speculation, exports the speculation counters under both names, and
    `m3jax bench serve` reports the acceptance length."""
    import subprocess
    import sys
    import urllib.request

    from serving_helpers import REPO, ServerProcess, scrape

    tmp = tmp_path_factory.mktemp("spec-server")
    # --no-warmup: only the executables these greedy requests run are compiled (spec_llm checks the warm-up of
    # every variant).
    srv = ServerProcess(["--speculative-config", _spec(3), "--no-warmup"], tmp / "server.log")
    try:
        body = json.dumps({"prompt": TEXTS[2], "max_tokens": 24, "temperature": 0}).encode()
        req = urllib.request.Request(srv.http_url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] == 24
        plain = reference[0].generate([TEXTS[2]], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
        assert answer["choices"][0]["text"] == plain[0].outputs[0].text
        m = scrape(srv.http_url)
        drafts = m["m3jax_spec_decode_num_drafts_total"]
        assert drafts > 0 and m[f'vllm:spec_decode_num_drafts_total{{model_name="{srv.model}"}}'] == drafts
        accepted = [m[f'm3jax_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)]
        assert sum(accepted) == m["m3jax_spec_decode_num_accepted_tokens_total"] > 0
        out = tmp / "bench"
        cmd = [sys.executable, "-m", "m3jax", "bench", "serve", "--base-url", srv.http_url, "--input-len", "16",
               "--output-len", "16", "--concurrency", "2", "--num-prompts", "4", "--result-dir", str(out),
               "--tag", "s", "--no-plot"]
        proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "acceptance length=" in proc.stdout
        assert json.loads((out / "s-c2.json").read_text())["metrics"]["spec_acceptance_length"] >= 1.0
    finally:
        srv.kill()
