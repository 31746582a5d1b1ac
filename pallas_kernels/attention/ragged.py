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
"""

from __future__ import annotations

import dataclasses

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

    @property
    def num_blocks(self) -> int:
        return self.start_Q.shape[0]


def max_query_blocks(num_tokens: int, num_rows: int, bt: int) -> int:
    """Programs needed: sum over runs of ceil(len / bt) <= T / bt + runs, runs <= R + 1 (padding run)."""
    return max(1, min(num_tokens, num_tokens // bt + num_rows + 1))


def query_blocks(token_row_T: jax.Array, pos_T: jax.Array, *, bt: int, num_rows: int) -> QueryBlocks:
    """Split the flat batch into query blocks of <= bt tokens that never straddle two requests."""
    T = token_row_T.shape[0]
    Q = max_query_blocks(T, num_rows, bt)
    t = jnp.arange(T, dtype=jnp.int32)
    if bt == 1:  # one token per block: no runs to find (and no small scatter kernels on the decode path)
        return QueryBlocks(t, jnp.ones((T,), jnp.int32), token_row_T.astype(jnp.int32), pos_T.astype(jnp.int32))
    run_start = jnp.concatenate([jnp.ones((1,), jnp.bool_), token_row_T[1:] != token_row_T[:-1]])
    first_T = jax.lax.cummax(jnp.where(run_start, t, 0), axis=0)  # first token of each token's run
    new_block = (t - first_T) % bt == 0
    qb_T = jnp.cumsum(new_block.astype(jnp.int32)) - 1  # block id of each token; ids >= Q are dropped (contract)
    start = jnp.full((Q,), T, jnp.int32).at[qb_T].min(t, mode="drop")
    length = jnp.zeros((Q,), jnp.int32).at[qb_T].add(1, mode="drop")
    max_pos = jnp.zeros((Q,), jnp.int32).at[qb_T].max(pos_T.astype(jnp.int32), mode="drop")
    start = jnp.minimum(start, T - 1)  # unused programs: any in-range start, length 0
    row = token_row_T.astype(jnp.int32)[start]
    return QueryBlocks(start, length, row, max_pos)
