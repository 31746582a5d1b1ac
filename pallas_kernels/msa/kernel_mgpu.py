"""MSA index block scores for prefill-sized steps on Mosaic GPU: warp-specialised, TMA-fed wgmma.

Same scores as `kernel.block_scores` (the Triton kernel): per token, index head and logical block, the max over
the block's visible keys of q . k in fp32, -inf where the block is not visible. Why a second backend: at an 8k
prefill chunk the Triton scoring runs at ~1.9x its compute floor, waiting for each page's dot before reducing it;
here one warpgroup streams the index-K pages by TMA while two compute warpgroups each reduce one page's scores
beside the other's matrix work.

One program per (query block of 2 x 64 / index heads tokens, range of `bp` pages). Compute warpgroup w takes
tokens w * 64 / G .. of the block, whose G index heads each are its 64 wgmma rows; consecutive tokens' rows are
consecutive rows of iq viewed [T * G, hdi], so one TMA copy loads them (iq is padded by one block of tokens so
that a block at the end never reads past it). Each step is one page: S = q k^T [64, page_size], masked by each
row's own position on pages not every row sees whole, max-reduced per row into column j of a register tile as
wide as a page's scores (so the maxima broadcast back in the scores' own layout). Its first `bp` columns go out
through shared memory in one copy to the program's own rows of a block-major output [query blocks x rows, P']
(a warpgroup's rows past the block's end would be another program's tokens); the Pallas top-k reads those rows
as they are (`block_major_scores`), and `block_scores` gathers them back to tokens for any other reader.
With the top-k fused (every page of a row in one program), each compute warpgroup selects from that register tile
itself, rounds of a row max and the lowest column holding it, and only the block ids go out (32 int32 columns).
The kernel runs under Mosaic GPU's Lane semantics: Warpgroup-semantics layout inference finds no layouts for it.

Interpret mode: `plgpu.InterpretGPUParams` (jax's GPU interpreter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.kernel_mgpu import NO_ROW, WG_ROWS, heaviest_first, per_row, row_positions, stream_pages
from pallas_kernels.attention.ragged import QueryBlocks, query_blocks


def tokens_per_block(index_heads: int) -> int:
    return 2 * (WG_ROWS // index_heads)


def supports(index_heads: int, index_dim: int, page_size: int, bp: int) -> bool:
    return (WG_ROWS % index_heads == 0 and index_dim % 64 == 0 and page_size % 64 == 0 and page_size <= 256
            and bp % 32 == 0 and bp <= page_size)


def _swizzled_32bit(cols: int) -> tuple:
    swizzle = plgpu.find_swizzle(cols * 32)
    return plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle)


def _kernel(start_ref, length_ref, row_ref, max_pos_ref, page_table_ref, pos_ref, iq_ref, ik_ref, o_ref, scoped,
            *, G: int, ps: int, bp: int, stages: int, T: int, select: dict | None):
    (q_smem2, k_smem, out_smem2), (k_loaded, q_loaded), k_used = scoped
    qb, split, wg = heaviest_first(start_ref.shape[0]), lax.axis_index("split"), lax.axis_index("wg")
    P = page_table_ref.shape[1]
    t0, n, row = start_ref[qb], length_ref[qb], row_ref[qb]
    b0 = split * bp
    last = jnp.where(n > 0, jnp.minimum(max_pos_ref[qb] // ps, P - 1), -1)
    num_steps = jnp.clip(last + 1 - b0, 0, bp)  # this program's pages: b0 .. b0 + num_steps - 1

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        tpw = WG_ROWS // G
        first = wg * tpw
        q = q_smem2.at[wg]
        plgpu.copy_gmem_to_smem(iq_ref.at[pl.ds((t0 + first) * G, WG_ROWS)], q, q_loaded.at[wg])

        pos_row, min_pos = row_positions(pos_ref, t0, first, n, rows_per_token=G, cols=ps, num_tokens=T)
        # Pages that every valid row sees whole, counted from b0.
        whole = jnp.where(min_pos == NO_ROW, 0, jnp.clip((min_pos + 1) // ps - b0, 0, num_steps))
        plgpu.barrier_wait(q_loaded.at[wg])

        # Column j < bp holds page b0 + j's scores; the tile is as wide as a page's scores so that the per-row
        # maxima broadcast into it in the scores' own layout (the columns past bp stay -inf and are not stored).
        col = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, ps), 1, layout=plgpu.Layout.WGMMA)
        best = plgpu.layout_cast(jnp.full((WG_ROWS, ps), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA)

        def step(j, best, masked: bool):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_loaded.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, ps), jnp.float32))
            plgpu.barrier_arrive(k_used.at[slot])
            if masked:  # key positions of page b0 + j: the column iota, offset
                s = jnp.where(col + (b0 + j) * ps <= per_row(pos_row, ps), s, -jnp.inf)
            return jnp.where(col == j, per_row(s.max(axis=1), ps), best)

        best = lax.fori_loop(0, whole, functools.partial(step, masked=False), best)
        best = lax.fori_loop(whole, num_steps, functools.partial(step, masked=True), best)

        out = out_smem2.at[wg]
        if select is None:
            out[...] = best[:, :bp]
        else:
            out[...] = _select(best, col, pos_row, width=out.shape[1], ps=ps, P=P, **select)
        plgpu.commit_smem()
        # The program's own rows of the block-major output (rows of tokens past the block's end are unused).
        plgpu.copy_smem_to_gmem(out, o_ref.at[pl.ds((qb * 2 + wg) * WG_ROWS, WG_ROWS),
                                              pl.ds(b0, out.shape[1])])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load(j, slot):
            page = page_table_ref[row, b0 + j]
            plgpu.copy_gmem_to_smem(ik_ref.at[page], k_smem.at[slot], k_loaded.at[slot])

        stream_pages(load, num_steps, stages, (k_used,))


def _select(s, col, pos_row, *, width: int, ps: int, P: int, topk: int, local_blocks: int, init_blocks: int):
    """In registers, the whole row's block scores [64, ps] (every page in this program) -> block ids [64, width],
    -1 padded (columns past topk unused): `msa.kernel._select_topk`'s forcing and order (largest first, equal
    scores by the lower block), as rounds of a row max and the lowest column holding it. Page b holds keys
    b * ps .. (b + 1) * ps - 1, so the page-space tests of the reference read here as key-space tests on the row's
    position (no division): b <= pos // ps is b * ps <= pos, and b > pos // ps - L is (b + L) * ps > pos."""
    pos = per_row(pos_row, ps)  # -1 for rows past the block's end: nothing forced
    start = col * ps
    forced = (start <= pos) & ((start + local_blocks * ps > pos) | (col < init_blocks)) & (col < P)
    s = jnp.where(forced, jnp.inf, s)
    # The picks come out largest first, so the first `visible` of them are the visible blocks.
    visible = per_row(jnp.sum(jnp.where(s > -jnp.inf, 1, 0), axis=1), width)
    # The ids' own narrow tile (not page-wide): fewer registers live beside the scores through the rounds.
    out_col = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, width), 1, layout=plgpu.Layout.WGMMA)
    ids = plgpu.layout_cast(jnp.full((WG_ROWS, width), -1, jnp.int32), plgpu.Layout.WGMMA)
    for j in range(min(topk, P)):
        pick = jnp.min(jnp.where(s == per_row(s.max(axis=1), ps), col, ps), axis=1)
        ids = jnp.where((out_col == j) & (visible > j), per_row(pick, width), ids)
        s = jnp.where(col == per_row(pick, ps), -jnp.inf, s)
    return ids


def block_scores(iq_TGD: jax.Array, ik_pages: jax.Array, page_table_RP: jax.Array, token_row_T: jax.Array,
                 pos_T: jax.Array, *, bp: int, stages: int, select: dict | None = None,
                 interpret: bool = False) -> jax.Array:
    """[T, G, P'] fp32 (P' = bp x splits >= P): `kernel.block_scores`' result, over query blocks of
    `tokens_per_block(G)` tokens. With `select` (`kernel.topk_blocks`' keyword arguments: topk, local_blocks,
    init_blocks) each program selects too and the result is the block ids [T, G, topk]: one launch, no scores
    through memory; every page of a row must then be one program's (bp >= the page table's width)."""
    out, qbs = block_major_scores(iq_TGD, ik_pages, page_table_RP, token_row_T, pos_T, bp=bp, stages=stages,
                                  select=select, interpret=interpret)
    # Token t's rows: its offset in its query block.
    T, bt = pos_T.shape[0], tokens_per_block(iq_TGD.shape[1])
    t = jnp.arange(T, dtype=jnp.int32)
    out = out[qbs.block_T * bt + t - qbs.start_Q[qbs.block_T]]
    return out if select is None else out[..., :select["topk"]]


def block_major_scores(iq_TGD: jax.Array, ik_pages: jax.Array, page_table_RP: jax.Array, token_row_T: jax.Array,
                       pos_T: jax.Array, *, bp: int, stages: int, select: dict | None = None,
                       interpret: bool = False) -> tuple[jax.Array, QueryBlocks]:
    """`block_scores` as the kernel writes it, query-block-major: [Q * bt, G, P'] (slot q * bt + i holds token
    qbs.start_Q[q] + i for i < qbs.length_Q[q]; the other slots are nobody's), and the query blocks (bt =
    `tokens_per_block(G)`). `kernel.topk_blocks(..., blocks=qbs)` reads it so, with no gather back to tokens."""
    T, G, Di = iq_TGD.shape
    ps = ik_pages.shape[1]
    P = page_table_RP.shape[1]
    if not supports(G, Di, ps, bp) or stages < 2:
        raise ValueError(f"the Mosaic GPU index scoring takes index heads dividing 64, index and page dims in "
                         f"multiples of 64 (pages up to 256), bp a multiple of 32 up to the page size, 2+ "
                         f"stages: got G={G}, hdi={Di}, page={ps}, bp={bp}, stages={stages}")
    # Selected ids go out 32 columns at a time (one 128-byte swizzled row of int32), from a page-wide tile.
    width = bp if select is None else 32 * -(-select["topk"] // 32)
    if select is not None and bp < P:
        raise ValueError(f"the Mosaic GPU index scoring selects inside the kernel only when one program sees every "
                         f"page of a row: {P} pages > bp {bp}; raise bp or take the top-k as its own launch")
    if width > ps:
        raise ValueError(f"the Mosaic GPU index scoring's own top-k holds at most a page's width of ids: top-k "
                         f"{select['topk']} > page size {ps}")
    bt = tokens_per_block(G)
    qbs = query_blocks(token_row_T, pos_T, bt=bt, num_rows=page_table_RP.shape[0])
    num_splits = -(-P // bp)
    # Padding tokens up to a whole number of blocks, plus one block: a warpgroup's 64 rows are one copy even at
    # the end of the batch, and the rows are a multiple of the TMA's 8-row tile (T * G need not be: T = 921).
    padded = bt * (-(-T // bt) + 1)
    iq = jnp.pad(iq_TGD, ((0, padded - T), (0, 0), (0, 0))).reshape(padded * G, Di)
    dt = iq.dtype
    out_dtype = jnp.float32 if select is None else jnp.int32
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [plgpu.SMEM((2, WG_ROWS, Di), dt, transforms=tiled),
               plgpu.SMEM((stages, ps, Di), dt, transforms=tiled),
               plgpu.SMEM((2, WG_ROWS, width), out_dtype, transforms=_swizzled_32bit(width))]

    def entry(*refs):
        pl.run_scoped(
            lambda *scoped: _kernel(*refs, scoped, G=G, ps=ps, bp=bp, stages=stages, T=T, select=select),
            scratch,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=2)),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            collective_axes="wg",
        )

    entry.__name__ = entry.__qualname__ = "msa_block_scores_mgpu" + ("_topk" if select else "")
    Q = qbs.num_blocks
    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((Q * bt * G, num_splits * width), out_dtype),
        grid=(qbs.num_blocks, num_splits), grid_names=("qb", "split"),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(qbs.start_Q, qbs.length_Q, qbs.row_Q, qbs.max_pos_Q, page_table_RP.astype(jnp.int32),
      pos_T.astype(jnp.int32), iq, ik_pages)
    return out.reshape(Q * bt, G, num_splits * width), qbs
