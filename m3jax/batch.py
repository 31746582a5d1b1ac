"""The flat ragged `Batch` of one step and the paged `KVPages` it reads and writes.

Prefill chunks, decode tokens and draft-verification rows are all just query tokens of some request row:
the model never asks which kind of step it is in. A page holds `page_size` = MSA block size tokens, so a
selected MSA block is exactly one page. Page 0 is never handed to a request: padding tokens write there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.config import M3Config

SINK_PAGE = 0


def page_size(cfg: M3Config) -> int:
    return cfg.index_block_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """One step's work. T query tokens (padded to a bucket), R request rows, P logical pages per row."""

    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32 absolute position of each token in its request
    token_row: jax.Array  # [T] int32 request row of each token (padding: row 0)
    slot_mapping: jax.Array  # [T] int32 page * page_size + offset where the token's K/V/index-K go (padding: 0)
    page_table: jax.Array  # [R, P] int32 physical page of each logical block (unused: the sink page)
    logit_rows: jax.Array  # [L] int32 flat token indices whose logits are wanted (sampled rows)
    # Per-row views of the same layout, for kernels that give one program all query rows of a request:
    query_start: jax.Array  # [R + 1] int32 row r's tokens are token_ids[query_start[r]:query_start[r + 1]]
    seq_lens: jax.Array  # [R] int32 tokens in row r's pages after this step (context + new); 0 = padding row

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def with_page_offset(self, offset: jax.Array | int, ps: int) -> Batch:
        """The same batch addressing pages `offset` further on: a layer's pages inside its run's stacked pool
        (layer j of a run owns pages j * num_pages ... (j + 1) * num_pages - 1, its own sink page first)."""
        return dataclasses.replace(self, page_table=self.page_table + offset,
                                   slot_mapping=self.slot_mapping + offset * ps)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPages:
    """The page pool, one array per layer run (`M3Config.layer_runs`), stacked over the run's layers like its
    weights: k[run], v[run]: [layers, pages, page_size, K, hd]; index_k[run]: [layers, pages, page_size, hdi] on
    sparse runs (None on dense ones). K is post-norm post-RoPE, V raw, index-K post-norm post-RoPE. A page id
    means the same page in every layer: a request's pages hold its K, V and index-K of all layers."""

    k: list[jax.Array]
    v: list[jax.Array]
    index_k: list[jax.Array | None]

    @classmethod
    def empty(cls, cfg: M3Config, num_pages: int, dtype: Any, kv_sharding: Any = None,
              index_sharding: Any = None) -> KVPages:
        def zeros(s: tuple[int, ...], sharding: Any = None) -> jax.Array:
            if sharding is None:
                return jnp.zeros(s, dtype)
            # Made in place on the mesh: a KV pool can be most of a device's memory.
            return jax.jit(lambda: jnp.zeros(s, dtype), out_shardings=sharding)()

        runs = cfg.layer_runs
        return cls(
            k=[zeros(kv_shape(cfg, run.count, num_pages), kv_sharding) for run in runs],
            v=[zeros(kv_shape(cfg, run.count, num_pages), kv_sharding) for run in runs],
            index_k=[zeros(index_k_shape(cfg, run.count, num_pages), index_sharding) if run.attn == "sparse"
                     else None for run in runs],
        )

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @staticmethod
    def bytes_per_page(cfg: M3Config, dtype: Any) -> int:
        ps, item = page_size(cfg), jnp.dtype(dtype).itemsize
        kv = 2 * cfg.num_layers * ps * cfg.num_kv_heads * cfg.head_dim
        idx = len(cfg.sparse_layers) * ps * cfg.index_head_dim
        return (kv + idx) * item


def kv_shape(cfg: M3Config, layers: int, num_pages: int) -> tuple[int, ...]:
    return (layers, num_pages, page_size(cfg), cfg.num_kv_heads, cfg.head_dim)


def index_k_shape(cfg: M3Config, layers: int, num_pages: int) -> tuple[int, ...]:
    return (layers, num_pages, page_size(cfg), cfg.index_head_dim)


@dataclasses.dataclass
class RowPlan:
    """What one request contributes to a step: `tokens` at positions start .. start + len - 1, its pages, and
    whether its last new token is sampled (a prefill chunk that does not reach the prompt's end is not)."""

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]
    sample: bool = True
    # Logit rows wanted: the last `num_logits` tokens (speculative verification: 1 + k); None: 1 if `sample`.
    num_logits: int | None = None


def build_batch(rows: Sequence[RowPlan], ps: int, num_tokens: int, num_rows: int, pages_per_row: int,
                num_logit_rows: int | None = None, logits_per_row: int | None = None) -> tuple[Batch, list[int]]:
    """Host-side assembly of a padded Batch (numpy leaves). Returns the batch and, per row, the index into
    `logit_rows` of its sampled token (-1 if not sampled). Padding tokens write to the sink page and read row 0.
    Token ids below 0 (placeholders the step fills on the device) are sent as 0.

    `logits_per_row` (speculative decoding): the logit rows form a [num_rows, logits_per_row] grid, row r's
    entries its last `num_logits` tokens in order, the rest repeating its last token (masked by whoever reads
    them); the returned index of row r is then r * logits_per_row, or -1 when it wants none."""
    n = len(rows)
    lengths = np.fromiter((len(r.tokens) for r in rows), np.int64, n)
    total = int(lengths.sum())
    if total > num_tokens or n > num_rows:
        raise ValueError(f"{total} tokens / {n} rows do not fit the bucket ({num_tokens}, {num_rows})")
    num_logit_rows = num_rows if num_logit_rows is None else num_logit_rows
    starts = np.fromiter((r.start for r in rows), np.int64, n)
    ends = starts + lengths
    num_pages = np.fromiter((len(r.pages) for r in rows), np.int64, n)
    short = np.flatnonzero(-(-ends // ps) > num_pages)
    if len(short):
        r = int(short[0])
        raise ValueError(f"row {r}: {ends[r]} tokens need {-(-ends[r] // ps)} pages, {num_pages[r]} given")
    wide = np.flatnonzero(num_pages > pages_per_row)
    if len(wide):
        raise ValueError(f"row {wide[0]}: {num_pages[wide[0]]} pages exceed the page table width {pages_per_row}")
    page_table = np.full((num_rows, pages_per_row), SINK_PAGE, np.int32)
    for r, row in enumerate(rows):
        page_table[r, : len(row.pages)] = row.pages

    # The flat token axis: row r's tokens at query_start[r] .. query_start[r + 1] - 1, padding after them.
    query_start = np.full(num_rows + 1, total, np.int32)
    query_start[: n + 1] = np.concatenate([[0], np.cumsum(lengths)])
    token_row = np.zeros(num_tokens, np.int32)
    token_row[:total] = np.repeat(np.arange(n), lengths)
    positions = np.zeros(num_tokens, np.int32)
    positions[:total] = np.arange(total) + np.repeat(starts - query_start[:n], lengths)
    token_ids = np.zeros(num_tokens, np.int32)
    if total:
        token_ids[:total] = np.maximum(np.concatenate([np.asarray(r.tokens, np.int64) for r in rows]), 0)
    slots = np.full(num_tokens, SINK_PAGE * ps, np.int32)
    pos = positions[:total]
    slots[:total] = page_table[token_row[:total], pos // ps] * ps + pos % ps
    seq_lens = np.zeros(num_rows, np.int32)
    seq_lens[:n] = ends

    if logits_per_row is not None:
        width = logits_per_row
        wanted = np.fromiter(((r.num_logits if r.num_logits is not None else int(r.sample)) for r in rows), np.int64,
                             n)
        if (wanted > np.minimum(lengths, width)).any():
            raise ValueError(f"a row wants more logit rows than it has tokens or than {width}")
        j = np.arange(width)[None, :]
        last = (query_start[1: n + 1] - 1)[:, None]
        grid = np.zeros((num_rows, width), np.int32)
        grid[:n] = last - np.maximum(wanted[:, None] - 1 - j, 0)
        logit_rows = grid.reshape(-1)
        sample_index = np.where(wanted > 0, np.arange(n) * width, -1).tolist()
    else:
        sampled = np.flatnonzero(np.fromiter((r.sample for r in rows), bool, n) & (lengths > 0))
        if len(sampled) > num_logit_rows:
            raise ValueError("more sampled rows than logit rows in the bucket")
        logit_rows = np.zeros(num_logit_rows, np.int32)
        logit_rows[: len(sampled)] = query_start[sampled + 1] - 1
        sample_index = np.full(n, -1, np.int64)
        sample_index[sampled] = np.arange(len(sampled))
        sample_index = sample_index.tolist()
    # Host arrays: jit (or a compiled step) moves them to the devices with the placement it was built for.
    batch = Batch(token_ids, positions, token_row, slots, page_table, logit_rows, query_start, seq_lens)
    return batch, sample_index
