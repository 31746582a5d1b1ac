"""Who runs in the next step, with how many tokens, in which pages. Plain Python over request states.

Policy (continuous batching, as in vLLM v1):
- Running requests first, oldest first: each gets all its uncomputed tokens (1 for a decode, the rest of the
  prompt for a prefill) as far as the step's token budget allows, so long prompts are chunked.
- When a running request needs a page and none is free, the newest running request is preempted by
  recompute: its pages are freed and it goes back to the front of the queue with prompt + output so far.
- Then waiting requests, first come first served, while budget, the running cap and free pages allow.
"""

from __future__ import annotations

import collections
import dataclasses

from serving.kv_cache import PageAllocator
from serving.request import FinishReason, Request, Status


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int

    def __post_init__(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be positive, got {getattr(self, key)}")


@dataclasses.dataclass
class ScheduledRow:
    request: Request
    tokens: list[int]
    start: int
    sample: bool  # this chunk reaches the end of the request's known tokens: sample the next one


@dataclasses.dataclass
class StepPlan:
    rows: list[ScheduledRow]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._by_id: dict[str, Request] = {}

    # ---- requests in and out -------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.page_size)

    def add(self, req: Request) -> None:
        """Queue a request; refuse (ValueError) one that can never be served."""
        if req.request_id in self._by_id:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        if len(req.prompt_ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(req.prompt_ids)} tokens; the model length is "
                             f"{self.config.max_model_len} (prompt plus at least one generated token)")
        if req.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {req.max_tokens}")
        longest = min(len(req.prompt_ids) + req.max_tokens, self.config.max_model_len)
        if self.pages_for(longest) > self.allocator.num_usable:
            raise ValueError(f"the request may grow to {longest} tokens = {self.pages_for(longest)} pages, but the "
                             f"KV cache holds {self.allocator.num_usable} pages; lower max_tokens")
        req.status = Status.WAITING
        self.waiting.append(req)
        self._by_id[req.request_id] = req

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def abort(self, request_id: str) -> Request | None:
        req = self._by_id.get(request_id)
        if req is None or req.finished:
            return None
        self.finish(req, FinishReason.ABORT)
        return req

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        if req.finished:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.allocator.free(req.pages)
        req.pages = []
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        del self._by_id[req.request_id]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            need = self.pages_for(req.num_computed + n) - len(req.pages)
            while need > self.allocator.num_free and self.running[-1] is not req:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
            if need > self.allocator.num_free:
                # Even alone it does not fit right now: it waits for pages (checked at add() that it can fit).
                self.running.remove(req)
                self._preempt(req)
                preempted.append(req)
                break
            req.pages += self.allocator.allocate(need)
            rows.append(self._row(req, n))
            budget -= n
            i += 1

        # No admissions while preempting: the pool is the bottleneck, admitting would thrash.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            need = self.pages_for(n)
            if need > self.allocator.num_free:
                break
            self.waiting.popleft()
            req.pages = self.allocator.allocate(need)
            req.status = Status.RUNNING
            self.running.append(req)
            rows.append(self._row(req, n))
            budget -= n
        return StepPlan(rows, preempted)

    def _row(self, req: Request, n: int) -> ScheduledRow:
        start = req.num_computed
        return ScheduledRow(req, req.all_ids[start:start + n], start, sample=start + n == req.num_tokens)

    def _preempt(self, req: Request) -> None:
        self.allocator.free(req.pages)
        req.pages = []
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """Record a finished step: computed tokens, sampled tokens, stop conditions. Returns finished requests."""
        done: list[Request] = []
        for row in plan.rows:
            req = row.request
            if req.finished:  # aborted while the step ran
                continue
            req.num_computed += len(row.tokens)
            if not row.sample:
                continue
            tok = sampled[req.request_id]
            req.output_ids.append(tok)
            reason = None
            if (tok in req.eos_token_ids and not req.ignore_eos) or tok in req.stop_token_ids:
                reason = FinishReason.STOP
            elif len(req.output_ids) >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                self.finish(req, reason)
                done.append(req)
        return done
