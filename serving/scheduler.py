"""Who runs in the next step, with how many tokens, in which pages. Plain Python over request states.

`schedule()` returns a plain `SchedulerOutput` (what runs this step); `update()` takes back what the step
sampled (`ModelRunnerOutput`) and records it through `serving.stopping.append_token`, the one place that decides
that a request stops.

Policy (continuous batching, as in vLLM v1):
- Running requests first, oldest first: each gets all its uncomputed tokens (1 for a decode, the rest of the
  prompt for a prefill) as far as the step's token budget allows, so long prompts are chunked.
- When a running request needs a page and none is free, the newest running request is preempted by
  recompute: its pages are freed and it goes back to the front of the queue with prompt + output so far.
- Then waiting requests, first come first served, while budget, the running cap and free pages allow. A request
  starting from scratch first takes the longest run of cached full pages that names its prefix (prefix
  caching, serving/kv_cache.py) and computes only from there; every full page of known tokens a request
  computes is named in the pool for the next one.

Async scheduling: a request whose last step is still in flight has a placeholder for the token that step
samples (`Request.num_placeholders`); it is scheduled as if that token were known, and the executor feeds it to
the model from the previous step's device output. So step N+1 is scheduled before step N's tokens are on the
host; a request that step N finishes (EOS, a stop string) wastes one row of step N+1, whose token is dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from serving.kv_cache import PageAllocator, page_hash
from serving.request import FinishReason, Request, Status
from serving.stopping import append_token


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    num_speculative_tokens: int = 0  # k: draft tokens verified per decoding row (0: no speculation)

    def __post_init__(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be positive, got {getattr(self, key)}")


@dataclasses.dataclass
class ScheduledRow:
    """One request's part of a step: `token_ids` at positions start .. start + len - 1 (PLACEHOLDER where the
    previous step samples it), written into `pages`; `sample`: its last token's logits are sampled."""

    seq: int  # Request.seq: the request's identity for this admission
    token_ids: list[int]
    start: int
    pages: list[int]
    sample: bool
    slot: int  # the request's row of per-request device state
    sampling: object  # SamplingParams
    num_prompt: int
    num_output: int  # tokens generated before this row's sample (placeholders included)
    num_drafts: int = 0  # the row's last `num_drafts` tokens are draft tokens to verify
    next_token: int = -1  # a row that samples nothing: the prompt token after its last (speculation's draft)


@dataclasses.dataclass
class SchedulerOutput:
    rows: list[ScheduledRow]
    preempted: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


@dataclasses.dataclass
class ModelRunnerOutput:
    """What a step sampled, one entry per sampling row of its SchedulerOutput, in row order."""

    seqs: list[int]  # Request.seq of each sampled row
    token_ids: np.ndarray  # [n] int32 (with speculation: [n, 1 + k], the first `num_emitted` of each row)
    logprobs: np.ndarray | None = None  # [n] fp32, when some request asked for logprobs ([n, 1 + k] likewise)
    top_ids: np.ndarray | None = None  # [n, max_logprobs] ([n, 1 + k, max_logprobs])
    top_logprobs: np.ndarray | None = None
    num_emitted: np.ndarray | None = None  # [n]: speculation's 1 + accepted drafts per row
    drafts: np.ndarray | None = None  # [n, k]: the drafts proposed for each row's next step
    # Request.seq -> (first prompt position p, logprobs [m], ranks [m], top ids [m, K], top logprobs [m, K]) for
    # positions p .. p + m - 1 (the logprob of prompt token p + 1 + j); rows that sample or not alike.
    prompt_logprobs: dict[int, tuple] | None = None

    def emitted(self, i: int) -> list[int]:
        """The tokens sampled row i emitted, in order."""
        if self.num_emitted is None:
            return [int(self.token_ids[i])]
        return self.token_ids[i, : self.num_emitted[i]].tolist()


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._by_id: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._next_seq = 0
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        # Prefix caching, in tokens looked up and found at admission.
        self.prefix_queries = 0
        self.prefix_hits = 0

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
        req.seq = self._next_seq
        self._next_seq += 1
        self.waiting.append(req)
        self._by_id[req.request_id] = req
        self._by_seq[req.seq] = req

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def get_by_seq(self, seq: int) -> Request | None:
        return self._by_seq.get(seq)

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request for good (abort, error, or the stop `update` decided) and free what it holds."""
        if req.finished:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._release(req)
        else:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        del self._by_id[req.request_id]
        del self._by_seq[req.seq]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._uncomputed(req), budget)
            if n == 0:  # its last token is still to be sampled or it has all it may get: nothing to run
                i += 1
                continue
            drafts = self._num_drafts(req, n, budget)
            need = self._pages_needed(req, n, drafts)
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
            rows.append(self._row(req, n, drafts))
            budget -= n + drafts
            i += 1

        # No admissions while preempting: the pool is the bottleneck, admitting would thrash.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_placeholders:  # preempted with a token in flight: wait until it has landed
                break
            cached = self._take_cached_prefix(req)
            n = min(self._uncomputed(req), budget)
            need = self._pages_needed(req, n, 0)
            if need > self.allocator.num_free:
                self.allocator.free(req.pages)  # give the cached pages back: it waits for room
                req.pages, req.num_computed, req.num_named_pages = [], 0, 0
                break
            self.waiting.popleft()
            self.prefix_queries += req.num_known
            self.prefix_hits += cached
            req.pages += self.allocator.allocate(need)
            req.slot = self._free_slots.pop()
            req.status = Status.RUNNING
            if req.scheduled_time is None:  # its queue time ends here (a readmission after preemption keeps it)
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            rows.append(self._row(req, n))
            budget -= n
        return SchedulerOutput(rows, [r.request_id for r in preempted])

    def _take_cached_prefix(self, req: Request) -> int:
        """Start `req` after the longest cached prefix of its known tokens (at least one token is left to
        compute: its logits are needed). Returns the cached tokens."""
        if not (req.use_prefix_cache and self.allocator.enable_prefix_caching):
            return 0
        hashes = self._page_hashes(req, (req.num_known - 1) // self.config.page_size)
        req.pages = self.allocator.lookup(hashes)
        req.num_named_pages = len(req.pages)
        req.num_computed = len(req.pages) * self.config.page_size
        return req.num_computed

    def _page_hashes(self, req: Request, num_pages: int) -> list[bytes]:
        """The names of the request's first `num_pages` full pages (all of known tokens), computed once."""
        ps, done = self.config.page_size, len(req.page_hashes)
        if done < num_pages:
            # One array of the new pages' tokens, sliced per page: a 1k-token prompt's 64 pages are hashed on the
            # way to its first token, so no list slicing and conversion per page.
            tokens = np.asarray(req.token_ids(done * ps, num_pages * ps), np.int64)
            for i in range(num_pages - done):
                req.page_hashes.append(page_hash(req.page_hashes[-1] if req.page_hashes else None,
                                                 tokens[i * ps:(i + 1) * ps]))
        return req.page_hashes[:num_pages]

    def _name_pages(self, req: Request) -> None:
        """Name every full page whose tokens are all known and computed (or being computed by a dispatched step,
        which runs before any step that could read it from the cache)."""
        if not self.allocator.enable_prefix_caching:
            return
        full = min(req.num_computed, req.num_known) // self.config.page_size
        if full > req.num_named_pages:
            hashes = self._page_hashes(req, full)
            for i in range(req.num_named_pages, full):
                self.allocator.register(req.pages[i], hashes[i])
            req.num_named_pages = full

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (the device pool was rebuilt after a failed step)."""
        self.allocator.reset_prefix_cache()
        for req in self.running:
            req.num_named_pages = len(req.pages)  # their pages hold nothing any more; they are being failed

    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """Draft tokens a decoding row carries: the proposals it has, within its budget and its limits."""
        k = self.config.num_speculative_tokens
        if not k or not req.use_spec or n != 1 or req.num_computed + 1 != req.num_tokens or req.num_placeholders:
            return 0
        return max(0, min(k, len(req.draft_tokens), budget - 1, req.max_tokens - req.num_output - 1,
                          self.config.max_model_len - req.num_tokens - 1))

    def _pages_needed(self, req: Request, n: int, drafts: int) -> int:
        """New pages for a row of n tokens plus its drafts. A row that samples also holds the next step's chained
        draft passes, up to k positions further (speculation only)."""
        end = req.num_computed + n + drafts
        if self.config.num_speculative_tokens and end >= req.num_tokens:
            end += self.config.num_speculative_tokens
        return self.pages_for(min(end, self.config.max_model_len)) - len(req.pages)

    def _uncomputed(self, req: Request) -> int:
        """Tokens to run now: none when the request has sampled all it may (its finishing update is pending)."""
        if req.num_output >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return 0
        return req.num_tokens - req.num_computed

    def _row(self, req: Request, n: int, drafts: int = 0) -> ScheduledRow:
        start = req.num_computed
        sample = start + n == req.num_tokens
        row = ScheduledRow(req.seq, req.token_ids(start, start + n) + req.draft_tokens[:drafts], start,
                           list(req.pages), sample, req.slot, req.sampling, req.num_prompt, req.num_output, drafts,
                           -1 if sample else req.token_ids(start + n, start + n + 1)[0])
        req.num_drafts_in_flight = drafts
        req.num_computed += n + drafts
        if sample:
            req.num_placeholders += 1
        self._name_pages(req)
        return row

    def _release(self, req: Request) -> None:
        self.allocator.free(req.pages)
        req.pages = []
        self._free_slots.append(req.slot)
        req.slot = -1

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed = 0
        req.num_named_pages = 0
        req.draft_tokens = []  # its recompute proposes new ones
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, result: ModelRunnerOutput) -> list[tuple[Request, int]]:
        """Record a step's sampled tokens; returns the requests that got one (finished ones included, with
        `finish_reason` set) with their index in `result`. Requests finished meanwhile (aborted, or stopped by
        the step before) are skipped."""
        got: list[tuple[Request, int]] = []
        for i, seq in enumerate(result.seqs):
            req = self._by_seq.get(seq)
            if req is None:
                continue
            req.num_placeholders -= 1
            tokens = result.emitted(i)
            # Rejected drafts: their positions' K/V are rewritten before anything reads them.
            req.num_computed -= req.num_drafts_in_flight - (len(tokens) - 1)
            req.last_num_drafts, req.num_drafts_in_flight = req.num_drafts_in_flight, 0
            reason = None
            for tok in tokens:  # an accepted run: a stop inside it ends the request there
                reason = append_token(req, tok, self.config.max_model_len)
                if reason is not None:
                    break
            if result.drafts is not None and reason is None:
                req.draft_tokens = result.drafts[i].tolist()
            if req.status is Status.RUNNING:
                self._name_pages(req)
            if reason is not None:
                self.finish(req, reason)
            got.append((req, i))
        return got
