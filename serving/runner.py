"""The model executor: the only code that builds device arrays and calls the compiled step.

A `SchedulerOutput` becomes a padded `Batch`, which travels with the step's other host arrays as one packed int32
array (`HostPack`: one host-to-device copy); sampling parameters become `SamplingTensors`. A step is one or two
compiled calls: the forward (page pool and penalty history donated) returns logits and their greedy tokens; a
step whose rows are all plainly greedy stops there, any other runs a sampling executable (biases, a grammar's
allowed tokens, penalties, filters, the draw) on the logits. Only token ids (and logprobs when asked) come back to
the host, as a `ModelRunnerOutput`. The greedy tokens ride on the forward because every dispatch costs the host
time (about a millisecond for a forward on the H100), and at small batches the host sets a step's pace.

Sampling as a call of its own so that a grammar's token mask, which needs the previous step's token on the host,
is computed while the device runs the forward: `launch` dispatches the forward and, unless told to wait for
constraints, the sampling; `sample` dispatches a deferred sampling; `collect` waits for the tokens.

Shapes: one forward executable per token bucket and three sampling executables per row count (the general one, and
two without a conditional for steps with no penalty, bias or grammar: drawing, filtering; chosen on the host by
`sampling.variant`, whose third plain variant, all greedy, is the forward's own output); with speculation, one
speculative executable per token bucket and sampling variant instead (`SPEC_VARIANTS`). The token count of a
step is padded to the next bucket (powers of two from 8 up to `max_num_batched_tokens`) and its rows to
min(bucket, max_num_seqs), the most rows that many tokens can hold, so the row count never multiplies the
executables. The page table is always `max_model_len / page_size` wide (attention shapes never depend on the
rest of the batch), and the penalty history, logit biases and grammar masks have fixed shapes, so nothing a
request asks for makes a new shape: after `warmup` the engine never compiles.

Async hand-off: a token the previous step samples is a placeholder in the next step's rows; the forward reads it
from that step's device output (`prev_tokens`), so step N+1 is dispatched before step N's tokens reach the host.
That overlap needs dispatch itself not to wait for the device, and on the GPU a `lax.cond` does (XLA reads its
predicate back on the host): the decode forward and the plain samplings hold none (tests/test_step_lowering.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.api import M3Model
from m3jax.batch import Batch, KVPages, RowPlan, build_batch
from m3jax.eagle import DraftConfig, DraftPages
from m3jax.model import forward
from pallas_kernels.choice import KernelChoice
from serving.executables import ExecutableCache, xla_cache_hits
from serving.outputs import MAX_LOGPROBS
from serving.request import PLACEHOLDER
from serving.sampling import (
    GREEDY_VARIANT,
    PLAIN_VARIANTS,
    VARIANTS,
    HistoryRows,
    PenaltyHistory,
    PromptLogprobs,
    SampleOutput,
    SamplingTensors,
    TokenConstraints,
    plainly_greedy,
    prompt_logprobs,
    record_history,
    sample_as,
    uses_penalty,
    variant,
)
from serving.scheduler import ModelRunnerOutput, SchedulerOutput
from serving.speculative import SpecOutput, spec_step

log = logging.getLogger(__name__)

# The speculative executables of a token bucket, one per sampling variant (`sampling.variant`): "spec" (the general
# sampling), "spec_greedy", "spec_draw", "spec_filter".
SPEC_OF = {how: "spec" + how.removeprefix("sample") for how in VARIANTS}
SPEC_VARIANTS = tuple(SPEC_OF.values())


class _Greedy:
    """The sampling parameters of a padding row: greedy, everything off."""

    temperature, top_k, top_p, min_p = 0.0, 0, 1.0, 0.0
    repetition_penalty, presence_penalty, frequency_penalty, seed = 1.0, 0.0, 0.0, 0


_GREEDY = _Greedy()


def token_buckets(max_num_batched_tokens: int, smallest: int = 8) -> list[int]:
    """smallest, 2 * smallest, ... and max_num_batched_tokens itself: the token counts a step is padded to."""
    out, b = [], min(smallest, max_num_batched_tokens)
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 2
    return [*out, max_num_batched_tokens]


class StepFailed(RuntimeError):
    """A step raised on the device or at dispatch. The executor has already rebuilt its state (a donated pool is
    gone); every request with pages must be failed, since its KV is lost."""


class HostPack:
    """A forward's host arrays (its Batch, prev_index, HistoryRows and, for prompt logprobs, the targets) as one
    int32 array: one host-to-device copy a step instead of twelve, which on the H100 halves the host time the
    copies take (docs/benchmarks.md, "The engine's prefill, kernel by kernel"). The layout is fixed per
    executable (its token bucket), so it is closed over by its function."""

    def __init__(self, example: Any):
        leaves, self.treedef = jax.tree.flatten(example)
        self.specs = tuple((tuple(np.shape(x)), np.dtype(x.dtype)) for x in leaves)
        for _, dtype in self.specs:
            if dtype not in (np.dtype(np.int32), np.dtype(np.bool_)):
                raise TypeError(f"host array of dtype {dtype}: only int32 and bool arrays are packed")
        self.size = sum(int(np.prod(shape)) for shape, _ in self.specs)

    def pack(self, tree: Any) -> np.ndarray:
        out = np.empty(self.size, np.int32)
        at = 0
        for x, (shape, _) in zip(jax.tree.leaves(tree), self.specs, strict=True):
            n = int(np.prod(shape))
            if np.shape(x) != shape:
                raise ValueError(f"host array of shape {np.shape(x)} where the executable takes {shape}")
            out[at:at + n] = np.ravel(x)
            at += n
        return out

    def unpack(self, flat: jax.Array) -> Any:
        """Inside the executable: the arrays back, with their shapes and dtypes."""
        leaves, at = [], 0
        for shape, dtype in self.specs:
            n = int(np.prod(shape))
            x = flat[at:at + n].reshape(shape)
            leaves.append(x != 0 if dtype == np.bool_ else x.astype(dtype))
            at += n
        return jax.tree.unflatten(self.treedef, leaves)


@dataclasses.dataclass
class InFlight:
    """A dispatched step: device arrays until `collect`."""

    scheduled: SchedulerOutput
    seqs: list[int]  # Request.seq of each sampled row, in row order
    logits: jax.Array  # [rows, V] of the forward
    sampling: SamplingTensors | None  # host arrays; None: every row plainly greedy (the forward's argmax samples)
    want_logprobs: bool
    # The forward's greedy sampling of `logits`, (next prev_tokens, output): a plainly greedy step's result.
    greedy: tuple[jax.Array, SampleOutput] | None = None
    out: SampleOutput | None = None  # set once sampling is dispatched
    spec: SpecOutput | None = None  # a speculative step's outputs (then `out` stays None)
    sampled_index: list[int] = dataclasses.field(default_factory=list)  # each sampled row's request row
    # Prompt logprobs: the step's per-token results (device) and, per request, (seq, first prompt position,
    # first flat token, count): its positions p .. p + count - 1 are tokens flat .. flat + count - 1.
    prompt: PromptLogprobs | None = None
    prompt_spans: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return self.sampling.num_rows if self.sampling is not None else int(self.logits.shape[0])

    @property
    def dispatched(self) -> bool:
        """Whether the step's sampling is on the device (a deferred one waits for `ModelRunner.sample`)."""
        return self.out is not None or self.spec is not None


class SpecInputs(NamedTuple):
    """The host inputs of a speculative step (`spec_step`'s arguments after the device state, constraints
    between `sampling` and `draft_next_L`)."""

    batch: Batch
    history_rows: HistoryRows
    sampling: SamplingTensors
    draft_next_L: np.ndarray  # i32[rows * (1 + k)]
    row_next_R: np.ndarray  # i32[rows]
    num_logits_R: np.ndarray  # i32[rows]


@dataclasses.dataclass(frozen=True)
class Draft:
    """An EAGLE-3 draft on the device, proposing `k` tokens a step (serving/speculative.py)."""

    dcfg: DraftConfig
    params: Any
    k: int


def _forward(params: Any, kv: KVPages, history: PenaltyHistory, prev_tokens: jax.Array, host: jax.Array, *,
             pack: HostPack, cfg: Any, kernels: KernelChoice, logits_sharding: Any = None, max_logprobs: int,
             num_prev: int) -> tuple[Any, ...]:
    """The step's forward: (pages, history, logits, the greedy sampling of the logits as "sample_greedy" would
    give it). `host` holds (batch, prev_index, history_rows[, targets]) packed (`HostPack`). With `targets`
    (i32[T], each token's next prompt token or -1), the "forward_plp" executable: also every token's prompt
    logprobs."""
    batch, prev_index, history_rows, *rest = pack.unpack(host)
    targets = rest[0] if rest else None
    # Placeholders: tokens the previous step sampled, taken from its device output.
    token_ids = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], batch.token_ids)
    batch = dataclasses.replace(batch, token_ids=token_ids)
    history = record_history(history, history_rows, token_ids, batch.token_row, batch.positions,
                             batch.query_start[-1])
    out = forward(params, cfg, kv, batch, kernels, all_hidden=targets is not None)
    # Under TP the lm_head's output is split over the vocabulary: the sampling executable takes it whole.
    logits = out.logits if logits_sharding is None else jax.lax.with_sharding_constraint(out.logits, logits_sharding)
    greedy_out = _sample_greedy(logits, max_logprobs=max_logprobs, num_prev=num_prev)
    if targets is None:
        return out.kv, history, logits, greedy_out
    return out.kv, history, logits, greedy_out, prompt_logprobs(out.hidden, params["lm_head"], targets, MAX_LOGPROBS)


def _sample(logits: jax.Array, history: PenaltyHistory, sampling: SamplingTensors, constraints: TokenConstraints,
            *, max_logprobs: int, num_prev: int) -> tuple[jax.Array, SampleOutput]:
    return _with_next_prev(sample_as("sample", logits, sampling, max_logprobs, history, constraints), num_prev)


def _sample_greedy(logits: jax.Array, *, max_logprobs: int, num_prev: int) -> tuple[jax.Array, SampleOutput]:
    """The "sample_greedy" variant (`sampling.variant`: every row plainly greedy), computed inside every forward:
    an argmax over the logits costs the device microseconds, a dispatch of its own the host far more."""
    return _with_next_prev(sample_as(GREEDY_VARIANT, logits, None, max_logprobs), num_prev)


def _sample_plain(logits: jax.Array, sampling: SamplingTensors, *, how: str, max_logprobs: int,
                  num_prev: int) -> tuple[jax.Array, SampleOutput]:
    """The "sample_draw" / "sample_filter" executables: a step with sampled rows and no penalty, bias or grammar
    (`sampling.variant`); `sample` with its choices made on the host, so it holds no conditional."""
    return _with_next_prev(sample_as(how, logits, sampling, max_logprobs), num_prev)


def _with_next_prev(sampled: SampleOutput, num_prev: int) -> tuple[jax.Array, SampleOutput]:
    # The next step's placeholders index this: one shape whatever the row count.
    return jnp.zeros((num_prev,), jnp.int32).at[: sampled.tokens.shape[0]].set(sampled.tokens), sampled


class ModelRunner:
    def __init__(self, model: M3Model, num_pages: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, cache_dir: str | Path | None = None, draft: Draft | None = None,
                 enable_prompt_logprobs: bool = False):
        self.model = model
        self.cfg = model.cfg
        self.page_size = model.page_size
        self.max_num_seqs = max_num_seqs
        self.num_pages = num_pages
        # A fixed page-table width: attention shapes never depend on what else is in the batch.
        self.pages_per_row = -(-max_model_len // self.page_size)
        self.token_buckets = token_buckets(max_num_batched_tokens)
        self.cache = ExecutableCache(cache_dir) if cache_dir is not None else None
        self._fns = {
            "sample": jax.jit(functools.partial(_sample, max_logprobs=MAX_LOGPROBS, num_prev=max_num_seqs)),
            **{how: jax.jit(functools.partial(_sample_plain, how=how, max_logprobs=MAX_LOGPROBS,
                                              num_prev=max_num_seqs))
               for how in PLAIN_VARIANTS if how != GREEDY_VARIANT},
        }
        # Prompt logprobs: a second forward per token bucket (every token's logprobs), used only by steps that
        # hold such a request, so that the others pay nothing.
        self.enable_prompt_logprobs = enable_prompt_logprobs
        self._packs: dict[tuple[str, int], HostPack] = {}
        self.draft = draft
        if draft is not None:
            # One executable a step: target, verification and the draft's passes (serving/speculative.py); one per
            # bucket and sampling variant (`SPEC_OF`), so that only steps with a penalty or a grammar hold a
            # conditional.
            for how, what in SPEC_OF.items():
                self._fns[what] = jax.jit(functools.partial(
                    spec_step, cfg=self.cfg, dcfg=draft.dcfg, kernels=model.kernels, k=draft.k,
                    max_logprobs=MAX_LOGPROBS, how=how), donate_argnums=(2, 3, 4),
                    compiler_options=model.kernels.compiler_options)
        self._executables: dict[tuple[str, int], Callable[..., Any]] = {}
        self._no_constraints: dict[int, TokenConstraints] = {}  # device copies of the empty constraints, by rows
        self.compile_log: list[dict[str, Any]] = []  # one entry per executable made: what, size, how, seconds
        self._reset_state()

    # ---- device state ------------------------------------------------------------------------------------------
    def _reset_state(self) -> None:
        self.kv = self.model.new_pages(self.num_pages)
        replicated = self.model.rules.replicated()
        self.history = jax.device_put(PenaltyHistory.empty(self.max_num_seqs, self.cfg.vocab_size), replicated)
        self.prev_tokens = jax.device_put(jnp.zeros((self.max_num_seqs,), jnp.int32), replicated)
        self._prev_index: dict[int, int] = {}  # Request.seq -> its sampled row in the last dispatched step
        if self.draft is not None:
            self.draft_pages = jax.device_put(DraftPages.empty(self.draft.dcfg, self.num_pages, self.page_size,
                                                               self.model.dtype), replicated)

    # ---- shapes and executables --------------------------------------------------------------------------------
    def rows_for(self, num_tokens: int) -> int:
        return min(num_tokens, self.max_num_seqs)

    def bucket(self, num_tokens: int) -> int:
        for b in self.token_buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.token_buckets[-1]}")

    def _abstract_args(self, what: str, size: int) -> tuple[Any, ...]:
        """An executable's arguments as shapes, dtypes and placements: what tracing needs. `size`: the token
        bucket of a forward, the row count of a sampling."""
        replicated = self.model.rules.replicated()

        def spec(x: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding or getattr(x, "sharding", None))

        V = self.cfg.vocab_size
        if what in SPEC_VARIANTS:
            rows, width = self.rows_for(size), 1 + self.draft.k
            batch, _ = build_batch([], self.page_size, size, rows, self.pages_per_row, logits_per_row=width)
            host = (batch, HistoryRows.untracked(rows, self.max_num_seqs),
                    SamplingTensors.build([], [], rows * width, num_slots=self.max_num_seqs),
                    TokenConstraints.empty(rows * width, V), np.full(rows * width, -1, np.int32),
                    np.zeros(rows, np.int32), np.zeros(rows, np.int32))
            device = (self.model.params, self.draft.params, self.kv, self.draft_pages, self.history)
        elif what in ("forward", "forward_plp"):
            host = (np.zeros(self.host_pack(what, size).size, np.int32),)
            device = (self.model.params, self.kv, self.history, self.prev_tokens)
        elif what in PLAIN_VARIANTS:
            host = (SamplingTensors.build([], [], size, num_slots=self.max_num_seqs),)
            device = (jax.ShapeDtypeStruct((size, V), jnp.float32, sharding=replicated),)
        else:
            host = (SamplingTensors.build([], [], size, num_slots=self.max_num_seqs),
                    TokenConstraints.empty(size, V))
            device = (jax.ShapeDtypeStruct((size, V), jnp.float32, sharding=replicated), self.history)
        return (*jax.tree.map(spec, device), *jax.tree.map(lambda x: spec(x, replicated), host))

    def host_pack(self, what: str, size: int) -> HostPack:
        """The packing of a forward's host arrays at token bucket `size` ("forward" or "forward_plp")."""
        pack = self._packs.get((what, size))
        if pack is None:
            batch, _ = build_batch([], self.page_size, size, self.rows_for(size), self.pages_per_row)
            host = (batch, np.zeros(size, np.int32), HistoryRows.untracked(self.rows_for(size), self.max_num_seqs))
            if what == "forward_plp":
                host = (*host, np.full(size, -1, np.int32))
            pack = self._packs[(what, size)] = HostPack(host)
        return pack

    def jitted(self, what: str, size: int) -> Any:
        """The jitted function behind executable (`what`, `size`), for tracing (a forward's host layout is part
        of its function)."""
        if what in ("forward", "forward_plp"):
            m = self.model
            return jax.jit(functools.partial(_forward, pack=self.host_pack(what, size), cfg=self.cfg,
                                             kernels=m.kernels, logits_sharding=m.rules.replicated(),
                                             max_logprobs=MAX_LOGPROBS, num_prev=self.max_num_seqs),
                           donate_argnums=(1, 2), compiler_options=m.kernels.compiler_options)
        return self._fns[what]

    def trace(self, what: str, size: int) -> Any:
        """Executable (`what`, `size`) traced on its abstract arguments (`.lower()` next)."""
        return self.jitted(what, size).trace(*self._abstract_args(what, size))

    def _key(self, what: str, size: int) -> str:
        m = self.model
        return ExecutableCache.key(what, m.cfg, m.kernels, str(m.dtype), m.rules.mesh.shape, sorted(
            m.rules.rules.items()), size, self.rows_for(size), self.pages_per_row, self.num_pages,
            self.max_num_seqs, MAX_LOGPROBS, jax.tree.structure(m.params), [
                (x.shape, str(x.dtype)) for x in jax.tree.leaves(m.params)])

    def executable(self, what: str, size: int) -> Callable[..., Any]:
        """A forward (`size` = token bucket) or sampling (`size` = rows) executable: loaded from the cache, else
        traced, lowered, compiled (and saved)."""
        exe = self._executables.get((what, size))
        if exe is None:
            self._make([(what, size)])
            exe = self._executables[(what, size)]
        return exe

    def _make(self, shapes: list[tuple[str, int]], on_done: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Executables for `shapes`: each loaded from the cache, or else traced and lowered here and compiled on a
        pool of threads (XLA compiles without the GIL: a cold start costs about the longest compile, not the
        sum)."""
        from concurrent.futures import ThreadPoolExecutor

        devices = list(self.model.rules.mesh.devices.flat)
        todo = []
        for what, size in shapes:
            t0 = time.perf_counter()
            key = self._key(what, size) if self.cache is not None else None
            exe = self.cache.load(key, devices) if self.cache is not None else None
            if exe is not None:
                self._done(what, size, exe, "loaded", t0, on_done)
            else:
                todo.append((what, size, key, t0, self.trace(what, size).lower()))

        def compile_one(item: tuple) -> None:
            what, size, key, t0, lowered = item
            with xla_cache_hits() as hits:
                exe = lowered.compile()
            # An executable that XLA:CPU read back from JAX's own persistent cache serializes into a blob that
            # fails when loaded ("Function ... not found"): only fresh compiles are kept.
            if self.cache is not None and not hits:
                self.cache.save(key, exe)
            self._done(what, size, exe, "compiled", t0, on_done)

        with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
            list(pool.map(compile_one, todo))

    def _done(self, what: str, size: int, exe: Any, how: str, t0: float,
              on_done: Callable[[dict[str, Any]], None] | None) -> None:
        self._executables[(what, size)] = exe
        entry = {"what": what, "size": size, "how": how, "seconds": time.perf_counter() - t0}
        self.compile_log.append(entry)
        if on_done is not None:
            on_done(entry)

    def shapes(self) -> list[tuple[str, int]]:
        """Every executable serving can need: a forward per token bucket, and per row count the general sampling
        and the plain ones (`sampling.PLAIN_VARIANTS` but greedy, which the forward computes)."""
        if self.draft is not None:
            return [(what, t) for what in SPEC_VARIANTS for t in self.token_buckets]
        rows = sorted({self.rows_for(t) for t in self.token_buckets})
        plp = [("forward_plp", t) for t in self.token_buckets] if self.enable_prompt_logprobs else []
        return ([("forward", t) for t in self.token_buckets] + plp + [("sample", r) for r in rows]
                + [(v, r) for v in PLAIN_VARIANTS if v != GREEDY_VARIANT for r in rows])

    @property
    def num_executables(self) -> int:
        return len(self._executables)

    def warmup(self, progress: bool = True) -> float:
        """Make every executable (compile or load); nothing runs on the device."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        shapes = self.shapes()
        with tqdm(total=len(shapes), desc="compiling step shapes", disable=not progress, unit="shape") as bar:

            def done(entry: dict[str, Any]) -> None:
                bar.update(1)
                bar.set_postfix_str(f"{entry['what']} {entry['size']} {entry['how']}")

            self._make(shapes, done)
        return time.perf_counter() - t0

    # ---- one step ------------------------------------------------------------------------------------------
    def inputs(self, scheduled: SchedulerOutput, sampling_tensors: bool | None = None
               ) -> tuple[int, tuple[Any, ...], SamplingTensors | None, list[int]]:
        """Host arrays of a step: (token bucket, the forward's (batch, prev_index, history_rows), the sampling
        tensors, each sampled row's index in the step's token output). The sampling tensors are None when every
        sampled row is plainly greedy (the forward's argmax is the step's sampling), unless `sampling_tensors`."""
        num_tokens = self.bucket(scheduled.num_tokens)
        num_rows = self.rows_for(num_tokens)
        rows = scheduled.rows
        plans = [RowPlan(r.token_ids, r.start, r.pages, r.sample) for r in rows]
        batch, sample_index = build_batch(plans, self.page_size, num_tokens, num_rows, self.pages_per_row)

        # A placeholder can only be a row's last token (only the step in flight has unknown samples).
        prev_index = np.full(num_tokens, -1, np.int32)
        ends = batch.query_start[1:len(rows) + 1] - 1
        waiting = [i for i, r in enumerate(rows) if r.token_ids and r.token_ids[-1] == PLACEHOLDER]
        if waiting:
            prev_index[ends[waiting]] = [self._prev_index[rows[i].seq] for i in waiting]
        S = self.max_num_seqs
        history_rows = HistoryRows.untracked(num_rows, S)
        for i, r in enumerate(rows):
            if uses_penalty(r.sampling):
                history_rows.slot[i], history_rows.prompt_len[i] = r.slot, r.num_prompt
                history_rows.reset[i] = r.start == 0

        sampled_rows = [r for r in rows if r.sample]
        params = [r.sampling for r in sampled_rows]
        sampling = None
        if sampling_tensors or (sampling_tensors is None and not all(map(plainly_greedy, params))):
            sampling = SamplingTensors.build(params, [r.num_output for r in sampled_rows], num_rows,
                                             slots=[r.slot for r in sampled_rows], num_slots=S)
        return num_tokens, (batch, prev_index, history_rows), sampling, [i for i in sample_index if i >= 0]

    def prompt_targets(self, scheduled: SchedulerOutput, batch: Batch, num_tokens: int
                       ) -> tuple[np.ndarray | None, list[tuple[int, int, int, int]]]:
        """For the rows of requests that asked for prompt logprobs: each prompt token's next prompt token as its
        target (i32[num_tokens], -1 elsewhere), and their spans (InFlight.prompt_spans). (None, []): none asked."""
        if not self.enable_prompt_logprobs:
            return None, []
        targets, spans = None, []
        for i, r in enumerate(scheduled.rows):
            if getattr(r.sampling, "prompt_logprobs", None) is None:
                continue
            # Positions start .. end - 1 whose next token is a prompt token: p + 1 < num_prompt.
            end = min(r.start + len(r.token_ids), r.num_prompt - 1)
            if end <= r.start:
                continue
            flat = int(batch.query_start[i])
            n = end - r.start
            following = list(r.token_ids[1:n + 1])
            if len(following) < n:  # the chunk's last token: its next prompt token is the next chunk's first
                following.append(r.next_token)
            if targets is None:
                targets = np.full(num_tokens, -1, np.int32)
            targets[flat:flat + n] = following
            spans.append((r.seq, r.start, flat, n))
        return targets, spans

    def launch(self, scheduled: SchedulerOutput, constraints: TokenConstraints | None = None,
               defer_sampling: bool = False) -> InFlight:
        """Dispatch a step's forward, and its sampling unless `defer_sampling` (then `sample` does, with the
        constraints it is given). Returns before anything has run. Raises StepFailed, with the state rebuilt."""
        if self.draft is not None:
            return self._launch_spec(scheduled, constraints)
        num_tokens, forward_args, sampling, sampled_index = self.inputs(scheduled)
        targets, spans = self.prompt_targets(scheduled, forward_args[0], num_tokens)
        prompt = None
        try:
            if spans:
                logits, greedy_out, prompt = self.run_forward("forward_plp", num_tokens, (*forward_args, targets))
            else:
                logits, greedy_out = self.run_forward("forward", num_tokens, forward_args)
        except Exception as e:
            self._reset_state()
            raise StepFailed(f"step failed: {e}") from e
        sampled_rows = [r for r in scheduled.rows if r.sample]
        seqs = [r.seq for r in sampled_rows]
        self._prev_index = dict(zip(seqs, sampled_index, strict=True))
        want = any(getattr(r.sampling, "logprobs", None) is not None for r in sampled_rows)
        step = InFlight(scheduled, seqs, logits, sampling, want, greedy=greedy_out, prompt=prompt,
                        prompt_spans=spans)
        if not defer_sampling:
            self.sample(step, constraints)
        return step

    def run_forward(self, what: str, num_tokens: int, host_args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Dispatch forward executable `what` ("forward" / "forward_plp") of token bucket `num_tokens` on a step's
        host arrays (`inputs`' forward arguments, then the targets for prompt logprobs), packed into one copy.
        Takes the new page pool and history; returns the rest: (logits, greedy output[, prompt logprobs])."""
        flat = self.host_pack(what, num_tokens).pack(host_args)
        self.kv, self.history, *outs = self.executable(what, num_tokens)(
            self.model.params, self.kv, self.history, self.prev_tokens, flat)
        return tuple(outs)

    def sample(self, step: InFlight, constraints: TokenConstraints | None = None) -> None:
        """Dispatch a launched step's sampling (None: no biases, no grammar)."""
        try:
            if step.sampling is None:  # plainly greedy rows: no bias, no grammar, no logprobs
                assert constraints is None and not step.want_logprobs
                how = GREEDY_VARIANT
            else:
                how = variant(step.sampling, self.max_num_seqs, self.cfg.vocab_size,
                              constrained=constraints is not None, want_logprobs=step.want_logprobs)
            self.prev_tokens, step.out = self.run_sampling(how, step, constraints)
        except Exception as e:
            self._reset_state()
            raise StepFailed(f"step failed: {e}") from e

    def run_sampling(self, how: str, step: InFlight,
                     constraints: TokenConstraints | None) -> tuple[jax.Array, SampleOutput]:
        """Sampling variant `how` (`sampling.variant`) of a launched step: (the next step's `prev_tokens`, the
        sampled output). Greedy is the forward's own output; the others dispatch their executable, each with only
        what it reads."""
        if how == GREEDY_VARIANT:
            return step.greedy
        logits, sampling = step.logits, step.sampling
        rows = sampling.num_rows
        exe = self.executable(how, rows)
        if how != "sample":
            return exe(logits, sampling)
        return exe(logits, self.history, sampling,
                   constraints if constraints is not None else self._empty_constraints(rows))

    @property
    def logits_per_row(self) -> int:
        """Logit rows per request row of a step: 1, or 1 + k with speculation (the constraints' grid)."""
        return 1 + self.draft.k if self.draft is not None else 1

    def spec_inputs(self, scheduled: SchedulerOutput) -> tuple[int, SpecInputs]:
        """Host arrays of a speculative step: (token bucket, inputs). Rows carry 1 + drafts tokens; the sampling
        grid is [rows, 1 + k], each row's params at steps num_output + j."""
        W = self.logits_per_row
        num_tokens = self.bucket(scheduled.num_tokens)
        num_rows = self.rows_for(num_tokens)
        rows = scheduled.rows
        plans = [RowPlan(r.token_ids, r.start, r.pages, r.sample, 1 + r.num_drafts if r.sample else 0) for r in rows]
        batch, _ = build_batch(plans, self.page_size, num_tokens, num_rows, self.pages_per_row, logits_per_row=W)
        S = self.max_num_seqs
        history_rows = HistoryRows.untracked(num_rows, S)
        num_logits = np.zeros(num_rows, np.int32)
        row_next = np.zeros(num_rows, np.int32)
        draft_next = np.full((num_rows, W), -1, np.int32)
        params, steps, slots = [], [], []
        for i, r in enumerate(rows):
            if uses_penalty(r.sampling):
                history_rows.slot[i], history_rows.prompt_len[i] = r.slot, r.num_prompt
                history_rows.reset[i] = r.start == 0
            num_logits[i] = 1 + r.num_drafts if r.sample else 0
            row_next[i] = max(r.next_token, 0)
            if r.num_drafts:
                draft_next[i, : r.num_drafts] = r.token_ids[-r.num_drafts:]
        for i in range(num_rows):
            r = rows[i] if i < len(rows) else None
            for j in range(W):
                params.append(r.sampling if r is not None else _GREEDY)
                steps.append(r.num_output + j if r is not None else 0)
                slots.append(r.slot if r is not None else -1)
        sampling = SamplingTensors.build(params, steps, num_rows * W, slots=slots, num_slots=S)
        return num_tokens, SpecInputs(batch, history_rows, sampling, draft_next.reshape(-1), row_next, num_logits)

    def spec_variant(self, inputs: SpecInputs, constraints: TokenConstraints | None, want_logprobs: bool) -> str:
        """The speculative executable for a step with host `inputs`: its sampling variant's (`SPEC_OF`)."""
        return SPEC_OF[variant(inputs.sampling, self.max_num_seqs, self.cfg.vocab_size,
                               constrained=constraints is not None, want_logprobs=want_logprobs)]

    def run_spec(self, what: str, num_tokens: int, inputs: SpecInputs,
                 constraints: TokenConstraints | None) -> SpecOutput:
        """Dispatch speculative executable `what` (`spec_variant`) on a step (`constraints` over its [rows, 1 + k]
        grid; None: none)."""
        if constraints is None:
            constraints = self._empty_constraints(inputs.sampling.num_rows)
        self.kv, self.draft_pages, self.history, out = self.executable(what, num_tokens)(
            self.model.params, self.draft.params, self.kv, self.draft_pages, self.history, *inputs[:3], constraints,
            *inputs[3:])
        return out

    def _launch_spec(self, scheduled: SchedulerOutput, constraints: TokenConstraints | None) -> InFlight:
        """A speculative step: verification rows of 1 + drafts tokens, the draft's passes, in one executable."""
        num_tokens, inputs = self.spec_inputs(scheduled)
        rows = scheduled.rows
        sampled = [i for i, r in enumerate(rows) if r.sample]
        want = any(getattr(rows[i].sampling, "logprobs", None) is not None for i in sampled)
        try:
            out = self.run_spec(self.spec_variant(inputs, constraints, want), num_tokens, inputs, constraints)
        except Exception as e:
            self._reset_state()
            raise StepFailed(f"step failed: {e}") from e
        return InFlight(scheduled, [rows[i].seq for i in sampled], None, inputs.sampling, want, spec=out,
                        sampled_index=sampled)

    def _empty_constraints(self, rows: int) -> TokenConstraints:
        if rows not in self._no_constraints:
            self._no_constraints[rows] = jax.device_put(TokenConstraints.empty(rows, self.cfg.vocab_size),
                                                        self.model.rules.replicated())
        return self._no_constraints[rows]

    def collect(self, step: InFlight) -> ModelRunnerOutput:
        """Wait for a step's tokens. Raises StepFailed (state rebuilt) if it failed on the device."""
        if step.spec is not None:
            try:
                idx = step.sampled_index
                out = jax.tree.map(np.asarray, step.spec)
                result = ModelRunnerOutput(step.seqs, out.emitted[idx], num_emitted=out.num_emitted[idx],
                                           drafts=out.drafts[idx])
                if step.want_logprobs:
                    result.logprobs, result.top_ids = out.logprobs[idx], out.top_ids[idx]
                    result.top_logprobs = out.top_logprobs[idx]
                return result
            except Exception as e:
                self._reset_state()
                raise StepFailed(f"step failed: {e}") from e
        assert step.out is not None, "the step's sampling was never dispatched"
        n = len(step.seqs)
        try:
            tokens = np.asarray(step.out.tokens)[:n]
            result = ModelRunnerOutput(step.seqs, tokens)
            if step.want_logprobs:
                result.logprobs, result.top_ids = np.asarray(step.out.logprobs)[:n], np.asarray(step.out.top_ids)[:n]
                result.top_logprobs = np.asarray(step.out.top_logprobs)[:n]
            if step.prompt is not None:
                p = jax.tree.map(np.asarray, step.prompt)
                result.prompt_logprobs = {
                    seq: (start, *(x[f:f + m] for x in (p.logprobs, p.ranks, p.top_ids, p.top_logprobs)))
                    for seq, start, f, m in step.prompt_spans}
            return result
        except Exception as e:
            self._reset_state()
            raise StepFailed(f"step failed: {e}") from e
