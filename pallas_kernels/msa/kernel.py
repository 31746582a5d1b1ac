"""MSA in Pallas (Triton lowering on GPU, interpret mode on CPU): index block scores + top-k, block-sparse attention.

Index scoring (m3-spec 4.2-4.3) is two stages, timed together:
1. `block_scores` (Pallas, the heavy part: it streams the whole visible index-K): one program per
   (query block, range of `bp` pages). The query block's `bt` tokens x G index heads are the M rows of one dot
   against each page's [page_size, hdi] index-K tile, so each tile is read once for all query rows of a
   request (1 + k draft rows, or `bt` rows of a prefill chunk). Scores are fp32, masked token-exactly by each
   row's own position, and max-reduced per page (= MSA block) in registers; the program writes a
   [M, bp] slab of block scores, -inf for blocks it did not see.
2. top-k over the small [T, G, P] block scores with exactly the reference's forcing of the local / init blocks
   and `lax.top_k`'s order (larger score first, equal scores by lower block index), so the block ids, their
   order and the tie resolution are the reference's whenever the block scores are equal: `topk_blocks`
   (Pallas, the default) or `select_from_block_scores` (the reference's own jnp lines).

Block-sparse attention reuses `attention.kernel.ragged_paged_attention` with a per-(query block, group) page
list: a token's own selection when blocks hold one token (decode), the union of the block's selections
otherwise, each token masked to its own pages.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention.kernel import ragged_paged_attention
from pallas_kernels.attention.ragged import QueryBlocks, query_blocks, whole_pages
from pallas_kernels.attention.tuning import AttentionTiles, IndexTiles
from pallas_kernels.msa import kernel_mgpu, sparse_mgpu
from pallas_kernels.msa.block_major import block_major_attention
from pallas_kernels.sync import when_last


@dataclasses.dataclass(frozen=True)
class _FusedTopk:
    """Static arguments of the top-k done inside the scoring kernel (IndexTiles.topk == "fused")."""

    num_splits: int
    P: int
    topk: int
    kp: int
    local_blocks: int
    init_blocks: int
    interpret: bool


def _block_scores_kernel(start_ref, length_ref, row_ref, max_pos_ref, page_table_ref, pos_ref, iq_ref, ik_ref,
                         *refs, bt: int, G: int, ps: int, bp: int, fused: _FusedTopk | None, mask_every_page: bool):
    qb, split = pl.program_id(0), pl.program_id(1)
    t0, n, row = start_ref[qb], length_ref[qb], row_ref[qb]
    P = page_table_ref.shape[1]
    M = bt * G
    D = iq_ref.shape[-1]
    b0 = split * bp
    # Pages this program scores: its range, cut at the block's last visible page.
    last = jnp.where(n > 0, jnp.minimum(max_pos_ref[qb] // ps, P - 1), -1)
    num = jnp.clip(last + 1 - b0, 0, bp)

    tok_ok_B = lax.broadcasted_iota(jnp.int32, (bt,), 0) < n
    iq_BGD = plgpu.load(iq_ref.at[pl.ds(t0, bt), :, :], mask=jnp.broadcast_to(tok_ok_B[:, None, None], (bt, G, D)),
                        other=0)
    iq_MD = iq_BGD.reshape(M, D)
    pos_B = plgpu.load(pos_ref.at[pl.ds(t0, bt)], mask=tok_ok_B, other=-1)
    pos_M = jnp.broadcast_to(pos_B[:, None], (bt, G)).reshape(M)
    col_C = lax.broadcasted_iota(jnp.int32, (bp,), 0)
    # The range's physical pages, fetched once: in-loop addresses depend on registers only, so the compiler's
    # software pipeline can prefetch the next index-K tiles (no scalar-load chain inside the loop).
    page_C = plgpu.load(page_table_ref.at[row, jnp.minimum(b0 + col_C, P - 1)])

    def body(j, best_MC, masked: bool):
        b = b0 + j
        ik_SD = ik_ref[jnp.sum(jnp.where(col_C == j, page_C, 0))]
        # fp32 accumulation; bf16 x bf16 products are exact in fp32, fp32 inputs use IEEE fp32 (no tf32).
        s_MS = lax.dot_general(iq_MD, ik_SD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if masked:
            kpos_S = b * ps + lax.broadcasted_iota(jnp.int32, (ps,), 0)
            s_MS = jnp.where(kpos_S[None, :] <= pos_M[:, None], s_MS, -jnp.inf)
        return jnp.where(col_C[None, :] == j, jnp.max(s_MS, axis=1)[:, None], best_MC)

    # Only the last page or two of a prefill block pays for the causal mask (IndexTiles.mask_every_page: all).
    whole = 0 if mask_every_page else jnp.clip(whole_pages(pos_B, tok_ok_B, ps) - b0, 0, num)
    best_MC = jnp.full((M, bp), -jnp.inf, jnp.float32)
    best_MC = lax.fori_loop(0, whole, functools.partial(body, masked=False), best_MC)
    best_MC = lax.fori_loop(whole, num, functools.partial(body, masked=True), best_MC)
    out_ref = refs[1] if fused else refs[0]
    plgpu.store(out_ref.at[pl.ds(t0, bt), :, pl.ds(b0, bp)], best_MC.reshape(bt, G, bp),
                mask=jnp.broadcast_to(tok_ok_B[:, None, None], (bt, G, bp)))
    if fused:
        _select_when_last(refs[2], refs[3], out_ref, qb, t0, tok_ok_B, pos_M, bt=bt, G=G, ps=ps, f=fused)


def _select_when_last(count_ref, ids_ref, scores_ref, qb, t0, tok_ok_B, pos_M, *, bt: int, G: int, ps: int,
                      f: _FusedTopk) -> None:
    """The last of a query block's `num_splits` programs to finish (pallas_kernels/sync.py) reads every
    program's score slab and selects the block's top-k: no second launch."""

    def select() -> None:
        M = bt * G
        wp = 1 << max(0, (f.P - 1).bit_length())
        col_C = lax.broadcasted_iota(jnp.int32, (wp,), 0)
        ok = jnp.broadcast_to(tok_ok_B[:, None, None] & (col_C < f.P)[None, None, :], (bt, G, wp))
        s_BGC = plgpu.load(scores_ref.at[pl.ds(t0, bt), :, pl.ds(0, wp)], mask=ok, other=-jnp.inf, volatile=True)
        ids_MK = _select_topk(s_BGC.reshape(M, wp), pos_M, P=f.P, ps=ps, topk=f.topk, kp=f.kp,
                              local_blocks=f.local_blocks, init_blocks=f.init_blocks)
        plgpu.store(ids_ref.at[pl.ds(t0, bt), :, :], ids_MK.reshape(bt, G, f.kp),
                    mask=jnp.broadcast_to(tok_ok_B[:, None, None], (bt, G, f.kp)))

    when_last(count_ref, qb, f.num_splits, select, interpret=f.interpret)


def block_scores(iq_TGD: jax.Array, ik_pages: jax.Array, page_table_RP: jax.Array, pos_T: jax.Array,
                 qbs: QueryBlocks, *, tiles: IndexTiles, select: dict | None = None,
                 interpret: bool = False) -> jax.Array:
    """[T, G, P'] fp32 max index score of each logical block (P' >= P, extra columns -inf); -inf = not visible.

    With `select` (topk_blocks' keyword arguments: topk, local_blocks, init_blocks) the kernel selects too and
    returns the block ids [T, G, topk] instead."""
    T, G, _ = iq_TGD.shape
    ps = ik_pages.shape[1]
    P = page_table_RP.shape[1]
    bt, bp = tiles.bt, tiles.bp
    num_splits = -(-P // bp)
    Q = qbs.num_blocks
    fused = None
    if select is not None:
        kp = 1 << max(0, (select["topk"] - 1).bit_length())
        fused = _FusedTopk(num_splits=num_splits, P=P, kp=kp, interpret=interpret, **select)
    kernel = functools.partial(_block_scores_kernel, bt=bt, G=G, ps=ps, bp=bp, fused=fused,
                               mask_every_page=tiles.mask_every_page)
    # Every column of the padded width is written (-inf where unseen), so the output needs no init.
    scores_shape = jax.ShapeDtypeStruct((T, G, num_splits * bp), jnp.float32)
    args = (qbs.start_Q, qbs.length_Q, qbs.row_Q, qbs.max_pos_Q, page_table_RP, pos_T.astype(jnp.int32), iq_TGD,
            ik_pages)
    extra = {}
    if fused:
        args = (*args, jnp.zeros((Q,), jnp.int32))  # per query block: programs done (aliased to output 1)
        out_shape = (scores_shape, jax.ShapeDtypeStruct((Q,), jnp.int32),
                     jax.ShapeDtypeStruct((T, G, fused.kp), jnp.int32))
        extra = {"input_output_aliases": {len(args) - 1: 1}}
    else:
        out_shape = scores_shape
    out = pl.pallas_call(
        kernel,
        grid=(Q, num_splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=f"msa_block_scores_bt{bt}_bp{bp}" + ("_topk" if fused else ""),
        **extra,
    )(*args)
    return out[2][..., :select["topk"]] if fused else out


def select_from_block_scores(scores_TGN: jax.Array, pos_T: jax.Array, *, block_size: int, num_blocks: int,
                             topk: int, local_blocks: int, init_blocks: int = 0) -> jax.Array:
    """The reference's selection (msa.reference.select_blocks after its block max), on [T, G, >= num_blocks]."""
    s = scores_TGN[..., :num_blocks]
    q_block = (pos_T // block_size)[:, None, None]
    b = jnp.arange(num_blocks)[None, None, :]
    forced = (b <= q_block) & ((b > q_block - local_blocks) | (b < init_blocks))
    s = jnp.where(forced, jnp.inf, s)
    k = min(topk, num_blocks)
    vals, idx = lax.top_k(s, k)
    idx = jnp.where(vals == -jnp.inf, -1, idx).astype(jnp.int32)
    if k < topk:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, topk - k)), constant_values=-1)
    return idx


def _select_topk(s_RC: jax.Array, pos_R: jax.Array, *, P: int, ps: int, topk: int, kp: int, local_blocks: int,
                 init_blocks: int) -> jax.Array:
    """[R, wp] block scores (-inf past column P) -> [R, kp] block ids, -1 padded: the reference's forcing of the
    local / init blocks, then `topk` rounds of (row max, lowest index holding it)."""
    wp = s_RC.shape[1]
    b_1C = lax.broadcasted_iota(jnp.int32, (wp,), 0)[None, :]
    qb_R1 = (pos_R // ps)[:, None]
    forced = (b_1C <= qb_R1) & ((b_1C > qb_R1 - local_blocks) | (b_1C < init_blocks)) & (b_1C < P)
    s_RC = jnp.where(forced, jnp.inf, s_RC)
    k_1K = lax.broadcasted_iota(jnp.int32, (kp,), 0)[None, :]

    def pick(j, carry):
        # lax.top_k's order: the largest score first, equal scores by the lower block index first. The picked
        # block drops to -inf; once only -inf is left every further pick is -1 (nothing visible remains).
        s_RC, out_RK = carry
        m_R = jnp.max(s_RC, axis=1)
        idx_R = jnp.min(jnp.where(s_RC == m_R[:, None], b_1C, wp), axis=1)
        sel_R = jnp.where(m_R == -jnp.inf, -1, idx_R)
        out_RK = jnp.where(k_1K == j, sel_R[:, None], out_RK)
        return jnp.where(b_1C == idx_R[:, None], -jnp.inf, s_RC), out_RK

    _, out_RK = lax.fori_loop(0, min(topk, P), pick, (s_RC, jnp.full((s_RC.shape[0], kp), -1, jnp.int32)))
    return out_RK


def _topk_kernel(*refs, rb: int, G: int, wp: int, P: int, ps: int, topk: int, kp: int, local_blocks: int,
                 init_blocks: int, block_rows: int | None):
    """`rb` rows of scores -> their ids. Token-major scores (`block_rows` None): rows r0 .. r0 + rb - 1 are the
    output's rows. Query-block-major ones (`topk_blocks`' `blocks`): a program's rows lie in one query block's
    `block_rows` (its tokens x G), and go to its tokens' rows of the token-major output; rows past the block's
    length are nobody's and are neither read nor written."""
    if block_rows is None:
        pos_ref, scores_ref, out_ref = refs
    else:
        start_ref, length_ref, pos_ref, scores_ref, out_ref = refs
    r0 = pl.program_id(0) * rb
    iota_R = lax.broadcasted_iota(jnp.int32, (rb,), 0)
    if block_rows is None:
        row_R = r0 + iota_R
        ok_R = row_R < scores_ref.shape[0]
        token_R, out0 = row_R // G, r0
    else:
        q, local_R = r0 // block_rows, r0 % block_rows + iota_R
        t0 = start_ref[q]
        ok_R = local_R // G < length_ref[q]
        token_R, out0 = t0 + local_R // G, t0 * G + r0 % block_rows

    col_C = lax.broadcasted_iota(jnp.int32, (wp,), 0)
    s_RC = plgpu.load(scores_ref.at[pl.ds(r0, rb), pl.ds(0, wp)], mask=ok_R[:, None] & (col_C < P)[None, :],
                      other=-jnp.inf)
    pos_R = plgpu.load(pos_ref.at[jnp.minimum(token_R, pos_ref.shape[0] - 1)])
    out_RK = _select_topk(s_RC, pos_R, P=P, ps=ps, topk=topk, kp=kp, local_blocks=local_blocks,
                          init_blocks=init_blocks)
    plgpu.store(out_ref.at[pl.ds(out0, rb), :], out_RK, mask=jnp.broadcast_to(ok_R[:, None], (rb, kp)))


def topk_blocks(scores_TGW: jax.Array, pos_T: jax.Array, *, block_size: int, num_blocks: int, topk: int,
                local_blocks: int, init_blocks: int = 0, interpret: bool = False, rows_per_program: int | None = None,
                num_warps: int = 4, blocks: QueryBlocks | None = None) -> jax.Array:
    """Pallas `select_from_block_scores`: the same forcing and the same ids in the same order as lax.top_k, as
    `topk` rounds of (row max, lowest index holding it) over each row held in registers. On the H200 it made the
    whole index op 28-38 us faster than `lax.top_k` at batch-64 decode (8k-128k) and 106 us at an 8k prefill.
    `rows_per_program` (default: ~2048 scores in registers) and `num_warps`: benchmarks/bench_topk.py's sweep
    (neither matters on the H100; nor did counting every column's rank at once in place of the rounds, which
    took 36-132 us against their 22 us on the H100: docs/benchmarks.md).

    `blocks`: the scores are query-block-major, as the Mosaic GPU scoring writes them ([Q * bt, G, W], slot
    q * bt + i holding token blocks.start_Q[q] + i for i < blocks.length_Q[q]), and are read so, with no gather
    back to tokens first; the ids are token-major all the same, [len(pos_T), G, topk]."""
    S, G, W = scores_TGW.shape
    T = pos_T.shape[0]
    wp = 1 << max(0, (num_blocks - 1).bit_length())
    kp = 1 << max(0, (topk - 1).bit_length())
    rb = rows_per_program or max(1, min(64, 2048 // wp))
    block_rows, lead = None, ()
    if blocks is not None:
        block_rows = S // blocks.num_blocks * G  # a query block's rows; a program's rows stay in one block
        rb = math.gcd(rb, block_rows)
        lead = (blocks.start_Q, blocks.length_Q)
    kernel = functools.partial(_topk_kernel, rb=rb, G=G, wp=wp, P=num_blocks, ps=block_size, topk=topk, kp=kp,
                               local_blocks=local_blocks, init_blocks=init_blocks, block_rows=block_rows)
    out = pl.pallas_call(
        kernel,
        grid=(-(-(S * G) // rb),),
        out_shape=jax.ShapeDtypeStruct((T * G, kp), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"msa_topk_rb{rb}" + ("" if blocks is None else "_qb"),
    )(*lead, pos_T.astype(jnp.int32), scores_TGW.reshape(S * G, W))
    return out.reshape(T, G, kp)[..., :topk]


def paged_select_blocks(iq_TGD: jax.Array, ik_pages: jax.Array, page_table_RP: jax.Array, token_row_T: jax.Array,
                        pos_T: jax.Array, *, topk: int, local_blocks: int, init_blocks: int = 0,
                        tiles: IndexTiles, interpret: bool = False) -> jax.Array:
    """Kernel version of `msa.reference.paged_select_blocks`: logical block ids [T, G, topk], -1 padded."""
    sel = {"topk": topk, "local_blocks": local_blocks, "init_blocks": init_blocks} if tiles.topk == "fused" else None
    pallas_topk = functools.partial(topk_blocks, block_size=ik_pages.shape[1], num_blocks=page_table_RP.shape[1],
                                    topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
                                    interpret=interpret)
    if tiles.backend == "mosaic" and tiles.topk == "pallas":  # the top-k reads the kernel's block-major rows
        scores, qbs = kernel_mgpu.block_major_scores(iq_TGD, ik_pages, page_table_RP, token_row_T, pos_T,
                                                     bp=tiles.bp, stages=tiles.num_stages, interpret=interpret)
        return pallas_topk(scores, pos_T, blocks=qbs)
    if tiles.backend == "mosaic":
        scores = kernel_mgpu.block_scores(iq_TGD, ik_pages, page_table_RP, token_row_T, pos_T, bp=tiles.bp,
                                          stages=tiles.num_stages, select=sel, interpret=interpret)
    else:
        qbs = query_blocks(token_row_T, pos_T, bt=tiles.block_tokens or tiles.bt, num_rows=page_table_RP.shape[0])
        scores = block_scores(iq_TGD, ik_pages, page_table_RP, pos_T, qbs, tiles=tiles, select=sel,
                              interpret=interpret)
    if sel is not None:
        return scores  # given `select`, either scoring kernel returned the selected ids instead
    if tiles.topk == "pallas":
        return pallas_topk(scores, pos_T)
    return select_from_block_scores(scores, pos_T, block_size=ik_pages.shape[1], num_blocks=page_table_RP.shape[1],
                                    topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)


_NO_BLOCK = jnp.iinfo(jnp.int32).max  # sorts after every real block id


def _query_block_selections(blocks_TGN: jax.Array, qbs: QueryBlocks, bt: int) -> jax.Array:
    """[Q, G, bt * N]: the selected blocks of each query block's tokens per group, _NO_BLOCK for -1 and padding."""
    T, G, N = blocks_TGN.shape
    tok_QB = qbs.start_Q[:, None] + jnp.arange(bt, dtype=jnp.int32)[None, :]
    ok_QB = jnp.arange(bt)[None, :] < qbs.length_Q[:, None]
    blk_QBGN = blocks_TGN[jnp.minimum(tok_QB, T - 1)]
    blk_QBGN = jnp.where(ok_QB[:, :, None, None] & (blk_QBGN >= 0), blk_QBGN, _NO_BLOCK)
    return blk_QBGN.transpose(0, 2, 1, 3).reshape(-1, G, bt * N)


def union_page_lists(blocks_TGN: jax.Array, qbs: QueryBlocks, bt: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per (query block, group): the sorted distinct selected blocks of its tokens [Q, G, bt * N] (padded with a
    sentinel), their owners (bit i set when the block's token i selected the entry; 0 on the sentinel) and
    their count [Q, G]. Duplicates and -1 go, so each page is read once per program; the owner bits let a kernel
    mask a token's rows by one bit test instead of searching the token's own selection. Two sorts: of (block,
    token) keys, then of each block's run folded into its first entry as (block, owner bits)."""
    sel_QGL = _query_block_selections(blocks_TGN, qbs, bt)  # entry j holds token j // N's selection
    N = sel_QGL.shape[-1] // bt
    tok_L = jnp.arange(bt * N, dtype=jnp.int32) // N
    tb = max(1, (bt - 1).bit_length())  # bits of a token index
    key = jnp.sort(jnp.where(sel_QGL == _NO_BLOCK, _NO_BLOCK, (sel_QGL << tb) | tok_L), axis=-1)
    real = key != _NO_BLOCK
    blk = jnp.where(real, key >> tb, _NO_BLOCK)
    bit = jnp.where(real, 1 << (key & ((1 << tb) - 1)), 0)
    # A token selects a block at most once, so a block's run is at most bt entries long: OR the next bt - 1.
    owners = bit
    for d in range(1, bt):
        nxt_blk = jnp.pad(blk[..., d:], [(0, 0), (0, 0), (0, d)], constant_values=_NO_BLOCK)
        nxt_bit = jnp.pad(bit[..., d:], [(0, 0), (0, 0), (0, d)])
        owners = owners | jnp.where(nxt_blk == blk, nxt_bit, 0)
    first = real & jnp.concatenate([jnp.ones_like(blk[..., :1], jnp.bool_), blk[..., 1:] != blk[..., :-1]], -1)
    key = jnp.sort(jnp.where(first, (blk << bt) | owners, _NO_BLOCK), axis=-1)
    real = key != _NO_BLOCK
    return (jnp.where(real, key >> bt, _NO_BLOCK), jnp.where(real, key & ((1 << bt) - 1), 0),
            jnp.sum(real, axis=-1).astype(jnp.int32))


def paged_block_sparse_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                 page_table_RP: jax.Array, token_row_T: jax.Array, pos_T: jax.Array,
                                 blocks_TGN: jax.Array, *, scale: float, tiles: AttentionTiles,
                                 interpret: bool = False, heads_major: bool = False) -> jax.Array:
    """Kernel version of `msa.reference.paged_block_sparse_attention`. A token's selected ids are distinct apart
    from -1 padding (what `paged_select_blocks` produces); with one token per program duplicates are not merged.
    `heads_major`: pages laid out [pages, K, page_size, hd] (an experiment against KVPages' layout).

    `tiles.block_major` picks the KV-block-major kernel, else query blocks over their tokens' union of pages
    (`tiles.backend`: the Triton kernel or the Mosaic GPU one, msa/sparse_mgpu.py).
    The tiles choose, never the device: a choice by the selections' overlap would need a conditional, whose
    predicate the GPU runtime reads back on the host (tuning.sparse_tiles)."""
    blocks_TGN = blocks_TGN.astype(jnp.int32)
    kv = (q_THD, k_pages, v_pages, page_table_RP)

    if tiles.block_major:
        return block_major_attention(*kv, token_row_T, pos_T, blocks_TGN, scale=scale, tiles=tiles,
                                     interpret=interpret)
    if tiles.backend == "mosaic":  # the union of pages on Mosaic GPU, query blocks of one of its two sizes
        hg = q_THD.shape[1] // k_pages.shape[2]
        shared = sparse_mgpu.shared_form(tiles.bt, hg)  # two warpgroups' tokens on one page stream
        bt = sparse_mgpu.tokens_per_block(hg, shared)
        qbs = query_blocks(token_row_T, pos_T, bt=bt, num_rows=page_table_RP.shape[0])
        call = sparse_mgpu.paged_shared_union_attention if shared else sparse_mgpu.paged_union_attention
        return call(*kv, pos_T, qbs, *union_page_lists(blocks_TGN, qbs, bt), scale,
                    key_tile=tiles.key_tile or k_pages.shape[1], stages=tiles.num_stages, interpret=interpret)
    qbs = query_blocks(token_row_T, pos_T, bt=tiles.bt, num_rows=page_table_RP.shape[0])

    def union(page_list: jax.Array, count: jax.Array, per_token: jax.Array | None) -> jax.Array:
        return ragged_paged_attention(*kv, pos_T, qbs, scale=scale, tiles=tiles, page_list_QGL=page_list,
                                      count_QG=count, blocks_TGN=per_token, interpret=interpret,
                                      heads_major=heads_major)

    if tiles.bt == 1:
        # One token per program and query block q == token q: the selection itself is the page list
        # (-1 entries are masked in the kernel), no sort needed on the decode path.
        T, G, N = blocks_TGN.shape
        assert qbs.num_blocks == T
        return union(blocks_TGN, jnp.full((T, G), N, jnp.int32), None)
    page_list, _, count = union_page_lists(blocks_TGN, qbs, tiles.bt)
    return union(page_list, count, blocks_TGN)
