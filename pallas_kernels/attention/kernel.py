"""Ragged paged attention in Pallas (Triton lowering on GPU, interpret mode on CPU): dense and block-sparse.

One program per (query block, KV group, page split). A query block is up to `bt` tokens of one request
(`ragged.QueryBlocks`); its `bt * heads_per_group` query heads form the M rows of every dot, so one page of K/V
read from HBM serves all of them. The program walks a list of pages with an online softmax in fp32:

- dense: pages 0 .. max_pos // page_size of the request (the causal prefix),
- sparse: the KV group's selected logical blocks (`page_list`), masked per token by its own selection when the
  block holds several tokens.

Token-exact causal masking (key position <= the token's position), so the partial local page and prefill chunks
need no special case; dense programs skip the mask on the leading pages that every row of the block sees whole
(all but one or two pages of a prefill block). The softmax runs in base 2 with the scale folded into one fused
multiply-add per score (p = 2^(c s - c m), c = scale * log2 e): one MUFU.EX2 where `exp` costs about eight
instructions (offline sm_90 build of the dense prefill loop: 1,273 -> 732 instructions per thread and page; on
the H200 the 8k prefill went from 3.73 to 3.28 ms). Long page lists are split across programs
(flash-decoding); the partial (acc, max, sum) of the splits are merged in jnp. A row that sees no key returns
zeros, as the reference does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import kernel_mgpu
from pallas_kernels.attention.ragged import QueryBlocks, query_blocks, whole_pages
from pallas_kernels.attention.tuning import AttentionTiles, pow2_at_least

# Finite start for the running max: exp(M_INIT - m) underflows to 0 for any real score, and a fully masked
# page keeps m = M_INIT with p = exp(-inf) = 0 instead of producing exp(-inf - -inf) = NaN.
M_INIT = -1e30
LOG2E = 1.4426950408889634


def _attention_kernel(start_ref, length_ref, row_ref, max_pos_ref, count_ref, page_table_ref, pos_ref, q_ref,
                      k_ref, v_ref, list_ref, blocks_ref, *out_refs, bt: int, hg: int, ps: int, per_split: int,
                      num_splits: int, scale: float, sparse: bool, per_token_check: bool, kt: int,
                      heads_major: bool, mask_every_page: bool = False):
    qb, g, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t0, n, row = start_ref[qb], length_ref[qb], row_ref[qb]
    P = page_table_ref.shape[1]
    M = bt * hg
    D = q_ref.shape[-1]

    tok_ok_B = lax.broadcasted_iota(jnp.int32, (bt,), 0) < n
    q_BHD = plgpu.load(q_ref.at[pl.ds(t0, bt), pl.ds(g * hg, hg), :],
                       mask=jnp.broadcast_to(tok_ok_B[:, None, None], (bt, hg, D)), other=0)
    q_MD = q_BHD.reshape(M, D)
    pos_B = plgpu.load(pos_ref.at[pl.ds(t0, bt)], mask=tok_ok_B, other=-1)  # -1: padding rows see nothing
    pos_M = jnp.broadcast_to(pos_B[:, None], (bt, hg)).reshape(M)

    if sparse:
        num_entries = count_ref[qb, g]
        if per_token_check:
            # Several tokens share the program: each attends only to the pages it selected itself. The
            # selections are loaded as a [bt, N'] tile, N' = top-k rounded up to a power of two (Triton tiles);
            # the extra columns read as -1, which no page matches, so any top-k gives the same masks.
            N = blocks_ref.shape[-1]
            n_sel = pow2_at_least(N)
            sel_ok_BN = tok_ok_B[:, None] & (lax.broadcasted_iota(jnp.int32, (n_sel,), 0) < N)[None, :]
            sel_BN = plgpu.load(blocks_ref.at[pl.ds(t0, bt), g, pl.ds(0, n_sel)], mask=sel_ok_BN, other=-1)
    else:
        num_entries = jnp.where(n > 0, jnp.minimum(max_pos_ref[qb] // ps + 1, P), 0)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, num_entries)

    # This split's logical blocks and physical pages, fetched once before the loop: the K/V addresses inside
    # the loop then depend on registers only (no scalar-load chain list -> page table -> K), which is what
    # lets the compiler's software pipeline prefetch the next pages.
    entry_E = lo + lax.broadcasted_iota(jnp.int32, (per_split,), 0)
    if sparse:
        blk_E = plgpu.load(list_ref.at[qb, g, pl.ds(lo, per_split)], mask=entry_E < num_entries, other=-1)
    else:
        blk_E = entry_E
    valid_E = (blk_E >= 0) & (entry_E < num_entries)  # -1 selection padding: masked, not branched on
    blk_E = jnp.clip(blk_E, 0, P - 1)
    page_E = plgpu.load(page_table_ref.at[row, blk_E])
    col_E = lax.broadcasted_iota(jnp.int32, (per_split,), 0)

    steps = ps // kt  # key tiles per page: a smaller tile halves the shared memory of each pipeline stage
    c = scale * LOG2E  # the running max m stays in raw score units; p = 2^(c s - c m)

    def body(u, carry, masked: bool):
        acc_MD, m_M, l_M = carry
        here_E = col_E == u // steps - lo
        blk = jnp.sum(jnp.where(here_E, blk_E, 0))
        page = jnp.sum(jnp.where(here_E, page_E, 0))
        k0 = (u % steps) * kt
        if heads_major:  # [pages, K, page_size, hd]: a (page, group) tile is one contiguous block
            k_SD = k_ref[page, g, pl.ds(k0, kt), :]
            v_SD = v_ref[page, g, pl.ds(k0, kt), :]
        else:  # KVPages' [pages, page_size, K, hd]: page_size rows of hd, K * hd apart
            k_SD = k_ref[page, pl.ds(k0, kt), g, :]
            v_SD = v_ref[page, pl.ds(k0, kt), g, :]
        s_MS = lax.dot_general(q_MD, k_SD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if masked:
            valid = jnp.max(jnp.where(here_E & valid_E, 1, 0)) > 0
            kpos_S = blk * ps + k0 + lax.broadcasted_iota(jnp.int32, (kt,), 0)
            mask_MS = (kpos_S[None, :] <= pos_M[:, None]) & valid
            if per_token_check:
                mine_B = jnp.max(jnp.where(sel_BN == blk, 1, 0), axis=1) > 0
                mask_MS = mask_MS & jnp.broadcast_to(mine_B[:, None], (bt, hg)).reshape(M)[:, None]
            s_MS = jnp.where(mask_MS, s_MS, -jnp.inf)
        m_new = jnp.maximum(m_M, jnp.max(s_MS, axis=1))
        alpha = jnp.exp2((m_M - m_new) * c)
        p_MS = jnp.exp2(s_MS * c - (m_new * c)[:, None])
        l_new = l_M * alpha + jnp.sum(p_MS, axis=1)
        acc_new = acc_MD * alpha[:, None] + jnp.dot(p_MS.astype(v_SD.dtype), v_SD,
                                                     preferred_element_type=jnp.float32)
        return acc_new, m_new, l_new

    init = (jnp.zeros((M, D), jnp.float32), jnp.full((M,), M_INIT, jnp.float32), jnp.zeros((M,), jnp.float32))
    end = jnp.maximum(hi, lo)
    if sparse:  # selections come in any order: every page is checked
        acc_MD, m_M, l_M = lax.fori_loop(lo * steps, end * steps, functools.partial(body, masked=True), init)
    else:
        # Pages 0 .. whole-1 lie entirely at or before the block's first position: every row sees all their keys.
        whole = lo if mask_every_page else jnp.clip(whole_pages(pos_B, tok_ok_B, ps), lo, end)
        carry = lax.fori_loop(lo * steps, whole * steps, functools.partial(body, masked=False), init)
        acc_MD, m_M, l_M = lax.fori_loop(whole * steps, end * steps, functools.partial(body, masked=True), carry)
    m_M = m_M * scale  # natural-log units for the split merge (exp(m_split - m)), as l and acc are

    out_mask_BHD = jnp.broadcast_to(tok_ok_B[:, None, None], (bt, hg, D))
    if num_splits == 1:
        (o_ref,) = out_refs
        o_MD = acc_MD / jnp.where(l_M > 0, l_M, 1.0)[:, None]
        plgpu.store(o_ref.at[pl.ds(t0, bt), pl.ds(g * hg, hg), :], o_MD.reshape(bt, hg, D).astype(o_ref.dtype),
                    mask=out_mask_BHD)
    else:
        acc_ref, m_ref, l_ref = out_refs
        plgpu.store(acc_ref.at[split, pl.ds(t0, bt), pl.ds(g * hg, hg), :], acc_MD.reshape(bt, hg, D),
                    mask=out_mask_BHD)
        stat_mask = jnp.broadcast_to(tok_ok_B[:, None], (bt, hg))
        plgpu.store(m_ref.at[split, pl.ds(t0, bt), pl.ds(g * hg, hg)], m_M.reshape(bt, hg), mask=stat_mask)
        plgpu.store(l_ref.at[split, pl.ds(t0, bt), pl.ds(g * hg, hg)], l_M.reshape(bt, hg), mask=stat_mask)


def ragged_paged_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table_RP: jax.Array,
                           pos_T: jax.Array, qbs: QueryBlocks, *, scale: float, tiles: AttentionTiles,
                           page_list_QGL: jax.Array | None = None, count_QG: jax.Array | None = None,
                           blocks_TGN: jax.Array | None = None, interpret: bool = False,
                           heads_major: bool = False) -> jax.Array:
    """Attention of every query token over its request's pages: all causal pages (dense, `page_list_QGL` None)
    or the listed logical blocks per (query block, group) (sparse; `blocks_TGN` given when a query block holds
    several tokens, so each keeps only its own selection). Returns [T, H, hd] in q's dtype."""
    T, H, D = q_THD.shape
    if heads_major:
        _, K, ps, _ = k_pages.shape
    else:
        _, ps, K, _ = k_pages.shape
    hg = H // K
    bt = tiles.bt
    Q = qbs.num_blocks
    sparse = page_list_QGL is not None
    if sparse:
        assert count_QG is not None
        list_len = page_list_QGL.shape[-1]
    else:
        list_len = page_table_RP.shape[1]
        page_list_QGL = jnp.zeros((1, 1, 1), jnp.int32)  # unused operands keep one kernel signature
        count_QG = jnp.zeros((1, 1), jnp.int32)
    per_token_check = sparse and bt > 1
    if blocks_TGN is None:
        blocks_TGN = jnp.zeros((1, 1, 1), jnp.int32)
    # Triton tiles are powers of two: a split's entry vector is one, its length rounded UP so that tiles meaning
    # "no split" stay one split (the prefill's pages_per_split = P = 10, from max_model_len 1280, runs as one
    # split of 16 entries, not two of 8); entries past the list are masked. Power-of-two tiles are unchanged.
    per_split = min(pow2_at_least(tiles.pages_per_split), pow2_at_least(list_len))
    num_splits = -(-list_len // per_split)

    # Tiles that run past the token axis (a last query block of < bt tokens) are masked loads / stores.
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((T, H, D), q_THD.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((num_splits, T, H, D), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, T, H), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, T, H), jnp.float32)]
    kt = min(tiles.key_tile or ps, ps)
    assert ps % kt == 0, (ps, kt)
    kernel = functools.partial(_attention_kernel, bt=bt, hg=hg, ps=ps, per_split=per_split, num_splits=num_splits,
                               scale=scale, sparse=sparse, per_token_check=per_token_check, kt=kt,
                               heads_major=heads_major, mask_every_page=tiles.mask_every_page)
    outs = pl.pallas_call(
        kernel,
        grid=(Q, K, num_splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=f"{'sparse' if sparse else 'dense'}_paged_attention_bt{bt}_s{num_splits}",
    )(qbs.start_Q, qbs.length_Q, qbs.row_Q, qbs.max_pos_Q, count_QG, page_table_RP, pos_T.astype(jnp.int32), q_THD,
      k_pages, v_pages, page_list_QGL, blocks_TGN)

    return outs[0] if num_splits == 1 else merge_partials(*outs, axis=0).astype(q_THD.dtype)


def merge_partials(acc: jax.Array, m: jax.Array, l: jax.Array, *, axis: int,
                   valid: jax.Array | None = None) -> jax.Array:
    """fp32 softmax output from partial results over disjoint key sets stacked along `axis`: unnormalised
    accumulators acc [..., D] with their row max m (natural-log units) and sum l [...]. `valid` (m's shape)
    drops partials that were never written, whatever their memory holds. A row with no valid keys gives 0."""
    if valid is not None:
        acc, m, l = jnp.where(valid[..., None], acc, 0.0), jnp.where(valid, m, -jnp.inf), jnp.where(valid, l, 0.0)
    m_max = jnp.max(m, axis=axis, keepdims=True)
    w = jnp.exp(m - jnp.where(m_max == -jnp.inf, 0.0, m_max))
    den = jnp.sum(w * l, axis=axis)
    return jnp.sum(w[..., None] * acc, axis=axis) / jnp.where(den > 0, den, 1.0)[..., None]


def paged_dense_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table_RP: jax.Array,
                          token_row_T: jax.Array, pos_T: jax.Array, scale: float, *, tiles: AttentionTiles,
                          interpret: bool = False) -> jax.Array:
    """Kernel version of `attention.reference.paged_dense_attention` (prefill chunks and decodes in one launch)."""
    if tiles.backend == "mosaic":
        return kernel_mgpu.paged_dense_attention(q_THD, k_pages, v_pages, page_table_RP, token_row_T, pos_T, scale,
                                                 key_tile=tiles.key_tile or k_pages.shape[1],
                                                 stages=tiles.num_stages, interpret=interpret)
    qbs = query_blocks(token_row_T, pos_T, bt=tiles.bt, num_rows=page_table_RP.shape[0])
    return ragged_paged_attention(q_THD, k_pages, v_pages, page_table_RP, pos_T, qbs, scale=scale, tiles=tiles,
                                  interpret=interpret)
