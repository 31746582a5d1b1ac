"""The scheduler alone (no JAX): chunked prefill under the token budget, running cap, FCFS, preemption by
recompute, stop conditions, abort, every page and slot back at the end, and async scheduling (step N+1
scheduled before step N's tokens are known) giving exactly the synchronous outputs."""

import numpy as np
import pytest

from serving.kv_cache import PageAllocator
from serving.request import PLACEHOLDER, FinishReason, Request, Status
from serving.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig


def make(pages=64, seqs=4, budget=32, max_len=256, ps=8):
    return Scheduler(SchedulerConfig(seqs, budget, max_len, ps), PageAllocator(pages))


def req(i, n=10, max_tokens=5, **kw):
    return Request(f"r{i}", list(range(1, n + 1)), max_tokens, eos_token_ids=frozenset({0}), **kw)


class FakeModel:
    """Samples a token from each sampling row's full history, as the device would: the prompt plus every token
    it sampled before for that request (so placeholders are resolved on the 'device', as in the engine)."""

    def __init__(self, next_token):
        self.next_token = next_token
        self.sampled: dict[int, list[int]] = {}

    def run(self, s, scheduled):
        seqs, toks = [], []
        for row in scheduled.rows:
            mine = self.sampled.setdefault(row.seq, [])
            req = s.get_by_seq(row.seq)
            history = req.prompt_ids + mine[:row.num_output]
            for k, t in enumerate(row.token_ids):  # a placeholder is the token the last step sampled
                pos = row.start + k
                assert t == (history[pos] if t != PLACEHOLDER else PLACEHOLDER)
            if row.sample:
                tok = self.next_token(req, history)
                del mine[row.num_output:]
                mine.append(tok)
                seqs.append(row.seq)
                toks.append(tok)
        return ModelRunnerOutput(seqs, np.asarray(toks, np.int32))


def run(s, next_token=lambda r, h: 7, async_scheduling=False, max_steps=1000, model=None):
    """Drive the scheduler with a fake model, synchronously or one step ahead; returns the schedules."""
    model, schedules, inflight = model or FakeModel(next_token), [], None
    for _ in range(max_steps):
        if not s.has_work() and inflight is None:
            return schedules
        scheduled = s.schedule()
        assert scheduled.num_tokens <= s.config.max_num_batched_tokens
        assert len(scheduled.rows) <= s.config.max_num_seqs
        launched = model.run(s, scheduled) if scheduled.rows else None
        if scheduled.rows or scheduled.preempted:
            schedules.append(scheduled)
        if async_scheduling:
            if inflight is not None:
                s.update(inflight)
            inflight = launched
        elif launched is not None:
            s.update(launched)
    raise AssertionError("did not finish")


def test_chunked_prefill_and_budget():
    s = make(budget=16)
    r = req(0, n=40, max_tokens=3)
    s.add(r)
    plans = run(s)
    chunks = [(p.rows[0].start, len(p.rows[0].token_ids), p.rows[0].sample) for p in plans]
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
    assert [row.seq for row in first.rows] == [reqs[0].seq, reqs[1].seq]
    assert sorted(row.slot for row in first.rows) == [0, 1]
    model = FakeModel(lambda r, h: 7)
    s.update(model.run(s, first))
    run(s, model=model)
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert sorted(s._free_slots) == [0, 1]


def _history_model(r, history):
    return (sum(history) * 31 + len(history)) % 50 + 1  # depends on the whole history, like greedy decoding


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_by_recompute_keeps_outputs(async_scheduling):
    # 6 usable pages of 8 tokens; three requests that each grow to 3-4 pages cannot all stay resident.
    s = make(pages=7, seqs=8, budget=64, ps=8)
    reqs = [req(i, n=12, max_tokens=14) for i in range(3)]
    for r in reqs:
        s.add(r)
    plans = run(s, next_token=_history_model, async_scheduling=async_scheduling)
    assert any(p.preempted for p in plans)
    assert sum(r.num_preemptions for r in reqs) > 0
    alone = []
    for i in range(3):
        s2 = make(pages=64)
        r2 = req(i, n=12, max_tokens=14)
        s2.add(r2)
        run(s2, next_token=_history_model)
        alone.append(r2.output_ids)
    assert [r.output_ids for r in reqs] == alone
    assert s.allocator.num_used == 0 and s.allocator.num_free == 6
    assert all(r.num_placeholders == 0 for r in reqs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_conditions(async_scheduling):
    s = make(max_len=16)
    eos = req(0, max_tokens=50)
    stop_tok = req(1, max_tokens=50, stop_token_ids=frozenset({9}))
    ignore = req(2, max_tokens=4, ignore_eos=True)
    long = req(3, n=10, max_tokens=50)
    for r in (eos, stop_tok, ignore, long):
        s.add(r)
    tokens = {"r0": 0, "r1": 9, "r2": 0, "r3": 5}
    run(s, next_token=lambda r, h: tokens[r.request_id], async_scheduling=async_scheduling)
    assert eos.finish_reason is FinishReason.STOP and eos.output_ids == [0] and eos.stop_reason is None
    assert stop_tok.finish_reason is FinishReason.STOP and stop_tok.output_ids == [9] and stop_tok.stop_reason == 9
    assert ignore.finish_reason is FinishReason.LENGTH and ignore.output_ids == [0] * 4
    assert long.finish_reason is FinishReason.LENGTH and long.num_tokens == 16
    assert s.allocator.num_used == 0


def test_async_schedules_ahead_with_placeholders():
    """The second schedule runs before the first step's tokens are known: its decode rows carry placeholders,
    and max_tokens is never overshot."""
    s = make(budget=64)
    a = req(0, n=5, max_tokens=2)
    s.add(a)
    first = s.schedule()
    assert first.rows[0].token_ids == [1, 2, 3, 4, 5] and a.num_placeholders == 1
    second = s.schedule()
    assert second.rows[0].token_ids == [PLACEHOLDER] and second.rows[0].start == 5 and a.num_placeholders == 2
    assert not s.schedule().rows  # both tokens it may have are in flight: nothing more to run
    s.update(ModelRunnerOutput([a.seq], np.array([7])))
    s.update(ModelRunnerOutput([a.seq], np.array([8])))
    assert a.output_ids == [7, 8] and a.finish_reason is FinishReason.LENGTH


def test_late_result_of_a_finished_request_is_dropped():
    s = make()
    a = req(0, max_tokens=100)
    s.add(a)
    first = s.schedule()
    s.finish(a, FinishReason.ABORT)
    s.add(req(0, max_tokens=100))  # the same client id again: a new admission
    assert s.update(ModelRunnerOutput([first.rows[0].seq], np.array([7]))) == []
    assert a.output_ids == []


def test_abort_frees_pages_and_bad_requests_are_refused():
    s = make()
    a, b = req(0, max_tokens=100), req(1, max_tokens=100)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    s.update(ModelRunnerOutput([r.seq for r in plan.rows], np.array([7, 7])))
    s.finish(a, FinishReason.ABORT)
    assert a.finish_reason is FinishReason.ABORT and a.status is Status.FINISHED and s.get("r0") is None
    s.finish(a, FinishReason.ABORT)  # a second end changes nothing
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
    s.finish(b, FinishReason.ABORT)
    assert s.allocator.num_used == 0 and not s.has_work()


def test_prefix_cache_skips_computed_pages_and_keeps_outputs():
    """A second request with the same 3-page prefix starts after it (the last prompt token is always computed);
    a preempted request comes back through its own cached pages; outputs are those of requests alone."""
    s = make(pages=64, budget=64, ps=8)
    first = req(0, n=26, max_tokens=3)
    s.add(first)
    run(s, next_token=_history_model)
    twin = Request("r1", list(range(1, 27)), 3, eos_token_ids=frozenset({0}))
    shorter = Request("r2", list(range(1, 17)), 3, eos_token_ids=frozenset({0}))  # exactly 2 pages
    s.add(twin)
    s.add(shorter)
    scheduled = s.schedule()
    starts = {row.seq: (row.start, len(row.token_ids)) for row in scheduled.rows}
    assert starts[twin.seq] == (24, 2)  # 3 full pages cached, then its own page for tokens 24, 25
    assert starts[shorter.seq] == (8, 8)  # 2 pages cached but the last token must be computed: 1 page
    assert s.prefix_hits == 24 + 8 and s.prefix_queries == 26 + 26 + 16
    assert twin.pages[0] == shorter.pages[0]  # the same physical page: shared, not copied
    assert s.allocator._refs[twin.pages[0]] == 2
    model = FakeModel(_history_model)
    s.update(model.run(s, scheduled))
    run(s, model=model)
    assert twin.output_ids == first.output_ids and s.allocator.num_used == 0

    # Preemption: the victim's pages stay named in the pool and its recompute starts from them.
    s2 = make(pages=7, seqs=8, budget=64, ps=8)
    reqs = [req(i, n=12, max_tokens=14) for i in range(3)]
    for r in reqs:
        s2.add(r)
    run(s2, next_token=_history_model)
    assert sum(r.num_preemptions for r in reqs) > 0 and s2.prefix_hits > 0
    assert [r.output_ids for r in reqs] == [run_alone(i) for i in range(3)]


def run_alone(i):
    s = make(pages=64, ps=8)
    r = req(i, n=12, max_tokens=14)
    s.add(r)
    run(s, next_token=_history_model)
    return r.output_ids
