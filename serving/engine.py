"""The engine: request admission and validation, the step loop, output processing (detokenisation, stop
strings, logprobs), and the asyncio interface the servers use.

Threading model: only the thread that calls `Engine.step()` mutates scheduler state. Other threads hand
new requests and aborts over through a thread-safe inbox that `step()` drains first, so an abort never
races a running step, and a request aborted mid-step simply has its result dropped.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from m3jax.api import M3Model, embedded_model_path, load_model
from m3jax.batch import KVPages
from m3jax.config import PRESETS
from serving.kv_cache import PageAllocator
from serving.outputs import CompletionOutput, Logprob, RequestOutput, SamplingParams
from serving.request import FinishReason, Request
from serving.runner import ModelRunner, enable_compilation_cache
from serving.scheduler import Scheduler, SchedulerConfig
from serving.tokenizer import IncrementalDetokenizer, M3Tokenizer, StopChecker, TokenizerMissing

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # checkpoint directory, preset name (random weights), or None = embedded model
    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # default: min(checkpoint's max_position_embeddings, 4096)
    kv_cache_pages: int | None = None  # default: every sequence at full length, or kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    compilation_cache_dir: str | None = None
    warmup: bool = True
    progress: bool = True
    seed: int = 0


@dataclasses.dataclass
class _Tracked:
    """Engine-side state of one request beyond what the scheduler sees."""

    req: Request
    prompt: str | None
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    stops: StopChecker
    sink: Callable[[RequestOutput], None] | None
    text: str = ""
    sent_tokens: int = 0
    logprobs: list[Logprob] = dataclasses.field(default_factory=list)
    stop_reason: str | int | None = None


def _load(cfg: EngineConfig) -> tuple[M3Model, M3Tokenizer | None]:
    if cfg.model in PRESETS:
        from m3jax.params import init_params

        mcfg = PRESETS[cfg.model]
        params = init_params(mcfg, seed=cfg.seed, dtype=cfg.dtype)
        return M3Model.create(mcfg, params, cfg.dtype, cfg.tensor_parallel_size), None
    path = Path(cfg.model) if cfg.model is not None else embedded_model_path()
    if not path.is_dir():
        raise FileNotFoundError(f"model {cfg.model!r} is neither a checkpoint directory nor a preset "
                                f"({', '.join(PRESETS)})")
    model = load_model(path, dtype=cfg.dtype, tensor_parallel_size=cfg.tensor_parallel_size)
    try:
        tokenizer = M3Tokenizer.from_dir(path)
    except TokenizerMissing:
        log.warning("%s has no tokenizer.json: only token-id prompts can be served", path)
        tokenizer = None
    return model, tokenizer


class Engine:
    def __init__(self, config: EngineConfig, model: M3Model | None = None, tokenizer: M3Tokenizer | None = None):
        self.config = config
        if config.compilation_cache_dir is not None or config.warmup:
            self.compilation_cache = enable_compilation_cache(config.compilation_cache_dir)
        if model is None:
            model, tokenizer = _load(config)
        self.model, self.tokenizer = model, tokenizer
        mcfg = model.cfg
        self.max_model_len = min(config.max_model_len or min(mcfg.max_position_embeddings, 4096),
                                 mcfg.max_position_embeddings)
        self.eos_token_ids = frozenset(mcfg.eos_token_ids) | frozenset(tokenizer.eos_token_ids if tokenizer else ())
        num_pages = self._num_pages(config)
        max_tokens = max(config.max_num_batched_tokens, 1)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, max_tokens, self.max_model_len, model.page_size),
            PageAllocator(num_pages))
        self.runner = ModelRunner(model, num_pages, config.max_num_seqs, max_tokens, self.max_model_len)
        self.warmup_seconds = self.runner.warmup(config.progress) if config.warmup else 0.0
        self._tracked: dict[str, _Tracked] = {}
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._rng = random.Random(config.seed)
        self.stats = collections.Counter()

    def _num_pages(self, config: EngineConfig) -> int:
        if config.kv_cache_pages is not None:
            return config.kv_cache_pages
        if config.kv_cache_memory_gb is not None:
            per_page = KVPages.bytes_per_page(self.model.cfg, self.model.dtype)
            return max(2, int(config.kv_cache_memory_gb * 2**30 // per_page))
        return 1 + config.max_num_seqs * -(-self.max_model_len // self.model.page_size)

    # ---- requests in ---------------------------------------------------------------------------------------
    def prepare(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                sink: Callable[[RequestOutput], None] | None = None) -> _Tracked:
        """Validate and tokenise a request (any thread; raises ValueError with a clear message)."""
        params = dataclasses.replace(params) if params is not None else SamplingParams()
        params.validate()
        if params.seed is None:
            # Fixed at admission so that a preempted, recomputed request draws the same tokens again.
            params.seed = self._rng.getrandbits(63)
        text: str | None = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: send the prompt as token ids")
            text = prompt
            try:
                ids = self.tokenizer.encode(prompt)
            except (TypeError, UnicodeError) as e:  # e.g. an unpaired UTF-16 surrogate from a JSON client
                raise ValueError(f"the prompt is not valid text: {e}") from e
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("a token-id prompt must be a list of integers")
            bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.model.cfg.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this server's model length is "
                             f"{self.max_model_len} (prompt plus at least one generated token)")
        req = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_ids=ids,
            max_tokens=min(params.max_tokens, self.max_model_len - len(ids)),
            stop_token_ids=frozenset(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos,
            eos_token_ids=self.eos_token_ids,
            sampling=params,
        )
        detok = (IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
                 if self.tokenizer is not None else None)
        return _Tracked(req, text, params, detok, StopChecker(params.stops), sink)

    def submit(self, tracked: _Tracked) -> str:
        """Queue a prepared request (thread-safe); it joins at the next step."""
        self._inbox.append(("add", tracked))
        return tracked.req.request_id

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    sink: Callable[[RequestOutput], None] | None = None) -> str:
        return self.submit(self.prepare(prompt, params, request_id, sink))

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe): its pages are freed at the next step."""
        self._inbox.append(("abort", request_id))

    # ---- the step --------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Drain the inbox, run one scheduled step, and return the updates it produced."""
        outputs: list[RequestOutput] = []
        self._drain(outputs)
        plan = self.scheduler.schedule()
        if not plan.rows:
            return outputs
        t0 = time.perf_counter()
        try:
            sampled = self.runner.execute(plan)
        except Exception as e:  # noqa: BLE001 - a failed step must not lose requests: fail them, keep serving
            log.exception("step failed")
            self.runner.kv = self.model.new_pages(self.runner.kv.num_pages)  # the donated pool is gone
            for row in plan.rows:
                self._finish(row.request.request_id, FinishReason.ERROR, outputs, f"step failed: {e}")
            for req in list(self.scheduler.running):
                self._finish(req.request_id, FinishReason.ERROR, outputs, f"step failed: {e}")
            return outputs
        self.stats["steps"] += 1
        self.stats["step_tokens"] += plan.num_tokens
        self.stats["preemptions"] += len(plan.preempted)
        self.last_step_seconds = time.perf_counter() - t0
        finished = {r.request_id for r in self.scheduler.update(plan, {k: v.token_id for k, v in sampled.items()})}
        now = time.monotonic()
        for row in plan.rows:
            rid = row.request.request_id
            tr = self._tracked.get(rid)
            if tr is None or rid not in sampled:
                continue
            if tr.req.first_token_time is None:
                tr.req.first_token_time = now
            self._process_token(tr, sampled[rid], rid in finished, outputs)
        return outputs

    def _drain(self, outputs: list[RequestOutput]) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                tr: _Tracked = item
                try:
                    self.scheduler.add(tr.req)
                except ValueError as e:
                    self._emit(tr, outputs, FinishReason.ERROR, error=str(e), rejected=True)
                    continue
                self._tracked[tr.req.request_id] = tr
                self.stats["requests"] += 1
            elif kind == "abort":
                self._finish(item, FinishReason.ABORT, outputs)

    def _finish(self, request_id: str, reason: FinishReason, outputs: list[RequestOutput],
                error: str | None = None) -> None:
        tr = self._tracked.get(request_id)
        if tr is None:
            return
        self.scheduler.finish(tr.req, reason, error)
        self._emit(tr, outputs, reason, error=error)

    def _process_token(self, tr: _Tracked, tok: Any, finished: bool, outputs: list[RequestOutput]) -> None:
        req = tr.req
        if tr.params.logprobs is not None:
            tr.logprobs.append(Logprob(tok.token_id, tok.logprob, tok.top))
        new_text = ""
        if tr.detok is not None:
            piece = tr.detok.push(tok.token_id)
            if finished:
                piece += tr.detok.flush()
            new_text, stopped = tr.stops.push(piece)
            if stopped:
                tr.stop_reason = tr.stops.stop_str
                if not finished:
                    self.scheduler.finish(req, FinishReason.STOP)
                    finished = True
                req.finish_reason = FinishReason.STOP
            elif finished:
                new_text += tr.stops.flush()
        if finished and tr.stop_reason is None and req.finish_reason is FinishReason.STOP:
            last = req.output_ids[-1]
            tr.stop_reason = last if last in req.stop_token_ids else None
        tr.text += new_text
        self._emit(tr, outputs, req.finish_reason if finished else None, delta_text=new_text)

    def _emit(self, tr: _Tracked, outputs: list[RequestOutput], reason: FinishReason | None,
              delta_text: str = "", error: str | None = None, rejected: bool = False) -> None:
        req = tr.req
        finished = reason is not None
        ids = list(req.output_ids)
        delta_ids = ids[tr.sent_tokens:]
        tr.sent_tokens = len(ids)
        metrics: dict[str, float] = {"arrival": req.arrival}
        if req.first_token_time is not None:
            metrics["first_token"] = req.first_token_time
        if finished:
            metrics["finished"] = time.monotonic()
            if self._tracked.get(req.request_id) is tr:  # a rejected duplicate id must not drop the original
                del self._tracked[req.request_id]
            self.stats[f"finished_{reason.value}"] += 1
        out = RequestOutput(
            request_id=req.request_id,
            prompt=tr.prompt,
            prompt_token_ids=req.prompt_ids,
            outputs=[CompletionOutput(0, tr.text, ids, reason.value if reason else None,
                                      list(tr.logprobs) if tr.params.logprobs is not None else None,
                                      tr.stop_reason)],
            finished=finished,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            error=error,
            rejected=rejected,
            metrics=metrics,
        )
        outputs.append(out)
        if tr.sink is not None:
            tr.sink(out)

    # ---- introspection (metrics, tests) ---------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def pages_in_use(self) -> int:
        return self.scheduler.allocator.num_used

    @property
    def num_pages(self) -> int:
        return self.scheduler.allocator.num_usable


class AsyncEngine:
    """asyncio front of an Engine: a background thread runs the step loop; `generate` streams outputs."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="m3jax-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception:  # noqa: BLE001 - the loop must survive anything a step throws
                log.exception("engine loop error")

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs of one request. Raises ValueError at once for a bad request. Cancelling the
        iteration (a client that went away) aborts the request and frees its pages."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        tracked = self.engine.prepare(prompt, params, request_id,
                                      sink=lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
        rid = self.engine.submit(tracked)
        self._wake.set()
        finished = False
        try:
            while True:
                out = await queue.get()
                if out.error is not None:
                    finished = True  # an errored request is already finished: nothing to abort
                    # A rejected request is the client's fault; a failed step is the server's.
                    raise (ValueError if out.rejected else RuntimeError)(out.error)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish in-flight requests (up to `timeout` seconds), abort the rest, stop the loop."""
        deadline = time.monotonic() + timeout
        while self.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        for rid in list(self.engine._tracked):
            self.engine.abort(rid)
        self._wake.set()
        while self.engine.has_work() and time.monotonic() < deadline + 5:
            time.sleep(0.01)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
