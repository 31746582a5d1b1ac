"""Query blocks of a flat ragged batch: the unit of work of every attention-family kernel.

A query block is up to `bt` consecutive tokens of one request (one run of equal `token_row`). Kernels give one
program to each query block so that a page read from HBM serves every query row of that block: 1 + k draft rows
of a decode, or `bt` rows of a prefill chunk. Prefill chunks, decodes and drafts are all just runs of different
lengths, so one launch serves a mixed batch.

The kernels' op signatures carry only `token_row` and `pos` (not `Batch.query_start`), so the runs are found
here from `token_row`. Contract (what `m3jax.batch.build_batch` produces): the tokens of one request are
contiguous in the flat batch; padding tokens (row 0, position 0) may follow as one more run. The program
count is sized for at most `R + 1` runs. Each token still uses its OWN position for its causal cutoff, so
padding tokens get exactly what the reference gives them.

The query blocks depend on the step's `token_row` and `pos` alone, the same in every layer, and the GPU's XLA
does not move them out of a layer scan (`benchmarks/check_hoisting.py`): computed inside the ops, every
attention layer would pay ~20 small kernels for them. A forward therefore computes them once per step, before
its scans, under `step_query_blocks`; `query_blocks` hands an op the step's copy when it asks with the step's
own `token_row` and `pos` arrays (the same objects: a scan body closes over them, so the copy is a loop
constant), and computes them itself otherwise (an op called on its own). A `shard_map` body has arrays of its
own: the sharded ops hand the step's copies in as replicated operands (`step_copies`, `given_query_blocks`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QueryBlocks:
    """Per query block (Q of them, the static program count; unused ones have length 0)."""

    start_Q: jax.Array  # [Q] int32 first flat token
    length_Q: jax.Array  # [Q] int32 tokens in the block (0: unused program)
    row_Q: jax.Array  # [Q] int32 request row (page-table row)
    max_pos_Q: jax.Array  # [Q] int32 largest position in the block: bounds the pages to read
    block_T: jax.Array  # [T] int32 each token's query block (its offset in it: t - start_Q[block_T[t]])

    @property
    def num_blocks(self) -> int:
        return self.start_Q.shape[0]


def cut_runs(key_T: jax.Array, size: int, num_pieces: int,
             valid_T: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs of equal consecutive keys cut into pieces of at most `size` elements: (piece of each element, first
    element of each of the `num_pieces` pieces, its length). Invalid elements and pieces past `num_pieces`
    belong to none (piece id `num_pieces`); unused pieces have length 0 and start len(key_T)."""
    T = key_T.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    run_start = jnp.concatenate([jnp.ones((1,), jnp.bool_), key_T[1:] != key_T[:-1]])
    first_T = jax.lax.cummax(jnp.where(run_start, t, 0), axis=0)  # first element of each element's run
    new_piece = (t - first_T) % size == 0
    if valid_T is not None:
        new_piece = new_piece & valid_T
    piece_T = jnp.cumsum(new_piece.astype(jnp.int32)) - 1
    if valid_T is not None:
        piece_T = jnp.where(valid_T, piece_T, num_pieces)
    start = jnp.full((num_pieces,), T, jnp.int32).at[piece_T].min(t, mode="drop")
    length = jnp.zeros((num_pieces,), jnp.int32).at[piece_T].add(1, mode="drop")
    return piece_T, start, length


def whole_pages(pos_B: jax.Array, ok_B: jax.Array, page_size: int) -> jax.Array:
    """In-kernel: how many leading pages lie entirely at or before every valid row's position, so that every row
    sees all their keys and they need no causal mask."""
    return (jnp.min(jnp.where(ok_B, pos_B, jnp.iinfo(jnp.int32).max)) + 1) // page_size


def max_query_blocks(num_tokens: int, num_rows: int, bt: int) -> int:
    """Programs needed: sum over runs of ceil(len / bt) <= T / bt + runs, runs <= R + 1 (padding run)."""
    return max(1, min(num_tokens, num_tokens // bt + num_rows + 1))


@dataclasses.dataclass(frozen=True)
class _StepBlocks:
    token_row_T: jax.Array
    pos_T: jax.Array
    num_rows: int
    by_bt: dict[int, QueryBlocks]


_STEP: contextvars.ContextVar[_StepBlocks | None] = contextvars.ContextVar("step_query_blocks", default=None)

# Every block size a kernel may ask for (powers of two: the decode kernels' one token, the tile tables' `bt`s
# and the Mosaic kernels' tokens per block). The step computes them all; XLA drops the ones no op reads.
STEP_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def step_query_blocks(token_row_T: jax.Array, pos_T: jax.Array,
                      num_rows: int) -> contextlib.AbstractContextManager[None]:
    """Within the block, `query_blocks(token_row_T, pos_T, ...)` (these very arrays) returns the query blocks
    computed here, once, at the caller's level: a forward wraps its layer scans in it (see the module's doc)."""
    by_bt = {bt: _compute(token_row_T, pos_T, bt=bt, num_rows=num_rows) for bt in STEP_BLOCK_SIZES}
    return given_query_blocks(token_row_T, pos_T, num_rows, by_bt)


@contextlib.contextmanager
def given_query_blocks(token_row_T: jax.Array, pos_T: jax.Array, num_rows: int,
                       by_bt: dict[int, QueryBlocks]) -> Iterator[None]:
    """`step_query_blocks` with the copies already made (`by_bt`; {}: none): what a `shard_map` body uses for
    its own `token_row_T` / `pos_T`, with the step's copies handed in as operands (`step_copies`)."""
    if not by_bt:
        yield
        return
    token = _STEP.set(_StepBlocks(token_row_T, pos_T, num_rows, by_bt))
    try:
        yield
    finally:
        _STEP.reset(token)


def step_copies(token_row_T: jax.Array, pos_T: jax.Array, num_rows: int) -> dict[int, QueryBlocks]:
    """The step's query blocks when `step_query_blocks` holds them for these arrays, else none ({})."""
    step = _STEP.get()
    if step is not None and token_row_T is step.token_row_T and pos_T is step.pos_T and num_rows == step.num_rows:
        return step.by_bt
    return {}


def query_blocks(token_row_T: jax.Array, pos_T: jax.Array, *, bt: int, num_rows: int) -> QueryBlocks:
    """Split the flat batch into query blocks of <= bt tokens that never straddle two requests (the step's
    copy when `step_query_blocks` holds it for these arrays)."""
    copies = step_copies(token_row_T, pos_T, num_rows)
    if bt in copies:
        return copies[bt]
    return _compute(token_row_T, pos_T, bt=bt, num_rows=num_rows)


def _compute(token_row_T: jax.Array, pos_T: jax.Array, *, bt: int, num_rows: int) -> QueryBlocks:
    token_row_T, pos_T = jnp.asarray(token_row_T), jnp.asarray(pos_T)  # a step's host arrays, closed over
    T = token_row_T.shape[0]
    Q = max_query_blocks(T, num_rows, bt)
    t = jnp.arange(T, dtype=jnp.int32)
    if bt == 1:  # one token per block: no runs to find (and no small scatter kernels on the decode path)
        return QueryBlocks(t, jnp.ones((T,), jnp.int32), token_row_T.astype(jnp.int32), pos_T.astype(jnp.int32), t)
    qb_T, start, length = cut_runs(token_row_T, bt, Q)  # block ids >= Q are dropped (contract)
    max_pos = jnp.zeros((Q,), jnp.int32).at[qb_T].max(pos_T.astype(jnp.int32), mode="drop")
    start = jnp.minimum(start, T - 1)  # unused programs: any in-range start, length 0
    row = token_row_T.astype(jnp.int32)[start]
    return QueryBlocks(start, length, row, max_pos, qb_T)
