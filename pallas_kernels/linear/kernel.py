"""Small-M dense linear in Pallas (Triton lowering on the GPU, interpret mode on the CPU): split-K weight streaming.

Grid (row blocks x N tiles, K splits). Program (j, s) accumulates x[:, K range s] @ w[K range s, j-th bn columns]
in fp32 over `bk`-deep pipelined steps, all bm rows of x against each weight tile (the weight is read exactly once
across the grid, x once per program: it is tiny). Unsplit, it writes its tile in the output dtype; split, its fp32
partial [split, bm, N], the partials then added by XLA one after another in split order (at M <= 64 they are a few
percent of the weight's bytes and are read back from L2). Several row blocks (the batch-invariant tiles at prefill
sizes, tiles.invariant_tiles) run in groups of ROW_GROUP, each group's blocks N tile by N tile.

A split is a fixed grouping of K, so it can also run inside one program: the same partials, each from zero over
its K range, added in the same order in registers. That is what a grid with enough programs without the split
does (`_in_program`): the batch-invariant tiles keep one split at every M (their sums must not regroup with the
row count) but need it spread over programs only at decode sizes; at prefill sizes spreading it would write
split x the output in fp32 partials.

`layer`: w is a scan's whole stack [layers, K, N] and the kernel reads layer `layer`'s rows of it (a free reshape to
[layers * K, N] and a row offset), because a scan-sliced operand of a custom call is copied into a buffer of its own
every iteration: on the H200 that copy of the m3-slice's projection weights took 0.34 ms of a 2.7 ms decode step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention.tuning import NUM_SMS
from pallas_kernels.linear.tiles import LinearTiles
from pallas_kernels.moe.tiles import block_and_tile
from pallas_kernels.ordered import ordered_sum

# Row blocks that run N tile by N tile together (more than one only with the batch-invariant tiles at prefill
# sizes): their x rows stay in L2 while the weight streams past them once per group.
ROW_GROUP = 8


def _linear_kernel(row0_ref, x_ref, w_ref, o_ref, *, bm: int, bn: int, bk: int, per_split: int, split: int,
                   blocks: int, in_program: bool):
    b, j = block_and_tile(pl.program_id(0), blocks, o_ref.shape[-1] // bn, ROW_GROUP)
    n0 = pl.multiple_of(j * bn, bn)
    m0 = pl.multiple_of(b * bm, bm)
    row0 = row0_ref[0]  # the layer's first row of a stacked weight (0 when unstacked)

    def partial(s):
        """fp32 x[rows, K range s] @ w[K range s, columns], from zero, bk at a time."""
        def step(i, acc):
            k0 = pl.multiple_of((s * per_split + i) * bk, bk)
            w = w_ref[pl.ds(pl.multiple_of(row0 + k0, bk), bk), pl.ds(n0, bn)]
            # fp32 weights (the router) multiply in full fp32, not TF32: the dot XLA's reference computes.
            precision = lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
            return acc + jnp.dot(x_ref[pl.ds(m0, bm), pl.ds(k0, bk)], w, preferred_element_type=jnp.float32,
                                 precision=precision)

        return lax.fori_loop(0, per_split, step, jnp.zeros((bm, bn), jnp.float32))

    if split == 1 or in_program:
        # The split's partials in split order, as `linear` adds the spread ones (a loop, not unrolled: Triton's
        # compile time grows with the code, and the engine compiles every step shape at start-up).
        acc = lax.fori_loop(1, split, lambda s, acc: acc + partial(s), partial(0))
        o_ref[pl.ds(m0, bm), pl.ds(n0, bn)] = acc.astype(o_ref.dtype)
    else:
        o_ref[pl.program_id(1), pl.ds(m0, bm), pl.ds(n0, bn)] = partial(pl.program_id(1))


def _in_program(tiles: LinearTiles, blocks: int, n_tiles: int) -> bool:
    """Whether a split runs inside each program: when the grid already has enough programs without it."""
    return tiles.split > 1 and blocks * n_tiles >= 2 * NUM_SMS


def linear(x_MK: jax.Array, w_KN: jax.Array, *, tiles: LinearTiles, interpret: bool = False,
           layer: jax.Array | int | None = None, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x @ w in `out_dtype` (default x's dtype; fp32 accumulation), in row blocks of tiles.bm (one block at the
    small-M table's sizes; the batch-invariant tiles take any M). With `layer`, w is [layers, K, N] and x @ w[layer]
    is computed without slicing w."""
    out_dtype = x_MK.dtype if out_dtype is None else out_dtype
    M, K = x_MK.shape
    K2, N = w_KN.shape[-2:]
    if K != K2 or K % (tiles.bk * tiles.split) or w_KN.ndim != 2 + (layer is not None):
        raise ValueError(f"linear kernel: x {x_MK.shape} @ w {w_KN.shape} (layer {layer}) does not fit tiles {tiles}")
    row0 = jnp.zeros((1,), jnp.int32) if layer is None else jnp.reshape(jnp.asarray(layer, jnp.int32) * K, (1,))
    w_KN = w_KN.reshape(-1, N)
    n_out = N
    if N % tiles.bn:  # an N no tile divides (tiny configs only): zero columns up to whole tiles, cut afterwards
        N = -(-N // tiles.bn) * tiles.bn
        w_KN = jnp.pad(w_KN, ((0, 0), (0, N - n_out)))
    blocks = -(-M // tiles.bm)
    Mp = blocks * tiles.bm
    x = jnp.pad(x_MK, ((0, Mp - M), (0, 0))).astype(w_KN.dtype)
    in_program = _in_program(tiles, blocks, N // tiles.bn)
    spread = tiles.split if tiles.split > 1 and not in_program else 1
    shape = (Mp, N) if spread == 1 else (spread, Mp, N)
    out = pl.pallas_call(
        functools.partial(_linear_kernel, bm=tiles.bm, bn=tiles.bn, bk=tiles.bk,
                          per_split=K // tiles.bk // tiles.split, split=tiles.split, blocks=blocks,
                          in_program=in_program),
        out_shape=jax.ShapeDtypeStruct(shape, out_dtype if spread == 1 else jnp.float32),
        grid=(blocks * (N // tiles.bn), spread),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=interpret,
        # K x N in the name: a trace then tells the projections apart.
        name=f"linear_{K}x{N}_bm{tiles.bm}_bn{tiles.bn}_split{tiles.split}{'_in' if in_program else ''}",
    )(row0, x, w_KN)
    if spread > 1:  # one add after another, in split order: the order the in-program sum takes
        out = ordered_sum(out, axis=0)
    return out[:M, :n_out].astype(out_dtype)
