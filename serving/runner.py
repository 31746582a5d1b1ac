"""The model executor: the only code that builds device arrays and calls the compiled step.

A `SchedulerOutput` becomes a padded `Batch`; sampling parameters become `SamplingTensors`; one compiled call
runs forward + sampling with the page pool, the penalty history and the previous step's tokens donated. Only
token ids (and logprobs when asked) come back to the host, as a `ModelRunnerOutput`.

Shapes: one executable per token bucket. The token count of a step is padded to the next bucket (powers of
two from 8 up to `max_num_batched_tokens`) and its rows to min(bucket, max_num_seqs), the most rows that many
tokens can hold, so the row count never multiplies the executables. The page table is always
`max_model_len / page_size` wide (attention shapes never depend on the rest of the batch), and the penalty
history is a fixed device table, so nothing a request asks for makes a new shape: after `warmup` the engine
never compiles.

Async hand-off: `launch` dispatches a step and returns at once; `collect` waits for its tokens. A token the
previous step samples is a placeholder in the next step's rows; the compiled step reads it from that step's
device output (`prev_tokens`), so step N+1 is dispatched before step N's tokens reach the host.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.api import M3Model
from m3jax.batch import Batch, KVPages, RowPlan, build_batch
from m3jax.model import forward
from pallas_kernels.choice import KernelChoice
from serving.executables import ExecutableCache, xla_cache_hits
from serving.outputs import MAX_LOGPROBS
from serving.request import PLACEHOLDER
from serving.sampling import (
    HistoryRows,
    PenaltyHistory,
    SampleOutput,
    SamplingTensors,
    record_history,
    sample,
    uses_penalty,
)
from serving.scheduler import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)


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


@dataclasses.dataclass
class InFlight:
    """A dispatched step: its outputs are device arrays until `collect`."""

    scheduled: SchedulerOutput
    seqs: list[int]  # Request.seq of each sampled row, in row order
    out: SampleOutput
    want_logprobs: bool


def _step(params: Any, kv: KVPages, history: PenaltyHistory, prev_tokens: jax.Array, batch: Batch,
          prev_index: jax.Array, history_rows: HistoryRows, sampling: SamplingTensors, *, cfg: Any,
          kernels: KernelChoice, max_logprobs: int
          ) -> tuple[KVPages, PenaltyHistory, jax.Array, SampleOutput]:
    # Placeholders: tokens the previous step sampled, taken from its device output.
    token_ids = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], batch.token_ids)
    batch = dataclasses.replace(batch, token_ids=token_ids)
    history = record_history(history, history_rows, token_ids, batch.token_row, batch.positions,
                             batch.query_start[-1])
    out = forward(params, cfg, kv, batch, kernels)
    sampled = sample(out.logits, sampling, max_logprobs, history)
    # The next step's placeholders index this: one shape for every bucket.
    next_prev = jnp.zeros_like(prev_tokens).at[: sampled.tokens.shape[0]].set(sampled.tokens)
    return out.kv, history, next_prev, sampled


class ModelRunner:
    def __init__(self, model: M3Model, num_pages: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, cache_dir: str | Path | None = None):
        self.model = model
        self.cfg = model.cfg
        self.page_size = model.page_size
        self.max_num_seqs = max_num_seqs
        self.num_pages = num_pages
        # A fixed page-table width: attention shapes never depend on what else is in the batch.
        self.pages_per_row = -(-max_model_len // self.page_size)
        self.token_buckets = token_buckets(max_num_batched_tokens)
        self.cache = ExecutableCache(cache_dir) if cache_dir is not None else None
        self._fn = jax.jit(functools.partial(_step, cfg=self.cfg, kernels=model.kernels,
                                             max_logprobs=MAX_LOGPROBS), donate_argnums=(1, 2, 3))
        self._executables: dict[int, Callable[..., Any]] = {}
        self.compile_log: list[dict[str, Any]] = []  # one entry per executable made: bucket, how, seconds
        self._reset_state()

    # ---- device state ------------------------------------------------------------------------------------------
    def _reset_state(self) -> None:
        self.kv = self.model.new_pages(self.num_pages)
        replicated = self.model.rules.replicated()
        self.history = jax.device_put(PenaltyHistory.empty(self.max_num_seqs, self.cfg.vocab_size), replicated)
        self.prev_tokens = jax.device_put(jnp.zeros((self.max_num_seqs,), jnp.int32), replicated)
        self._prev_index: dict[int, int] = {}  # Request.seq -> its sampled row in the last dispatched step

    # ---- shapes and executables --------------------------------------------------------------------------------
    def rows_for(self, num_tokens: int) -> int:
        return min(num_tokens, self.max_num_seqs)

    def bucket(self, num_tokens: int) -> int:
        for b in self.token_buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.token_buckets[-1]}")

    def _abstract_args(self, num_tokens: int) -> tuple[Any, ...]:
        """The step's arguments for a bucket as shapes, dtypes and placements: what tracing needs."""
        rows = self.rows_for(num_tokens)
        replicated = self.model.rules.replicated()

        def spec(x: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding or getattr(x, "sharding", None))

        batch, _ = build_batch([], self.page_size, num_tokens, rows, self.pages_per_row)
        host = (batch, np.zeros(num_tokens, np.int32), HistoryRows.untracked(rows, self.max_num_seqs),
                SamplingTensors.build([], [], rows, num_slots=self.max_num_seqs))
        device = (self.model.params, self.kv, self.history, self.prev_tokens)
        return (*jax.tree.map(spec, device), *jax.tree.map(lambda x: spec(x, replicated), host))

    def _key(self, num_tokens: int) -> str:
        m = self.model
        return ExecutableCache.key("step", m.cfg, m.kernels, str(m.dtype), m.rules.mesh.shape, sorted(
            m.rules.rules.items()), num_tokens, self.rows_for(num_tokens), self.pages_per_row, self.num_pages,
            self.max_num_seqs, MAX_LOGPROBS, jax.tree.structure(m.params), [
                (x.shape, str(x.dtype)) for x in jax.tree.leaves(m.params)])

    def executable(self, num_tokens: int) -> Callable[..., Any]:
        """The compiled step of a bucket: loaded from the cache, else traced, lowered, compiled (and saved)."""
        exe = self._executables.get(num_tokens)
        if exe is not None:
            return exe
        t0 = time.perf_counter()
        key = self._key(num_tokens) if self.cache is not None else None
        exe = self.cache.load(key, list(self.model.rules.mesh.devices.flat)) if self.cache is not None else None
        how = "loaded"
        if exe is None:
            with xla_cache_hits() as hits:
                exe = self._fn.trace(*self._abstract_args(num_tokens)).lower().compile()
            how = "compiled"
            # An executable that XLA:CPU read back from JAX's own persistent cache serializes into a blob that
            # fails when loaded ("Function ... not found"): only fresh compiles are kept.
            if self.cache is not None and not hits:
                self.cache.save(key, exe)
        self._executables[num_tokens] = exe
        self.compile_log.append({"tokens": num_tokens, "rows": self.rows_for(num_tokens), "how": how,
                                 "seconds": time.perf_counter() - t0})
        return exe

    @property
    def num_executables(self) -> int:
        return len(self._executables)

    def warmup(self, progress: bool = True) -> float:
        """Make every bucket's executable (compile or load); nothing runs on the device."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        with tqdm(self.token_buckets, desc="compiling step shapes", disable=not progress, unit="shape") as bar:
            for tokens in bar:
                self.executable(tokens)
                bar.set_postfix_str(f"{tokens} tokens {self.compile_log[-1]['how']}")
        return time.perf_counter() - t0

    # ---- one step ------------------------------------------------------------------------------------------
    def inputs(self, scheduled: SchedulerOutput) -> tuple[int, tuple[Any, ...], list[int]]:
        """Host arrays of a step: (token bucket, (batch, prev_index, history_rows, sampling), sampled rows'
        indices into the previous-step token array they come from)."""
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
        sampling = SamplingTensors.build([r.sampling for r in sampled_rows], [r.num_output for r in sampled_rows],
                                         num_rows, slots=[r.slot for r in sampled_rows], num_slots=S)
        return num_tokens, (batch, prev_index, history_rows, sampling), [i for i in sample_index if i >= 0]

    def run(self, num_tokens: int, host_args: tuple[Any, ...]) -> SampleOutput:
        """Dispatch the bucket's executable on the runner's device state (donated, replaced by the outputs)."""
        self.kv, self.history, self.prev_tokens, out = self.executable(num_tokens)(
            self.model.params, self.kv, self.history, self.prev_tokens, *host_args)
        return out

    def launch(self, scheduled: SchedulerOutput) -> InFlight:
        """Dispatch one step (returns before it has run). Raises StepFailed, with the state rebuilt."""
        num_tokens, host_args, sampled_index = self.inputs(scheduled)
        try:
            out = self.run(num_tokens, host_args)
        except Exception as e:
            self._reset_state()
            raise StepFailed(f"step failed: {e}") from e
        sampled_rows = [r for r in scheduled.rows if r.sample]
        seqs = [r.seq for r in sampled_rows]
        self._prev_index = dict(zip(seqs, sampled_index, strict=True))
        want = any(getattr(r.sampling, "logprobs", None) is not None for r in sampled_rows)
        return InFlight(scheduled, seqs, out, want)

    def collect(self, step: InFlight) -> ModelRunnerOutput:
        """Wait for a dispatched step's tokens. Raises StepFailed (state rebuilt) if it failed on the device."""
        n = len(step.seqs)
        try:
            tokens = np.asarray(step.out.tokens)[:n]
            if not step.want_logprobs:
                return ModelRunnerOutput(step.seqs, tokens)
            return ModelRunnerOutput(step.seqs, tokens, np.asarray(step.out.logprobs)[:n],
                                     np.asarray(step.out.top_ids)[:n], np.asarray(step.out.top_logprobs)[:n])
        except Exception as e:
            self._reset_state()
            raise StepFailed(f"step failed: {e}") from e
