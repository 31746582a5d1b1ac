"""The only code that builds device arrays and calls the jitted step.

A `StepPlan` becomes a padded `Batch` (token-count and row-count buckets keep shapes static), sampling
parameters become `SamplingTensors`, and one jitted call runs forward + sampling with the page pool donated.
Only token ids and logprobs come back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from m3jax.api import M3Model
from m3jax.batch import Batch, KVPages, RowPlan, build_batch
from m3jax.model import forward
from serving.outputs import MAX_LOGPROBS
from serving.sampling import SampleOutput, SamplingTensors, sample
from serving.scheduler import StepPlan

log = logging.getLogger(__name__)


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2lo, 4lo, ... and hi itself: the bucket sizes for a range."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return [*out, hi]


def enable_compilation_cache(path: str | os.PathLike[str] | None = None) -> Path:
    """Keep compiled executables on disk so a restart does not recompile (JAX's persistent cache)."""
    cache = Path(path or os.environ.get("M3JAX_COMPILATION_CACHE") or Path.home() / ".cache" / "m3jax" / "xla")
    cache.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache


@dataclasses.dataclass
class SampledToken:
    token_id: int
    logprob: float
    top: dict[int, float]


def _step(params: Any, kv: KVPages, batch: Batch, sampling: SamplingTensors, *, cfg: Any,
          max_logprobs: int) -> tuple[KVPages, SampleOutput]:
    out = forward(params, cfg, kv, batch)
    return out.kv, sample(out.logits, sampling, max_logprobs)


class ModelRunner:
    def __init__(self, model: M3Model, num_pages: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.model = model
        self.cfg = model.cfg
        self.page_size = model.page_size
        # A fixed page-table width: attention shapes never depend on what else is in the batch.
        self.pages_per_row = -(-max_model_len // self.page_size)
        self.kv = model.new_pages(num_pages)
        self.row_buckets = powers_of_two(1, max_num_seqs)
        self.token_buckets = powers_of_two(min(8, max_num_batched_tokens), max_num_batched_tokens)
        self._step = jax.jit(functools.partial(_step, cfg=self.cfg, max_logprobs=MAX_LOGPROBS),
                             donate_argnums=(1,))
        self.num_compiled = 0

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """(tokens, rows) pairs a step can take. A step has at least as many tokens as rows."""
        return [(t, r) for t in self.token_buckets for r in self.row_buckets if r <= t]

    def _bucket(self, buckets: Sequence[int], n: int) -> int:
        for b in buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")

    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket once (all-padding batches: they write only to the sink page)."""
        from tqdm.auto import tqdm

        shapes = self.bucket_shapes()
        t0 = time.perf_counter()
        for t, r in tqdm(shapes, desc="compiling step buckets", disable=not progress, unit="shape"):
            batch, _ = build_batch([], self.page_size, t, r, self.pages_per_row)
            sampling = SamplingTensors.build([], None, [], r)
            self.kv, out = self._step(self.model.params, self.kv, batch, sampling)
            jax.block_until_ready(out.tokens)
        self.num_compiled = self._step._cache_size()
        return time.perf_counter() - t0

    def execute(self, plan: StepPlan) -> dict[str, SampledToken]:
        """Run one step; returns the sampled token of every row that samples, by request id."""
        rows = [RowPlan(r.tokens, r.start, r.request.pages, r.sample) for r in plan.rows]
        num_tokens = self._bucket(self.token_buckets, max(plan.num_tokens, len(rows)))
        num_rows = self._bucket(self.row_buckets, len(rows))
        batch, sample_index = build_batch(rows, self.page_size, num_tokens, num_rows, self.pages_per_row)

        sampled_rows = [r for r in plan.rows if r.sample]
        params = [r.request.sampling for r in sampled_rows]
        histories = [(r.request.prompt_ids, r.request.output_ids) for r in sampled_rows]
        steps = [len(r.request.output_ids) for r in sampled_rows]
        sampling = SamplingTensors.build(params, histories, steps, num_rows)

        self.kv, out = self._step(self.model.params, self.kv, batch, sampling)
        want_logprobs = any(getattr(p, "logprobs", None) is not None for p in params)
        tokens = np.asarray(out.tokens)
        logprobs = np.asarray(out.logprobs) if want_logprobs else None
        top_ids = np.asarray(out.top_ids) if want_logprobs else None
        top_lp = np.asarray(out.top_logprobs) if want_logprobs else None

        result: dict[str, SampledToken] = {}
        for row, idx in zip(plan.rows, sample_index, strict=True):
            if idx < 0:
                continue
            n = getattr(row.request.sampling, "logprobs", None)
            if n is None or logprobs is None:
                result[row.request.request_id] = SampledToken(int(tokens[idx]), 0.0, {})
            else:
                top = {int(i): float(lp) for i, lp in zip(top_ids[idx, :n], top_lp[idx, :n], strict=True)}
                result[row.request.request_id] = SampledToken(int(tokens[idx]), float(logprobs[idx]), top)
        return result
