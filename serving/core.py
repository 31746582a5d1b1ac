"""The engine core: the scheduler and the model executor, stepped by exactly one thread.

    clients (LLM, AsyncEngine -> gRPC / HTTP servers)
        | prepare(): validate + tokenise, on the client's thread      ^ RequestOutput, through the request's sink
        v submit() / abort(): a thread-safe inbox                      |
    EngineCore thread: drain inbox -> Scheduler.schedule() -> ModelRunner.launch(step N)
                       -> ModelRunner.collect(step N-1) -> Scheduler.update() (stops) -> outputs to sinks

With async scheduling the core dispatches step N before it collects step N-1, so the host's work for one step
(scheduling, batch assembly, detokenisation, output) overlaps the device's work on the next; greedy and seeded
outputs are unchanged (serving/scheduler.py says how placeholders make that exact).

Nothing outside this module touches the scheduler, the executor or a request's state: clients hold a request
id and receive `RequestOutput`s; the servers read load figures through the read-only properties below.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from m3jax.api import M3Model, embedded_model_path, load_model
from m3jax.batch import KVPages
from m3jax.config import PRESETS
from m3jax.eagle import DraftPages
from m3jax.settings import Settings
from serving.executables import enable_xla_cache
from serving.kv_cache import PageAllocator
from serving.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind, SamplingParams
from serving.request import FinishReason, Request
from serving.runner import Draft, InFlight, ModelRunner, StepFailed
from serving.sampling import TokenConstraints, uses_penalty
from serving.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput
from serving.stopping import TextState
from serving.tokenizer import IncrementalDetokenizer, M3Tokenizer, StopChecker, TokenizerMissing

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
Sink = Callable[[RequestOutput], None]


def load(settings: Settings) -> tuple[M3Model, M3Tokenizer | None]:
    """The model (checkpoint directory, preset with random weights, or the embedded model) and its tokenizer."""
    dtype = settings.compute_dtype()
    kernels = settings.kernel_choice()
    if settings.model in PRESETS:
        from m3jax.params import init_params

        mcfg = PRESETS[settings.model]
        params = init_params(mcfg, seed=settings.seed, dtype=dtype)
        return M3Model.create(mcfg, params, dtype, settings.tensor_parallel_size, settings.expert_parallel,
                              moe_weight_format=settings.moe_weight_format, kernels=kernels), None
    path = Path(settings.model) if settings.model is not None else embedded_model_path()
    if not path.is_dir():
        raise FileNotFoundError(f"model {settings.model!r} is neither a checkpoint directory nor a preset "
                                f"({', '.join(PRESETS)})")
    model = load_model(path, dtype=dtype, tensor_parallel_size=settings.tensor_parallel_size,
                       expert_parallel=settings.expert_parallel, moe_weight_format=settings.moe_weight_format,
                       kernels=kernels)
    return model, load_tokenizer(settings)


def load_tokenizer(settings: Settings) -> M3Tokenizer | None:
    """The checkpoint's tokenizer (None for a preset, or a checkpoint without tokenizer.json)."""
    if settings.model in PRESETS:
        return None
    path = Path(settings.model) if settings.model is not None else embedded_model_path()
    try:
        return M3Tokenizer.from_dir(path)
    except TokenizerMissing:
        log.warning("%s has no tokenizer.json: only token-id prompts can be served", path)
        return None


def load_draft(settings: Settings, model: M3Model) -> Draft | None:
    """The EAGLE-3 draft of `--speculative-config` on the devices (replicated), checked against the target."""
    spec = settings.speculative()
    if spec is None:
        return None
    import jax
    import numpy as np

    from checkpoints.eagle import load_draft as load_draft_dir

    path = spec.draft_path(settings.model)
    cfg = model.cfg
    dcfg, host = load_draft_dir(path, dtype=np.dtype(model.dtype).name, target_num_layers=cfg.num_layers)
    problems = []
    if dcfg.vocab_size != cfg.vocab_size:
        problems.append(f"vocab_size {dcfg.vocab_size} != the target's {cfg.vocab_size}")
    if dcfg.target_hidden_size != cfg.hidden_size:
        problems.append(f"target_hidden_size {dcfg.target_hidden_size} != the target's hidden_size {cfg.hidden_size}")
    if max(dcfg.aux_layer_ids) >= cfg.num_layers:
        problems.append(f"aux layers {list(dcfg.aux_layer_ids)} are beyond the target's {cfg.num_layers} layers")
    if problems:
        raise ValueError(f"the draft in {path} does not fit this model: {'; '.join(problems)}")
    log.info("speculative decoding: EAGLE-3 draft from %s, %d tokens a step", path, spec.num_speculative_tokens)
    return Draft(dcfg, jax.device_put(host, model.rules.replicated()), spec.num_speculative_tokens)


def _device_description(num: int = 1) -> str:
    import jax

    d = jax.devices()[0]
    return f"{num} x {d.device_kind}" if d.platform != "cpu" else f"{num} x cpu"


def model_len(settings: Settings, limit: int) -> int:
    """The engine's model length: --max-model-len, or the model's limit capped at 4096; above the limit is an
    error, not a silent clamp."""
    if settings.max_model_len is not None and settings.max_model_len > limit:
        raise ValueError(f"--max-model-len {settings.max_model_len} is above this model's limit of {limit} "
                         "tokens (max_position_embeddings)")
    return settings.max_model_len or min(limit, 4096)


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What a client of the core needs to know about it, fixed once the engine is built. Plain values: they
    cross to a front end in another process (`serving.engine_process`)."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    num_speculative_tokens: int
    enable_prompt_logprobs: bool
    page_size: int
    num_pages: int
    num_executables: int
    warmup_seconds: float
    dtype: str
    device: str
    tensor_parallel_size: int


class OutputDelta(NamedTuple):
    """What one step added to a request's output: a compact client's sink gets these (cheap to send to another
    process) and keeps the cumulative state itself (`request_output` makes the RequestOutput)."""

    request_id: str  # the core's id ("<parent_id>#<index>" for a choice of n > 1)
    delta_token_ids: list[int]
    delta_text: str
    finish_reason: str | None
    stop_reason: str | int | None
    error: str | None
    rejected: bool
    metrics: dict[str, float]
    logprobs: list[Logprob] | None  # compact: the entries this step added
    prompt_logprobs: list[Logprob | None] | None  # compact: once, with the first token


def delta_output(delta: OutputDelta, parent_id: str | None, index: int, prompt: str | None,
                 prompt_ids: list[int]) -> RequestOutput:
    """The RequestOutput of a RequestOutputKind.DELTA request: the step's delta alone, no cumulative copy."""
    return request_output(delta, parent_id, index, prompt, prompt_ids, delta.delta_text, delta.delta_token_ids,
                          delta.logprobs, delta.prompt_logprobs)


def request_output(delta: OutputDelta, parent_id: str | None, index: int, prompt: str | None,
                   prompt_ids: list[int], text: str, token_ids: list[int], logprobs: list[Logprob] | None,
                   prompt_logprobs: list[Logprob | None] | None) -> RequestOutput:
    """The RequestOutput a client sees: the request's cumulative state (text, ids, logprobs) with a step's
    delta. The one place its shape is decided, for clients of the core in this process and in another."""
    return RequestOutput(
        request_id=parent_id or delta.request_id,
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        outputs=[CompletionOutput(index, text, token_ids, delta.finish_reason, logprobs, delta.stop_reason)],
        finished=delta.finish_reason is not None,
        delta_text=delta.delta_text,
        delta_token_ids=delta.delta_token_ids,
        error=delta.error,
        rejected=delta.rejected,
        metrics=delta.metrics,
        prompt_logprobs=prompt_logprobs,
    )


@dataclasses.dataclass
class Prepared:
    """A request checked and tokenised, not yet admitted: plain values, so that a front end in another process
    can prepare it and the core's process build its `Request`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    text: str | None
    parent_id: str | None = None  # n > 1: the client's id; request_id is then "<parent_id>#<index>"
    index: int = 0


def check_request(facts: EngineFacts, tokenizer: M3Tokenizer | None, rng: random.Random, prompt: Prompt,
                  params: SamplingParams | None = None, request_id: str | None = None) -> Prepared:
    """Validate and tokenise a request: ValueError names what is wrong."""
    params = dataclasses.replace(params) if params is not None else SamplingParams()
    params.validate()
    if params.seed is None:
        # Fixed at admission so that a preempted, recomputed request draws the same tokens again.
        params.seed = rng.getrandbits(63)
    text: str | None = None
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as token ids")
        text = prompt
        try:
            ids = tokenizer.encode(prompt)
        except (TypeError, UnicodeError) as e:  # e.g. an unpaired UTF-16 surrogate from a JSON client
            raise ValueError(f"the prompt is not valid text: {e}") from e
    else:
        ids = list(prompt)
        # The set of types first: a third of the per-id isinstance test's time on a long prompt of plain ints.
        if not set(map(type, ids)) <= {int} and not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("a token-id prompt must be a list of integers")
        bad = [t for t in ids if not 0 <= t < facts.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {facts.vocab_size})")
    if not ids:
        raise ValueError("the prompt is empty")
    max_len = facts.max_model_len
    if len(ids) >= max_len:
        raise ValueError(f"the prompt has {len(ids)} tokens; this server's model length is "
                         f"{max_len} (prompt plus at least one generated token)")
    if len(ids) + params.max_tokens > max_len:
        # Refused, not clamped: nothing a client asks for is silently changed (vLLM's servers answer 400).
        raise ValueError(f"max_tokens {params.max_tokens} is too large: the prompt has {len(ids)} tokens and "
                         f"the model length is {max_len} ({params.max_tokens} > {max_len} - {len(ids)})")
    if params.prompt_logprobs is not None:
        if not facts.enable_prompt_logprobs:
            raise ValueError("prompt_logprobs: this server computes prompt logprobs (which `echo` with "
                             "`logprobs` needs too) only when started with --enable-prompt-logprobs")
        if facts.num_speculative_tokens:
            raise ValueError("prompt_logprobs: not available with speculative decoding on this server")
    if params.logit_bias and max(params.logit_bias) >= facts.vocab_size:
        raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is outside the vocabulary "
                         f"[0, {facts.vocab_size})")
    return Prepared(request_id or uuid.uuid4().hex, ids, params, text)


def check_group(facts: EngineFacts, tokenizer: M3Tokenizer | None, rng: random.Random, prompt: Prompt,
                params: SamplingParams | None = None, request_id: str | None = None) -> list[Prepared]:
    """`check_request` for `params.n` independent samples of one prompt: n requests ("<id>#<index>" inside the
    core; their outputs carry the client's id and the choice index). The prompt is tokenised once; its pages
    are shared through the prefix cache. A seeded request's choice i draws with seed + i."""
    params = params if params is not None else SamplingParams()
    if params.n == 1:
        return [check_request(facts, tokenizer, rng, prompt, params, request_id)]
    rid = request_id or uuid.uuid4().hex
    base = dataclasses.replace(params, n=1)
    first = check_request(facts, tokenizer, rng, prompt, base, rid)
    group = []
    for i in range(params.n):
        child = dataclasses.replace(base, seed=None if params.seed is None else (params.seed + i) % 2**63)
        p = check_request(facts, tokenizer, rng, first.prompt_ids, child, f"{rid}#{i}")
        p.text, p.parent_id, p.index = first.text, rid, i
        group.append(p)
    return group


class GrammarCache:
    """Requests' compiled grammars (llguidance, against the checkpoint's tokenizer), made on first use; one per
    process that needs them (the core's, and a front end's in another process, which checks them)."""

    def __init__(self, tokenizer: M3Tokenizer | None, vocab_size: int, eos_token_ids: frozenset[int]):
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._lock = threading.Lock()
        self.grammars: Any = None  # serving.structured.Grammars

    def compile(self, params: SamplingParams) -> Any:
        """The request's compiled grammar (a copy from the cache when this grammar was compiled before), or
        None; ValueError for a grammar, schema or regex that is not valid."""
        if params.structured_outputs is None:
            return None
        if self._tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        with self._lock:
            if self.grammars is None:
                from serving.structured import Grammars

                self.grammars = Grammars(self._tokenizer.backend.to_str(), self._vocab_size, sorted(self._eos))
        return self.grammars.compile(params.structured_outputs)


@dataclasses.dataclass
class _Client:
    """What the core keeps for a request's outputs beyond the scheduler's state."""

    req: Request
    prompt: str | None
    sink: Sink | None
    sent_tokens: int = 0
    sent_chars: int = 0
    logprobs: list[Logprob] | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), filled as chunks complete.
    prompt_logprobs: list[Logprob | None] | None = None
    # The sink takes `OutputDelta`s (what a step added) instead of whole RequestOutputs: for a client that keeps
    # the rest itself (a front end in another process), so no step copies a request's whole output.
    compact: bool = False
    sent_logprobs: int = 0
    sent_prompt_logprobs: bool = False


class EngineCore:
    def __init__(self, settings: Settings, model: M3Model | None = None, tokenizer: M3Tokenizer | None = None):
        self.settings = settings
        settings.apply_memory_fraction()
        cache_dir = None
        if settings.enable_compilation_cache and settings.compilation_cache_dir:
            cache_dir = Path(settings.compilation_cache_dir).expanduser()
            enable_xla_cache(cache_dir / "xla")
        if model is None:
            model, tokenizer = load(settings)
        self.model, self.tokenizer = model, tokenizer
        mcfg = model.cfg
        self.max_model_len = model_len(settings, mcfg.max_position_embeddings)
        self.eos_token_ids = frozenset(mcfg.eos_token_ids) | frozenset(tokenizer.eos_token_ids if tokenizer else ())
        draft = load_draft(settings, model)
        num_pages = self._num_pages(draft)
        self.num_speculative_tokens = draft.k if draft is not None else 0
        self.scheduler = Scheduler(
            SchedulerConfig(settings.max_num_seqs, settings.max_num_batched_tokens, self.max_model_len,
                            model.page_size, self.num_speculative_tokens),
            PageAllocator(num_pages, settings.enable_prefix_caching))
        self.runner = ModelRunner(model, num_pages, settings.max_num_seqs, settings.max_num_batched_tokens,
                                  self.max_model_len, cache_dir, draft, settings.enable_prompt_logprobs)
        # A speculative step needs the previous step's tokens on the host (its rows carry them and the drafts that
        # follow them), so steps complete before the next one is scheduled.
        self.async_scheduling = settings.async_scheduling and draft is None
        self.warmup_seconds = self.runner.warmup(settings.show_progress()) if settings.warmup else 0.0
        self.stats: collections.Counter[str] = collections.Counter()
        self.last_step_seconds = 0.0
        # (launch time, rows, decode launches in a row) of the last decode-only step while the loop stays busy:
        # the period between two such launches is the engine's decode step as a user sees it (host work, dispatch
        # and device time together).
        self._last_decode: tuple[float, int, int] | None = None
        self._rng = random.Random(settings.seed)
        self._grammar_cache = GrammarCache(tokenizer, mcfg.vocab_size, self.eos_token_ids)
        self.facts = EngineFacts(
            self.max_model_len, mcfg.vocab_size, self.eos_token_ids, self.num_speculative_tokens,
            settings.enable_prompt_logprobs, model.page_size, self.num_pages, self.num_executables,
            self.warmup_seconds, settings.compute_dtype(), _device_description(settings.tensor_parallel_size),
            settings.tensor_parallel_size)
        # Called by the step thread after each step (a front end in another process sends the step's outputs).
        self.after_step: Callable[[], None] | None = None
        self._clients: dict[int, _Client] = {}  # by Request.seq
        self._by_id: dict[str, int] = {}  # request id -> seq, for aborts
        self._by_parent: dict[str, set[int]] = {}  # a client's id -> the seqs of its n > 1 choices
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._inflight: InFlight | None = None
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._owner: int | None = None  # the one thread allowed to step

    def _num_pages(self, draft: Draft | None) -> int:
        s = self.settings
        if s.kv_cache_pages is not None:
            return s.kv_cache_pages
        if s.kv_cache_memory_gb is not None:
            per_page = KVPages.bytes_per_page(self.model.cfg, self.model.dtype)
            if draft is not None:  # the draft's pages go with the target's, one for one
                per_page += DraftPages.bytes_per_page(draft.dcfg, self.model.page_size, self.model.dtype)
            return max(2, int(s.kv_cache_memory_gb * 2**30 // per_page))
        return 1 + s.max_num_seqs * -(-self.max_model_len // self.model.page_size)

    # ---- requests in (any thread) --------------------------------------------------------------------------
    def prepare(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
                ) -> tuple[Request, str | None]:
        """Validate and tokenise a request on the caller's thread: (Request, prompt text). ValueError names what
        is wrong."""
        p = check_request(self.facts, self.tokenizer, self._rng, prompt, params, request_id)
        return self.build(p), p.text

    def prepare_group(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
                      ) -> list[tuple[Request, str | None]]:
        """`prepare` for `params.n` independent samples of one prompt (`check_group`)."""
        return [(self.build(p), p.text)
                for p in check_group(self.facts, self.tokenizer, self._rng, prompt, params, request_id)]

    def build(self, p: Prepared) -> Request:
        """The core's state of a checked request: its detokeniser, stop checker and grammar."""
        params, ids = p.params, p.prompt_ids
        detok = (IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
                 if self.tokenizer is not None else None)
        req = Request(
            request_id=p.request_id,
            prompt_ids=ids,
            max_tokens=params.max_tokens,
            stop_token_ids=frozenset(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos,
            eos_token_ids=self.eos_token_ids,
            sampling=params,
            text=TextState(detok, StopChecker(params.stops)),
            grammar=self.compile_grammar(params),
            # The penalty history is recorded on the device from the tokens a step feeds: a request that skipped
            # its cached prefix would miss them.
            # Prompt logprobs need every prompt token computed.
            use_prefix_cache=not uses_penalty(params) and params.prompt_logprobs is None,
            # Penalties and grammars depend on every token before: drafts would need both to follow each draft
            # position, so these requests decode one token a step.
            use_spec=not uses_penalty(params) and params.structured_outputs is None,
        )
        req.parent_id, req.index = p.parent_id, p.index
        return req

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The request's compiled grammar, or None (`GrammarCache.compile`)."""
        return self._grammar_cache.compile(params)

    def submit(self, req: Request, prompt_text: str | None = None, sink: Sink | None = None,
               compact: bool = False) -> str:
        """Queue a prepared request (thread-safe); it joins at the next step. Its outputs go to `sink`, called
        on the core's thread: RequestOutputs, or with `compact` the `OutputDelta`s of each step."""
        self._inbox.append(("add", _Client(req, prompt_text, sink, compact=compact)))
        self._wake.set()
        return req.request_id

    def abort_all(self) -> None:
        """Abort every request admitted or queued (thread-safe)."""
        for rid in list(self._by_id):
            self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe): its pages are freed at the next step."""
        self._inbox.append(("abort", request_id))
        self._wake.set()

    # ---- the loop -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the step loop on a background thread (idempotent): from then on only that thread steps."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="m3jax-engine-core", daemon=True)
        self._owner = None
        self._thread.start()

    def _loop(self) -> None:
        self._owner = threading.get_ident()
        while not self._stop:
            if not self.has_work():
                self._last_decode = None  # an idle gap is no step
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the loop must survive anything a step throws
                log.exception("engine loop error")
            if self.after_step is not None:
                self.after_step()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let in-flight requests finish (up to `timeout` seconds), abort the rest, stop the loop."""
        deadline = time.monotonic() + timeout
        while self.has_work() and time.monotonic() < deadline and self._thread is not None:
            time.sleep(0.01)
        self.abort_all()
        while self.has_work() and time.monotonic() < deadline + 5 and self._thread is not None:
            time.sleep(0.01)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """One turn of the loop: admit and abort, schedule and dispatch a step, then collect the previous one
        (at once, without async scheduling). Returns the outputs it produced (also sent to the sinks)."""
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise RuntimeError("EngineCore.step called from a second thread: one thread steps the core")
        outputs: list[RequestOutput] = []
        self._drain(outputs)
        scheduled = self.scheduler.schedule()
        self.stats["preemptions"] += len(scheduled.preempted)
        launched = self._launch(scheduled, outputs) if scheduled.rows else None
        if self._inflight is not None:
            self._complete(self._inflight, outputs)
        if launched is not None and not launched.dispatched:
            # Grammar rows: their masks need the tokens just collected; the device runs the forward meanwhile.
            self._sample_constrained(launched, outputs)
            launched = launched if launched.dispatched else None
        self._inflight = launched
        if launched is not None and not self.async_scheduling:
            self._inflight = None
            self._complete(launched, outputs)
        return outputs

    def _sampled_requests(self, scheduled: SchedulerOutput) -> list[Request | None]:
        """The request of each sampled row (None: finished meanwhile; its token will be dropped)."""
        clients = [self._clients.get(r.seq) for r in scheduled.rows if r.sample]
        return [c.req if c is not None else None for c in clients]

    def _constraints(self, step_rows: list[Request | None], num_rows: int) -> TokenConstraints | None:
        """Logit biases and grammar masks of a step's sampled rows (None when no row has either)."""
        biases = [r.sampling.logit_bias if r is not None else None for r in step_rows]
        grammars = [(r.grammar, i) for i, r in enumerate(step_rows) if r is not None and r.grammar is not None]
        if not grammars and not any(biases):
            return None
        c = TokenConstraints.build(biases, num_rows, self.model.cfg.vocab_size)
        if grammars:
            self._grammar_cache.grammars.fill_rows(grammars, c.allowed)
        return c

    def _sample_constrained(self, step: InFlight, outputs: list[RequestOutput]) -> None:
        t0 = time.perf_counter()
        constraints = self._constraints(self._sampled_requests(step.scheduled), step.num_rows)
        self.stats["grammar_mask_us"] += int((time.perf_counter() - t0) * 1e6)
        try:
            self.runner.sample(step, constraints)
        except StepFailed as e:
            self._fail_all(e, outputs)
            step.out = None

    def _spec_constraints(self, scheduled: SchedulerOutput) -> TokenConstraints | None:
        """A speculative step's constraints over its [rows, 1 + k] grid of logit rows. Steps complete before the
        next is scheduled, so grammar masks are built at once (grammar rows carry no drafts: only column 0)."""
        width = self.runner.logits_per_row
        num_rows = self.runner.rows_for(self.runner.bucket(scheduled.num_tokens))
        grid: list[Request | None] = [None] * (num_rows * width)
        for i, row in enumerate(scheduled.rows):
            client = self._clients.get(row.seq) if row.sample else None
            if client is not None:
                for j in range(1 if client.req.grammar is not None else 1 + row.num_drafts):
                    grid[i * width + j] = client.req
        return self._constraints(grid, num_rows * width)

    def _launch(self, scheduled: SchedulerOutput, outputs: list[RequestOutput]) -> InFlight | None:
        t0 = time.perf_counter()
        reqs = self._sampled_requests(scheduled)
        defer = self.num_speculative_tokens == 0 and any(r is not None and r.grammar is not None for r in reqs)
        if self.num_speculative_tokens:
            constraints = self._spec_constraints(scheduled)
        elif defer:
            constraints = None
        else:
            constraints = self._constraints(reqs, self.runner.rows_for(self.runner.bucket(scheduled.num_tokens)))
        try:
            step = self.runner.launch(scheduled, constraints, defer_sampling=defer)
        except StepFailed as e:
            self._fail_all(e, outputs)
            return None
        self.stats["steps"] += 1
        self.stats["step_tokens"] += scheduled.num_tokens
        now = time.perf_counter()
        self.last_step_seconds = now - t0
        self._count_decode_period(scheduled, now)
        return step

    def _count_decode_period(self, scheduled: SchedulerOutput, now: float) -> None:
        """Decode-only steps (one token per row) launched back to back: stats `decode_steps`, `decode_step_us`
        (their summed periods) and `decode_step_rows`, from which the servers report the mean decode step.
        A period counts once the two launches before this one were decode steps: with async scheduling a launch
        waits for the step before the previous one, which must not be a prefill."""
        decode = scheduled.num_tokens == len(scheduled.rows)
        run = 0
        if decode and self._last_decode is not None:
            since, rows, run = self._last_decode
            if run >= 2 or not self.async_scheduling:
                self.stats["decode_steps"] += 1
                self.stats["decode_step_us"] += int((now - since) * 1e6)
                self.stats["decode_step_rows"] += rows
        self._last_decode = (now, len(scheduled.rows), run + 1) if decode else None

    def _complete(self, step: InFlight, outputs: list[RequestOutput]) -> None:
        t0 = time.perf_counter()
        try:
            result = self.runner.collect(step)
        except StepFailed as e:
            self._fail_all(e, outputs)
            return
        finally:
            # Blocked on the device's tokens: the rest of a step's period is host work (a host-bound engine
            # hardly waits at all).
            self.stats["device_wait_us"] += int((time.perf_counter() - t0) * 1e6)
        if result.prompt_logprobs:
            self._fill_prompt_logprobs(result.prompt_logprobs)
        now = time.monotonic()
        for req, i in self.scheduler.update(result):
            client = self._clients.get(req.seq)
            if client is None:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            if result.num_emitted is not None:
                self._count_spec(req, result, i)
            if client.logprobs is not None and result.logprobs is not None:
                self._append_logprobs(client, result, i)
            self._emit(client, outputs, req.finish_reason)

    def _append_logprobs(self, client: _Client, result: ModelRunnerOutput, i: int) -> None:
        """The logprobs of the tokens sampled row i added to its request (one, or a speculative row's run)."""
        n = client.req.sampling.logprobs
        new = len(client.req.output_ids) - len(client.logprobs)  # tokens kept (a stop may cut a run short)
        spec = result.num_emitted is not None
        for j in range(new):
            at = (i, j) if spec else (i,)
            top = {int(t): float(lp) for t, lp in zip(result.top_ids[at][:n], result.top_logprobs[at][:n],
                                                       strict=True)}
            token = result.token_ids[at]
            client.logprobs.append(Logprob(int(token), float(result.logprobs[at]), top))

    def _fill_prompt_logprobs(self, computed: dict[int, tuple]) -> None:
        """Each request's prompt logprobs for the positions a step computed (a recompute after preemption writes
        the same values again)."""
        for seq, (start, lps, ranks, top_ids, top_lps) in computed.items():
            client = self._clients.get(seq)
            if client is None or client.prompt_logprobs is None:
                continue
            n = client.req.sampling.prompt_logprobs
            prompt = client.req.prompt_ids
            for j in range(len(lps)):
                p = start + j + 1  # the prompt token this is the logprob of
                top = {int(t): float(lp) for t, lp in zip(top_ids[j][:n], top_lps[j][:n], strict=True)}
                client.prompt_logprobs[p] = Logprob(prompt[p], float(lps[j]), top, int(ranks[j]))

    def _count_spec(self, req: Request, result: ModelRunnerOutput, i: int) -> None:
        """Speculation counters (vLLM's names): drafts verified, draft tokens, accepted ones, and accepted by
        draft position."""
        drafts = int(req.last_num_drafts)
        if not drafts:
            return
        accepted = int(result.num_emitted[i]) - 1
        self.stats["spec_num_drafts"] += 1
        self.stats["spec_num_draft_tokens"] += drafts
        self.stats["spec_num_accepted_tokens"] += accepted
        for pos in range(accepted):
            self.stats[f"spec_accepted_at_{pos}"] += 1

    def _fail_all(self, error: Exception, outputs: list[RequestOutput]) -> None:
        """A failed step lost the KV of every request with pages (and tokens in flight): fail them, keep
        serving the rest."""
        log.error("%s", error)
        self._inflight = None
        self.scheduler.reset_prefix_cache()
        for client in list(self._clients.values()):
            req = client.req
            if req.pages or req.num_placeholders:
                self.scheduler.finish(req, FinishReason.ERROR, str(error))
                self._emit(client, outputs, FinishReason.ERROR, error=str(error))

    def _drain(self, outputs: list[RequestOutput]) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                client: _Client = item
                try:
                    self.scheduler.add(client.req)
                except ValueError as e:
                    self._emit(client, outputs, FinishReason.ERROR, error=str(e), rejected=True)
                    continue
                if client.req.sampling.logprobs is not None:
                    client.logprobs = []
                if client.req.sampling.prompt_logprobs is not None:
                    client.prompt_logprobs = [None] * len(client.req.prompt_ids)
                self._clients[client.req.seq] = client
                self._by_id[client.req.request_id] = client.req.seq
                if client.req.parent_id is not None:
                    self._by_parent.setdefault(client.req.parent_id, set()).add(client.req.seq)
                self.stats["requests"] += 1
            elif kind == "abort":
                seqs = self._by_parent.get(item, {self._by_id[item]} if item in self._by_id else set())
                for seq in sorted(seqs):
                    client = self._clients.get(seq)
                    if client is not None:
                        self.scheduler.finish(client.req, FinishReason.ABORT)
                        self._emit(client, outputs, FinishReason.ABORT)

    def _emit(self, client: _Client, outputs: list[RequestOutput], reason: FinishReason | None,
              error: str | None = None, rejected: bool = False) -> None:
        req = client.req
        finished = reason is not None
        ids = req.output_ids
        delta_ids = ids[client.sent_tokens:]
        client.sent_tokens = len(ids)
        metrics: dict[str, float] = {"arrival": req.arrival}
        if req.scheduled_time is not None:
            metrics["scheduled"] = req.scheduled_time
        if req.first_token_time is not None:
            metrics["first_token"] = req.first_token_time
        if finished:
            metrics["finished"] = time.monotonic()
            if self._clients.get(req.seq) is client:
                del self._clients[req.seq]
                if self._by_id.get(req.request_id) == req.seq:
                    del self._by_id[req.request_id]
                siblings = self._by_parent.get(req.parent_id or "")
                if siblings is not None:
                    siblings.discard(req.seq)
                    if not siblings:
                        del self._by_parent[req.parent_id]
            self.stats[f"finished_{reason.value}"] += 1
        # The text only grows; a speculative step may add several tokens' worth. `since` reads the new tail
        # without copying the rest.
        delta_text = req.text.since(client.sent_chars) if req.text is not None else ""
        client.sent_chars += len(delta_text)
        # Once the prompt is computed (its first token's output on); the list is only rewritten in place.
        prompt_logprobs = client.prompt_logprobs if req.first_token_time is not None else None
        delta = OutputDelta(req.request_id, delta_ids, delta_text, reason.value if reason else None,
                            req.stop_reason if reason is FinishReason.STOP else None, error, rejected, metrics,
                            None, None)
        kind = req.sampling.output_kind
        if client.compact or kind is RequestOutputKind.DELTA:
            if client.logprobs is not None:
                delta = delta._replace(logprobs=client.logprobs[client.sent_logprobs:])
                client.sent_logprobs = len(client.logprobs)
            if prompt_logprobs is not None and not client.sent_prompt_logprobs:
                delta = delta._replace(prompt_logprobs=prompt_logprobs)
                client.sent_prompt_logprobs = True
        if client.compact:
            if client.sink is not None:
                client.sink(delta)
            return
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return
        if kind is not RequestOutputKind.DELTA:
            text = req.text.text if req.text is not None else ""
            out = request_output(delta, req.parent_id, req.index, client.prompt, req.prompt_ids, text, list(ids),
                                 list(client.logprobs) if client.logprobs is not None else None, prompt_logprobs)
        else:
            out = delta_output(delta, req.parent_id, req.index, client.prompt, req.prompt_ids)
        outputs.append(out)
        if client.sink is not None:
            client.sink(out)

    # ---- read-only load figures (metrics, model info; any thread) ---------------------------------------------
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

    @property
    def prefix_cache_queries(self) -> int:
        return self.scheduler.prefix_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.scheduler.prefix_hits

    @property
    def num_executables(self) -> int:
        return self.runner.num_executables
