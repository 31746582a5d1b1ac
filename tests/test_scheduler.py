"""The scheduler alone (no JAX): chunked prefill under the token budget, running cap, FCFS, preemption by
recompute, stop conditions, abort, and every page back in the pool at the end."""

import pytest

from serving.kv_cache import PageAllocator
from serving.request import FinishReason, Request, Status
from serving.scheduler import Scheduler, SchedulerConfig


def make(pages=64, seqs=4, budget=32, max_len=256, ps=8):
    return Scheduler(SchedulerConfig(seqs, budget, max_len, ps), PageAllocator(pages))


def req(i, n=10, max_tokens=5, **kw):
    return Request(f"r{i}", list(range(1, n + 1)), max_tokens, eos_token_ids=frozenset({0}), **kw)


def run(s, next_token=lambda r: 7, max_steps=1000):
    """Drive the scheduler with a fake model; returns the plans."""
    plans = []
    for _ in range(max_steps):
        if not s.has_work():
            return plans
        plan = s.schedule()
        assert plan.rows or plan.preempted
        assert plan.num_tokens <= s.config.max_num_batched_tokens
        assert len(plan.rows) <= s.config.max_num_seqs
        s.update(plan, {r.request.request_id: next_token(r.request) for r in plan.rows if r.sample})
        plans.append(plan)
    raise AssertionError("did not finish")


def test_chunked_prefill_and_budget():
    s = make(budget=16)
    r = req(0, n=40, max_tokens=3)
    s.add(r)
    plans = run(s)
    chunks = [(p.rows[0].start, len(p.rows[0].tokens), p.rows[0].sample) for p in plans]
    assert chunks[:3] == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert chunks[3:] == [(40, 1, True), (41, 1, True)]
    assert r.output_ids == [7, 7, 7] and r.finish_reason is FinishReason.LENGTH
    assert s.allocator.num_used == 0


def test_running_cap_and_fcfs():
    s = make(seqs=2, budget=64)
    reqs = [req(i) for i in range(5)]
    for r in reqs:
        s.add(r)
    first = s.schedule()
    assert [row.request.request_id for row in first.rows] == ["r0", "r1"]
    s.update(first, {row.request.request_id: 7 for row in first.rows})
    run(s)
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)


def test_preemption_by_recompute_keeps_outputs():
    # 6 usable pages of 8 tokens; three requests that each grow to 3-4 pages cannot all stay resident.
    s = make(pages=7, seqs=8, budget=64, ps=8)
    reqs = [req(i, n=12, max_tokens=14) for i in range(3)]
    for r in reqs:
        s.add(r)
    # The "model": the next token depends only on the full token history, like greedy decoding.
    plans = run(s, next_token=lambda r: (sum(r.all_ids) * 31 + len(r.all_ids)) % 50 + 1)
    assert any(p.preempted for p in plans)
    assert sum(r.num_preemptions for r in reqs) > 0
    alone = []
    for i in range(3):
        s2 = make(pages=64)
        r2 = req(i, n=12, max_tokens=14)
        s2.add(r2)
        run(s2, next_token=lambda r: (sum(r.all_ids) * 31 + len(r.all_ids)) % 50 + 1)
        alone.append(r2.output_ids)
    assert [r.output_ids for r in reqs] == alone
    assert s.allocator.num_used == 0 and s.allocator.num_free == 6


def test_stop_conditions():
    s = make(max_len=16)
    eos = req(0, max_tokens=50)
    stop_tok = req(1, max_tokens=50, stop_token_ids=frozenset({9}))
    ignore = req(2, max_tokens=4, ignore_eos=True)
    long = req(3, n=10, max_tokens=50)
    for r in (eos, stop_tok, ignore, long):
        s.add(r)
    tokens = {"r0": 0, "r1": 9, "r2": 0, "r3": 5}
    run(s, next_token=lambda r: tokens[r.request_id])
    assert eos.finish_reason is FinishReason.STOP and eos.output_ids == [0]
    assert stop_tok.finish_reason is FinishReason.STOP and stop_tok.output_ids == [9]
    assert ignore.finish_reason is FinishReason.LENGTH and ignore.output_ids == [0] * 4
    assert long.finish_reason is FinishReason.LENGTH and long.num_tokens == 16


def test_abort_frees_pages_and_bad_requests_are_refused():
    s = make()
    a, b = req(0, max_tokens=100), req(1, max_tokens=100)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    s.update(plan, {"r0": 7, "r1": 7})
    assert s.abort("r0") is a and a.finish_reason is FinishReason.ABORT and a.status is Status.FINISHED
    assert s.abort("r0") is None and s.abort("nope") is None
    assert s.allocator.num_used == len(b.pages)
    with pytest.raises(ValueError, match="empty"):
        s.add(Request("x", [], 5))
    with pytest.raises(ValueError, match="model length"):
        s.add(Request("y", list(range(300)), 5))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add(Request("z", [1], 0))
    with pytest.raises(ValueError, match="already in use"):
        s.add(req(1))
    with pytest.raises(ValueError, match="KV cache holds"):
        make(pages=3).add(req(5, n=10, max_tokens=100))
    s.abort("r1")
    assert s.allocator.num_used == 0 and not s.has_work()
