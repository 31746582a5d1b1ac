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

Several weights of one K run as one launch (`linear_many`): the grid covers all their output tiles, and each
program streams the weight its tile belongs to, so the small ones (a layer's k and v, 512 columns) do not pay a
launch and a tail of their own.

`layer`: w is a scan's whole stack [layers, K, N] and the kernel reads layer `layer`'s rows of it (a free reshape to
[layers * K, N] and a row offset), because a scan-sliced operand of a custom call is copied into a buffer of its own
every iteration: on the H200 that copy of the m3-slice's projection weights took 0.34 ms of a 2.7 ms decode step.
"""

from __future__ import annotations

import functools
import itertools

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


def _linear_kernel(row0_ref, x_ref, *refs, bm: int, bn: int, bk: int, per_split: int, split: int, blocks: int,
                   in_program: bool, first_tiles: tuple[int, ...]):
    """refs: the weights, then their outputs. Output tile j of the grid is weight i's tile j - first_tiles[i]."""
    w_refs, o_refs = refs[:len(refs) // 2], refs[len(refs) // 2:]
    b, j = block_and_tile(pl.program_id(0), blocks, first_tiles[-1], ROW_GROUP)
    s_id = pl.program_id(1)  # read here: interpret mode does not see a program id inside pl.when's branch
    m0 = pl.multiple_of(b * bm, bm)
    row0 = row0_ref[0]  # the layer's first row of a stacked weight (0 when unstacked)

    def tile(w_ref, o_ref, first):
        n0 = pl.multiple_of((j - first) * bn, bn)

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
            o_ref[s_id, pl.ds(m0, bm), pl.ds(n0, bn)] = partial(s_id)

    if len(w_refs) == 1:
        tile(w_refs[0], o_refs[0], 0)
    else:
        for w_ref, o_ref, first, end in zip(w_refs, o_refs, first_tiles, first_tiles[1:], strict=False):
            pl.when((j >= first) & (j < end))(functools.partial(tile, w_ref, o_ref, first))


def _in_program(tiles: LinearTiles, blocks: int, n_tiles: int) -> bool:
    """Whether a split runs inside each program: when the grid already has enough programs without it."""
    return tiles.split > 1 and blocks * n_tiles >= 2 * NUM_SMS


def linear(x_MK: jax.Array, w_KN: jax.Array, *, tiles: LinearTiles, interpret: bool = False,
           layer: jax.Array | int | None = None, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x @ w in `out_dtype` (default x's dtype; fp32 accumulation), in row blocks of tiles.bm (one block at the
    small-M table's sizes; the batch-invariant tiles take any M). With `layer`, w is [layers, K, N] and x @ w[layer]
    is computed without slicing w."""
    return linear_many(x_MK, [w_KN], tiles=tiles, interpret=interpret, layer=layer, out_dtype=out_dtype)[0]


def linear_many(x_MK: jax.Array, ws_KN: list[jax.Array], *, tiles: LinearTiles, interpret: bool = False,
                layer: jax.Array | int | None = None, out_dtype: jnp.dtype | None = None) -> list[jax.Array]:
    """[x @ w for w in ws_KN] in one launch: the grid runs every weight's output tiles, so a small weight (k and v,
    512 columns) streams beside a large one instead of paying a launch and a tail of its own. Each column's sum is
    the tiles' K order, whatever the other weights are. The weights share K (and `layer`: stacks of one depth)."""
    out_dtype = x_MK.dtype if out_dtype is None else out_dtype
    M, K = x_MK.shape
    stacked = layer is not None
    for w in ws_KN:
        if w.shape[-2] != K or K % (tiles.bk * tiles.split) or w.ndim != 2 + stacked:
            raise ValueError(f"linear kernel: x {x_MK.shape} @ w {w.shape} (layer {layer}) does not fit tiles {tiles}")
    row0 = jnp.zeros((1,), jnp.int32) if layer is None else jnp.reshape(jnp.asarray(layer, jnp.int32) * K, (1,))
    n_outs = [w.shape[-1] for w in ws_KN]
    # An N no tile divides (tiny configs only): zero columns up to whole tiles, cut afterwards.
    ns = [-(-n // tiles.bn) * tiles.bn for n in n_outs]
    ws = [jnp.pad(w.reshape(-1, n), ((0, 0), (0, np_ - n))) if np_ != n else w.reshape(-1, n)
          for w, n, np_ in zip(ws_KN, n_outs, ns, strict=True)]
    first_tiles = (0, *itertools.accumulate(n // tiles.bn for n in ns))
    blocks = -(-M // tiles.bm)
    Mp = blocks * tiles.bm
    x = jnp.pad(x_MK, ((0, Mp - M), (0, 0))).astype(ws[0].dtype)
    in_program = _in_program(tiles, blocks, first_tiles[-1])
    spread = tiles.split if tiles.split > 1 and not in_program else 1
    out_shapes = [jax.ShapeDtypeStruct((Mp, n) if spread == 1 else (spread, Mp, n),
                                       out_dtype if spread == 1 else jnp.float32) for n in ns]
    outs = pl.pallas_call(
        functools.partial(_linear_kernel, bm=tiles.bm, bn=tiles.bn, bk=tiles.bk,
                          per_split=K // tiles.bk // tiles.split, split=tiles.split, blocks=blocks,
                          in_program=in_program, first_tiles=first_tiles),
        out_shape=out_shapes,
        grid=(blocks * first_tiles[-1], spread),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=interpret,
        # K x N in the name: a trace then tells the projections apart.
        name=f"linear_{K}x{'+'.join(map(str, ns))}_bm{tiles.bm}_bn{tiles.bn}_split{tiles.split}"
             f"{'_in' if in_program else ''}",
    )(row0, x, *ws)
    if spread > 1:  # one add after another, in split order: the order the in-program sum takes
        outs = [ordered_sum(o, axis=0) for o in outs]
    return [o[:M, :n].astype(out_dtype) for o, n in zip(outs, n_outs, strict=True)]
