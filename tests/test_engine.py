"""The engine end to end on a tiny random model: exactness under continuous batching, chunked prefill,
preemption and async scheduling, at odd sizes too; seeded sampling; nothing lost; bad input; every executable
made at start-up and none after, whatever the requests ask for; one thread steps the core."""

import asyncio
import contextlib
import dataclasses
import re
import time

import jax
import numpy as np
import pytest

from m3jax.api import M3Model
from m3jax.config import preset
from m3jax.params import init_params
from m3jax.settings import Settings
from serving import LLM, RequestOutputKind, SamplingParams
from serving.core import EngineCore

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# 20 usable pages of 16 tokens for 8 running requests of up to ~100 tokens: preemption is forced.
SETTINGS = dict(model="m3-tiny", dtype="float32", max_model_len=128, kv_cache_pages=21, max_num_seqs=8,
                max_num_batched_tokens=32, progress=False)


@pytest.fixture(scope="module")
def llm():
    with LLM(**SETTINGS) as llm:
        yield llm


def _prompts(n, seed=0, vocab=500):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, rng.integers(3, 70)).tolist() for _ in range(n)]


def _alone(llm, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params, strict=True)]


def _wait_idle(core, timeout=30.0):
    deadline = time.monotonic() + timeout
    while core.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not core.has_work()


@contextlib.contextmanager
def count_compiles():
    """Every XLA executable built in the block (persistent-cache hits included), process-wide."""
    from jax._src import dispatch, monitoring

    seen = []

    def listener(event, duration, **kw):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            seen.append(kw)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(listener)


def test_every_request_after_warmup_runs_without_compiling(llm):
    """One executable per token bucket, all made at start-up; then every SamplingParams feature, long
    penalty histories, preemption and aborts run without a single compile."""
    core = llm.core
    # A forward per token bucket (8, 16, 32; each also gives its greedy tokens) and three samplings per row count
    # (8 rows for all three): the general one and the two plain ones that draw (draw, filter).
    assert core.runner.shapes() == [("forward", 8), ("forward", 16), ("forward", 32), ("sample", 8),
                                    ("sample_draw", 8), ("sample_filter", 8)]
    assert core.num_executables == 6
    features = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=3, max_tokens=20),
        SamplingParams(temperature=1.0, max_tokens=20),  # unseeded
        SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                       max_tokens=60, seed=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.1, max_tokens=30),
        SamplingParams(temperature=0.0, logprobs=5, max_tokens=10),
        SamplingParams(temperature=0.0, stop_token_ids=[7, 8, 9], max_tokens=30),
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40),
        SamplingParams(temperature=0.8, n=3, seed=9, max_tokens=12),
        SamplingParams(temperature=0.0, logit_bias={7: 100.0}, max_tokens=5),
    ]
    prompts = _prompts(len(features), seed=11)
    prompts[3] = list(range(1, 68))  # a long penalty history: prompt and output
    with count_compiles() as compiles:
        outs = llm.generate(prompts * 2, features * 2, use_tqdm=False)  # 16 requests: preemption
        for _ in llm.stream([1, 2, 3], SamplingParams(max_tokens=50)):
            break  # aborted after its first token
        _wait_idle(core)
    assert compiles == [], "serving must not compile"
    assert core.num_executables == 6
    assert core.stats["preemptions"] > 0
    k = len(features)
    seeded = [i for i in range(k) if i != 2]  # the unseeded request draws differently each time
    assert [outs[i].outputs[0].token_ids for i in seeded] == [outs[k + i].outputs[0].token_ids for i in seeded]
    assert [len(o.outputs) for o in outs] == [1] * 8 + [3, 1] + [1] * 8 + [3, 1]
    assert outs[9].outputs[0].token_ids == [7] * 5  # logit_bias +100 forces its token
    assert core.pages_in_use == 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_exact_under_batching_chunking_and_preemption(llm, async_scheduling):
    prompts = _prompts(36)
    params = [SamplingParams(temperature=0.0, max_tokens=int(m)) for m in np.random.default_rng(1).integers(5, 40, 36)]
    alone = _alone(llm, prompts, params)
    alone_reasons = [llm.generate([p], q, use_tqdm=False)[0].outputs[0].finish_reason
                     for p, q in zip(prompts, params, strict=True)]

    # This test's thread steps a core of its own (never started): requests arrive between steps.
    core = EngineCore(Settings(**SETTINGS, async_scheduling=async_scheduling))
    ids, results, pending = [], {}, list(zip(prompts, params, strict=False))
    while pending or core.has_work():
        for _ in range(3):
            if pending:
                p, q = pending.pop(0)
                req, text = core.prepare(p, q)
                ids.append(core.submit(req, text))
        for out in core.step():
            if out.finished:
                results[out.request_id] = out
    got = [results[i].outputs[0].token_ids for i in ids]
    assert core.stats["preemptions"] > 0, "the pool must be small enough to force preemption"
    assert got == alone
    assert [results[i].outputs[0].finish_reason for i in ids] == alone_reasons
    assert core.pages_in_use == 0 and core.num_running == 0 and core.num_waiting == 0
    assert core.num_executables == 6


def test_exact_at_odd_sizes():
    """Model length 1000 (63 pages of 16: not a power of two), 3 rows, a 100-token step budget: batched equals
    alone, and the engine's greedy tokens are the model's own greedy decoding."""
    cfg = preset("m3-tiny")
    with LLM(model="m3-tiny", dtype="float32", max_model_len=1000, max_num_seqs=3, max_num_batched_tokens=100,
             progress=False) as odd:
        assert odd.core.runner.token_buckets == [8, 16, 32, 64, 100]
        assert odd.core.runner.pages_per_row == 63
        prompts = _prompts(7, seed=4, vocab=cfg.vocab_size)
        prompts[0] = list(range(1, 300))  # a prompt over several 100-token steps
        params = SamplingParams(temperature=0.0, max_tokens=17)
        batched = [o.outputs[0].token_ids for o in odd.generate(prompts, params, use_tqdm=False)]
        assert batched == _alone(odd, prompts, params)
    model = M3Model.create(cfg, init_params(cfg, seed=0, dtype="float32"))  # the preset's weights
    assert batched[1] == list(model.generate_greedy(prompts[1], 17, stop_ids=cfg.eos_token_ids))


def test_step_updates_the_kv_pool_in_place(llm):
    """The scanned layers write their run's pages inside the loop: the compiled step holds no copy of a page
    pool (a copy per step would cost the whole KV cache's bandwidth)."""
    runner = llm.core.runner
    text = runner.executable("forward", runner.token_buckets[-1]).as_text()
    pools = set()
    for a in jax.tree.leaves(runner.kv):
        pools.add(",".join(map(str, a.shape)))
        pools.add(",".join(map(str, (a.shape[0] * a.shape[1], *a.shape[2:]))))  # the flat view the scan carries
    copies = [line for line in text.splitlines() if " copy(" in line
              and (m := re.search(r"\[([0-9,]+)\]", line)) and m.group(1) in pools]
    assert not copies, copies[:3]


def test_prefix_cache_changes_no_token(llm):
    """Requests sharing a 100-token prefix (past MSA's 4 x 16 selectable tokens, so selection drops blocks over the
    cached pages, and through the dense layer too) give the tokens they give with the cache off, greedy and
    seeded, batched and alone; the hits are counted."""
    rng = np.random.default_rng(21)
    prefix = rng.integers(1, 500, 100).tolist()
    prompts = [prefix + rng.integers(1, 500, int(k)).tolist() for k in (1, 5, 9, 12)]
    params = [SamplingParams(temperature=0.0, max_tokens=15), SamplingParams(temperature=0.9, seed=4, max_tokens=15)]
    core = llm.core
    hits0 = core.prefix_cache_hits
    llm.generate([prefix + [7]], GREEDY, use_tqdm=False)  # the prefix is now cached
    cached = [[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in params]
    cached_alone = [_alone(llm, prompts, p) for p in params]
    assert core.prefix_cache_hits - hits0 >= 2 * 2 * len(prompts) * 96  # 6 full pages of 16 per request
    with LLM(**SETTINGS, enable_prefix_caching=False) as plain:
        uncached = [[o.outputs[0].token_ids for o in plain.generate(prompts, p, use_tqdm=False)] for p in params]
        assert plain.core.prefix_cache_hits == 0
    assert cached == uncached == cached_alone


def test_seeded_sampling_is_reproducible(llm):
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    b = _alone(llm, prompts, params)
    assert a == b
    c = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=1.0, seed=99,
                                                                              max_tokens=10), use_tqdm=False)]
    assert c != a


def test_penalised_requests_are_batch_invariant(llm):
    prompts = _prompts(5, seed=8)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7, max_tokens=25)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert batched == _alone(llm, prompts, params)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert plain != [b[:12] for b in batched]


def test_bad_input_is_refused_and_engine_keeps_serving(llm):
    cases = [
        ([], {}, "empty"),
        (list(range(1, 200)), {}, "model length"),
        ([1, 2, 3], {"max_tokens": 0}, "max_tokens"),
        ([1, 2, 3], {"temperature": -1.0}, "temperature"),
        ([1, 2, 3], {"top_p": 0.0}, "top_p"),
        ([1, 99999], {}, "vocabulary"),
        ("text", {}, "no tokenizer"),
    ]
    for prompt, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            llm.generate([[5, 6, 7], prompt], SamplingParams(**kw) if kw else GREEDY, use_tqdm=False)
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory nor a preset"):
        LLM(model="/nonexistent/model")
    with pytest.raises(TypeError, match="did you mean 'max_num_seqs'"):
        LLM(model="m3-tiny", max_num_seq=4)
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12 and llm.core.pages_in_use == 0


def test_abort_and_stop_token_and_logprobs(llm):
    core = llm.core
    stream = llm.stream([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=100))
    next(stream)
    stream.close()  # the caller leaves: the request is aborted and its pages freed
    _wait_idle(core)
    assert core.pages_in_use == 0 and core.stats["finished_abort"] >= 1
    first = llm.generate([[9, 8, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stopped = llm.generate([[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=12,
                                                        stop_token_ids=[first[3]]), use_tqdm=False)[0]
    assert stopped.outputs[0].token_ids == first[:first.index(first[3]) + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == first[3]
    lp = llm.generate([[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2), use_tqdm=False)[0]
    for entry, tok in zip(lp.outputs[0].logprobs, lp.outputs[0].token_ids, strict=True):
        assert entry.token_id == tok and len(entry.top) == 2 and tok == max(entry.top, key=entry.top.get)
    assert core.pages_in_use == 0


def test_generate_returns_whole_outputs_and_stream_can_give_deltas(llm):
    """`LLM.generate` returns each request's whole output whatever `output_kind` asks (it returns only the last);
    `LLM.stream` with RequestOutputKind.DELTA yields what each update added, which joins to that output, and
    with FINAL_ONLY that output alone."""
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True)
    want = llm.generate([[9, 8, 7]], params, use_tqdm=False)[0].outputs[0]
    delta = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    got = llm.generate([[9, 8, 7]], delta, use_tqdm=False)[0].outputs[0]
    assert got == want and len(want.token_ids) == 20
    updates = list(llm.stream([9, 8, 7], delta))
    assert len(updates) > 1 and updates[-1].finished
    for u in updates:
        c = u.outputs[0]
        assert (c.text, c.token_ids) == (u.delta_text, u.delta_token_ids) and len(c.logprobs) == len(c.token_ids)
    joined = [x for u in updates for x in u.outputs[0].token_ids]
    assert joined == want.token_ids and "".join(u.outputs[0].text for u in updates) == want.text
    assert [x for u in updates for x in u.outputs[0].logprobs] == want.logprobs
    final = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    only = list(llm.stream([9, 8, 7], final))
    assert len(only) == 1 and only[0].finished and only[0].outputs[0] == want


def test_one_thread_steps_the_core(llm):
    with pytest.raises(RuntimeError, match="one thread steps the core"):
        llm.core.step()


def test_async_engine_streams_and_cancel_frees_pages(llm):
    engine = llm.async_engine()  # the same core: LLM.generate and the async engine share its one thread

    async def main():
        async def full(p):
            toks = []
            async for out in engine.generate(p, GREEDY):
                toks += out.delta_token_ids
            return toks

        async def cancel_early(p):
            async for _ in engine.generate(p, SamplingParams(temperature=0.0, max_tokens=50)):
                break  # the client goes away after the first token

        prompts = _prompts(10, seed=5)
        results = await asyncio.gather(*(full(p) for p in prompts), *(cancel_early(p) for p in prompts[:5]))
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate([], GREEDY):
                pass
        return results[:10], prompts

    got, prompts = asyncio.run(main())
    assert got == _alone(llm, prompts, GREEDY)
    _wait_idle(llm.core)
    assert llm.core.pages_in_use == 0


def test_step_outputs_reach_the_loop_in_one_wakeup_per_burst():
    """A step's outputs (one per running request) cross to the event loop with one wake-up, in order per queue."""
    import threading

    from serving.engine import _Mailbox

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        schedule = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(1), schedule(*a))[1]
        box = _Mailbox(loop)
        queues = [asyncio.Queue() for _ in range(4)]
        step = threading.Thread(target=lambda: [box.post(queues[i % 4], i) for i in range(64)])
        step.start()
        step.join()  # the loop is held here: every post of the burst lands before the drain runs
        await asyncio.sleep(0)
        first = [[q.get_nowait() for _ in range(q.qsize())] for q in queues]
        box.post(queues[0], 64)  # the next burst schedules its own drain
        await asyncio.sleep(0)
        return first, queues[0].get_nowait(), len(wakeups)

    got, late, wakeups = asyncio.run(main())
    assert got == [list(range(i, 64, 4)) for i in range(4)]
    assert late == 64 and wakeups == 2


def test_a_stream_behind_the_steps_gets_its_waiting_outputs_merged():
    """Outputs waiting in a stream's queue (the loop behind the steps) come out as one: both deltas, the later
    state. Never across choices or an error; a finished output ends a merge."""
    from types import SimpleNamespace

    from serving.engine import AsyncEngine
    from serving.outputs import CompletionOutput, RequestOutput

    class Core:  # what AsyncEngine uses of an EngineCore
        sinks, aborted = [], []

        def start(self):
            pass

        def prepare_group(self, prompt, params, request_id):
            return [(SimpleNamespace(parent_id="r", request_id=f"r#{i}"), None) for i in range(params.n)]

        def submit(self, req, text, sink):
            self.sinks.append(sink)

        def abort(self, rid):
            self.aborted.append(rid)

    def out(index, ids, new, finished=False, error=None):
        text = "".join(chr(97 + t) for t in ids)
        return RequestOutput("r", None, [1], [CompletionOutput(index, text, ids)], finished,
                             "".join(chr(97 + t) for t in new), new, error=error)

    posted = [out(0, [1], [1]), out(0, [1, 2], [2]), out(0, [1, 2, 3], [3]), out(1, [9], [9]),
              out(0, [1, 2, 3, 4], [4], finished=True), out(1, [9, 8], [8]), out(1, [9, 8, 7], [7], finished=True)]

    async def main():
        core = Core()
        stream = AsyncEngine(core).generate([5], SamplingParams(n=2))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the stream has submitted both choices and waits on its queue
        for o in posted:  # a whole burst lands before the stream runs again
            core.sinks[0](o)
        return [await first] + [o async for o in stream], core.aborted

    got, aborted = asyncio.run(main())
    assert [(o.outputs[0].index, o.delta_token_ids, o.delta_text, o.outputs[0].token_ids, o.finished) for o in got] == [
        (0, [1, 2, 3], "bcd", [1, 2, 3], False), (1, [9], "j", [9], False), (0, [4], "e", [1, 2, 3, 4], True),
        (1, [8, 7], "ih", [9, 8, 7], True)]
    assert aborted == []


def test_restart_loads_compiled_steps_from_disk(tmp_path):
    """A second engine with the same settings neither traces nor compiles: its executables come from disk."""
    settings = dict(model="m3-tiny", dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                    progress=False, compilation_cache_dir=str(tmp_path))
    first = EngineCore(Settings(**settings))
    assert [e["how"] for e in first.runner.compile_log] == ["compiled"] * 5  # 2 forwards, 3 samplings
    with count_compiles() as compiles:
        second = EngineCore(Settings(**settings))
    assert [e["how"] for e in second.runner.compile_log] == ["loaded"] * 5
    assert compiles and not [c for c in compiles if "_step" in c["fun_name"]]  # only start-up helpers compile
    other = EngineCore(Settings(**{**settings, "max_num_seqs": 3}))  # another shape: another key
    assert [e["how"] for e in other.runner.compile_log] == ["compiled"] * 5
    tokens = []
    for core in (first, second):
        req, _ = core.prepare([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5))
        core.submit(req)
        outs = []
        while core.has_work():
            outs += core.step()
        assert outs[-1].finished
        tokens.append(outs[-1].outputs[0].token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 5


def test_waiting_delta_outputs_merge_into_one_delta():
    """With RequestOutputKind.DELTA a merge joins both outputs' text, ids and logprobs (each holds only its own),
    and keeps prompt_logprobs, which only the first carries."""
    from serving.engine import merge
    from serving.outputs import CompletionOutput, Logprob, RequestOutput

    def out(ids, prompt_logprobs=None, finished=False):
        text = "".join(chr(97 + t) for t in ids)
        lps = [Logprob(t, -1.0, {t: -1.0}) for t in ids]
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, ids, logprobs=lps)], finished, text, ids,
                             prompt_logprobs=prompt_logprobs)

    first, second = out([1, 2], prompt_logprobs=[None, Logprob(2, -0.5, {})]), out([3], finished=True)
    m = merge(first, second, RequestOutputKind.DELTA)
    c = m.outputs[0]
    assert (c.text, c.token_ids, m.delta_text, m.delta_token_ids) == ("bcd", [1, 2, 3], "bcd", [1, 2, 3])
    assert [e.token_id for e in c.logprobs] == [1, 2, 3] and m.prompt_logprobs == first.prompt_logprobs
    assert m.finished and first.outputs[0].token_ids == [1, 2]  # the inputs are left as they were
