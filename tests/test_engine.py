"""The engine end to end on a tiny random model: exactness under continuous batching, chunked prefill and
preemption; seeded sampling; nothing lost; bad input; buckets compiled once."""

import asyncio

import numpy as np
import pytest

from serving import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm():
    # 40 usable pages of 16 tokens for 8 running requests of up to ~100 tokens: preemption is forced.
    return LLM(model="m3-tiny", dtype="float32", max_model_len=128, kv_cache_pages=21, max_num_seqs=8,
               max_num_batched_tokens=32, progress=False)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 500, rng.integers(3, 70)).tolist() for _ in range(n)]


def _alone(llm, prompts, params):
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_buckets_compiled_once_at_startup(llm):
    runner = llm.engine.runner
    assert runner.num_compiled == len(runner.bucket_shapes()) == runner._step._cache_size()
    llm.generate(_prompts(4, seed=9), GREEDY, use_tqdm=False)
    llm.generate([[1] * 100], SamplingParams(temperature=0.5, top_p=0.9, seed=1, max_tokens=3), use_tqdm=False)
    assert runner._step._cache_size() == runner.num_compiled, "serving must not compile new shapes"


def test_exact_under_batching_chunking_and_preemption(llm):
    prompts = _prompts(36)
    params = [SamplingParams(temperature=0.0, max_tokens=int(m)) for m in np.random.default_rng(1).integers(5, 40, 36)]
    alone = [llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids
             for p, q in zip(prompts, params, strict=True)]

    eng = llm.engine
    before = eng.stats["preemptions"]
    # Requests arrive over time: a few new ones before each step.
    ids, results, pending = [], {}, list(zip(prompts, params, strict=False))
    while pending or eng.has_work():
        for _ in range(3):
            if pending:
                p, q = pending.pop(0)
                ids.append(eng.add_request(p, q))
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out
    got = [results[i].outputs[0].token_ids for i in ids]
    assert eng.stats["preemptions"] > before, "the pool must be small enough to force preemption"
    assert got == alone
    assert all(results[i].outputs[0].finish_reason == "length" for i in ids)
    assert eng.pages_in_use == 0 and eng.num_running == 0 and eng.num_waiting == 0


def test_seeded_sampling_is_reproducible(llm):
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    b = _alone(llm, prompts, params)
    assert a == b
    c = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=1.0, seed=99,
                                                                              max_tokens=10), use_tqdm=False)]
    assert c != a


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
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12 and llm.engine.pages_in_use == 0


def test_abort_and_stop_token_and_logprobs(llm):
    eng = llm.engine
    rid = eng.add_request([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=100))
    eng.step()
    eng.abort(rid)
    outs = [o for o in eng.step() if o.request_id == rid]
    assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    first = llm.generate([[9, 8, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stopped = llm.generate([[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=12,
                                                        stop_token_ids=[first[3]]), use_tqdm=False)[0]
    assert stopped.outputs[0].token_ids == first[:first.index(first[3]) + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == first[3]
    lp = llm.generate([[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2), use_tqdm=False)[0]
    for entry, tok in zip(lp.outputs[0].logprobs, lp.outputs[0].token_ids, strict=False):
        assert entry.token_id == tok and len(entry.top) == 2 and tok == max(entry.top, key=entry.top.get)
    assert eng.pages_in_use == 0


def test_async_engine_streams_and_cancel_frees_pages(llm):
    engine = llm.async_engine()

    async def main():
        async def full(p):
            toks = []
            async for out in engine.generate(p, GREEDY):
                toks += out.delta_token_ids
            return toks

        async def cancel_early(p):
            async for _ in engine.generate(p, SamplingParams(temperature=0.0, max_tokens=100)):
                break  # the client goes away after the first token

        prompts = _prompts(10, seed=5)
        results = await asyncio.gather(*(full(p) for p in prompts), *(cancel_early(p) for p in prompts[:5]))
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate([], GREEDY):
                pass
        return results[:10], prompts

    try:
        got, prompts = asyncio.run(main())
        assert got == _alone_async_safe(engine, prompts)
    finally:
        engine.shutdown()
    assert llm.engine.pages_in_use == 0 and not llm.engine.has_work()


def _alone_async_safe(engine, prompts):
    async def one(p):
        toks = []
        async for out in engine.generate(p, GREEDY):
            toks += out.delta_token_ids
        return toks

    return [asyncio.run(one(p)) for p in prompts]
