"""KV-block-major block-sparse attention for prefill chunks (Pallas: Triton lowering on GPU, interpret on CPU).

Every token of a prefill chunk selects its own 16 blocks per KV group, so neighbouring tokens share few pages
when their selections differ. The query-major kernel (`attention.kernel.ragged_paged_attention` over the union of
a query block's selections) then reads pages that most of its rows mask away. Here the loop is turned around
(the MSA paper's "KV outer, gather Q"):

1. `work_items` (XLA): the (token, group, slot) selections sorted by (group, request, block), cut into work
   items of at most `block_major * bt` tokens that selected the same block of the same request and group.
2. The kernel: one program per work item reads that block's K and V page once, then for each tile of `bt` of
   its tokens (`AttentionTiles.block_major` tiles at most) gathers their query heads of the group (M = bt *
   heads per group rows) and computes their attention over the block alone
   (token-exact causal mask, fp32 softmax in base 2). It writes each token's partial result to the
   (token, group, slot) of the block in its selection: the unnormalised accumulator in q's dtype, and the
   block's max and sum in fp32.
3. `attention.kernel.merge_partials` (XLA, the merge the split page lists use too): each token's slots merged
   with log-sum-exp weights, so every selected key is computed exactly once, and a token with no selection gets
   zeros, as the reference gives.

Compute is exactly the selected (token, block) pairs; the price is the partials' round trip through memory:
T x G x topk x heads per group x hd in q's dtype, 2.1 GB for an 8k chunk of M3 in bf16, allocated for the call
(on the H200 the merge reads them in 533 us of the op's 2.76 ms; docs/benchmarks.md, "Attention kernels").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention.kernel import LOG2E, merge_partials
from pallas_kernels.attention.ragged import cut_runs
from pallas_kernels.attention.tuning import AttentionTiles

_NO_KEY = jnp.iinfo(jnp.int32).max  # sort key of a -1 selection slot: after every real (group, request, block)
# Pallas' Triton lowering indexes an array with 32-bit element offsets: longer batches are split into calls whose
# partials stay under this many elements (16,383 tokens of M3 per call).
MAX_PARTIAL_ELEMENTS = 2**31 - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class WorkItems:
    """W work items (a static bound; unused ones have count 0) over the P selected (token, group, slot) pairs
    sorted by (group, request, block, token)."""

    group_W: jax.Array  # KV group
    row_W: jax.Array  # request row (page-table row)
    block_W: jax.Array  # logical block
    start_W: jax.Array  # first pair of the item in the sorted pair arrays
    count_W: jax.Array  # pairs (tokens) in the item, <= bt; 0: unused program
    token_P: jax.Array  # sorted pairs: the token
    dest_P: jax.Array  # sorted pairs: the partial's row, (token * G + group) * N + slot


def max_work_items(num_pairs: int, num_keys: int, bt: int) -> int:
    """Programs needed: sum over (group, request, block) keys of ceil(n_key / bt) <= pairs / bt + keys, and
    <= pairs (an item holds at least one pair)."""
    return max(1, min(num_pairs, num_pairs // bt + num_keys))


def work_items(blocks_TGN: jax.Array, token_row_T: jax.Array, *, num_rows: int, num_blocks: int,
               bt: int) -> WorkItems:
    """The selections of a flat batch regrouped by the block they select (see the module docstring)."""
    T, G, N = blocks_TGN.shape
    blk = blocks_TGN.astype(jnp.int32)
    row_T = token_row_T.astype(jnp.int32)
    key_TGN = (jnp.arange(G, dtype=jnp.int32)[None, :, None] * num_rows + row_T[:, None, None]) * num_blocks + blk
    key_P = jnp.where(blk >= 0, key_TGN, _NO_KEY).reshape(-1)
    # Stable: equal keys keep the flat (token, group, slot) order, so each item's tokens ascend.
    order_P = jnp.argsort(key_P, stable=True).astype(jnp.int32)
    skey_P = key_P[order_P]
    W = max_work_items(key_P.shape[0], G * num_rows * num_blocks, bt)
    _, start_W, count_W = cut_runs(skey_P, bt, W, valid_T=skey_P != _NO_KEY)
    key_W = jnp.where(count_W > 0, skey_P[jnp.minimum(start_W, key_P.shape[0] - 1)], 0)
    return WorkItems(group_W=key_W // (num_rows * num_blocks), row_W=key_W // num_blocks % num_rows,
                     block_W=key_W % num_blocks, start_W=start_W, count_W=count_W, token_P=order_P // (G * N),
                     dest_P=order_P)


def _block_major_kernel(group_ref, row_ref, block_ref, start_ref, count_ref, token_ref, dest_ref, page_table_ref,
                        pos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, bt: int, hg: int, ps: int,
                        scale: float, trash: int):
    w = pl.program_id(0)
    n = count_ref[w]

    @pl.when(n > 0)
    def _():
        g, blk, s0 = group_ref[w], block_ref[w], start_ref[w]
        M, D = bt * hg, q_ref.shape[-1]
        page = page_table_ref[row_ref[w], blk]
        k_SD = k_ref[page, :, g, :]  # read once for all of the item's token tiles
        v_SD = v_ref[page, :, g, :]
        kpos_S = blk * ps + lax.broadcasted_iota(jnp.int32, (ps,), 0)
        c = scale * LOG2E

        def tile(i, carry):
            t0 = s0 + i * bt
            ok_B = lax.broadcasted_iota(jnp.int32, (bt,), 0) < n - i * bt
            tok_B = plgpu.load(token_ref.at[pl.ds(t0, bt)], mask=ok_B, other=0)
            # Rows past the item's count write to one spare row that nothing reads (no masked scatter needed).
            dest_B = jnp.where(ok_B, plgpu.load(dest_ref.at[pl.ds(t0, bt)], mask=ok_B, other=0), trash)
            pos_B = jnp.where(ok_B, pos_ref[tok_B], -1)
            q_MD = q_ref[tok_B, pl.ds(g * hg, hg), :].reshape(M, D)
            s_MS = lax.dot_general(q_MD, k_SD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            pos_M = jnp.broadcast_to(pos_B[:, None], (bt, hg)).reshape(M)
            s_MS = jnp.where(kpos_S[None, :] <= pos_M[:, None], s_MS, -jnp.inf)
            # A token that selected the block sees its first key (the block is at or before its own); only the
            # spare rows see nothing, and their m is kept finite so their garbage stays NaN-free.
            m_M = jnp.max(s_MS, axis=1)
            m_M = jnp.where(m_M == -jnp.inf, 0.0, m_M)
            p_MS = jnp.exp2(s_MS * c - (m_M * c)[:, None])
            l_M = jnp.sum(p_MS, axis=1)
            acc_MD = jnp.dot(p_MS.astype(v_SD.dtype), v_SD, preferred_element_type=jnp.float32)
            o_ref[dest_B] = acc_MD.reshape(bt, hg, D).astype(o_ref.dtype)
            m_ref[dest_B] = (m_M * scale).reshape(bt, hg)
            l_ref[dest_B] = l_M.reshape(bt, hg)
            return carry

        lax.fori_loop(0, (n + bt - 1) // bt, tile, 0)


def block_major_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table_RP: jax.Array,
                          token_row_T: jax.Array, pos_T: jax.Array, blocks_TGN: jax.Array, *, scale: float,
                          tiles: AttentionTiles, interpret: bool = False) -> jax.Array:
    """Kernel version of `msa.reference.paged_block_sparse_attention`, KV-block-major. A token's selected ids
    must be distinct apart from -1 padding (what `paged_select_blocks` produces)."""
    T, H, D = q_THD.shape
    _, ps, K, _ = k_pages.shape
    R, P = page_table_RP.shape
    N = blocks_TGN.shape[-1]
    hg, bt = H // K, tiles.bt
    chunk = MAX_PARTIAL_ELEMENTS // (K * N * hg * D) - 1  # tokens per call (the spare row is the -1)
    if chunk < T:  # a token's output depends only on its own row, position and selection
        return jnp.concatenate([
            block_major_attention(q_THD[t:t + chunk], k_pages, v_pages, page_table_RP, token_row_T[t:t + chunk],
                                  pos_T[t:t + chunk], blocks_TGN[t:t + chunk], scale=scale, tiles=tiles,
                                  interpret=interpret) for t in range(0, T, chunk)], axis=0)
    items = work_items(blocks_TGN, token_row_T, num_rows=R, num_blocks=P, bt=bt * tiles.block_major)
    W = items.count_W.shape[0]
    rows = T * K * N + 1  # one partial per (token, group, slot), and the spare row
    kernel = functools.partial(_block_major_kernel, bt=bt, hg=hg, ps=ps, scale=scale, trash=rows - 1)
    o_part, m_part, l_part = pl.pallas_call(
        kernel,
        grid=(W,),
        out_shape=[jax.ShapeDtypeStruct((rows, hg, D), q_THD.dtype),
                   jax.ShapeDtypeStruct((rows, hg), jnp.float32), jax.ShapeDtypeStruct((rows, hg), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=f"block_major_sparse_attention_bt{bt}",
    )(items.group_W, items.row_W, items.block_W, items.start_W, items.count_W, items.token_P, items.dest_P,
      page_table_RP, pos_T.astype(jnp.int32), q_THD, k_pages, v_pages)
    # Slots whose selection is -1 were never written: `valid` drops them (their memory is uninitialised).
    n = T * K * N
    part = (o_part[:n].reshape(T, K, N, hg, D), m_part[:n].reshape(T, K, N, hg), l_part[:n].reshape(T, K, N, hg))
    valid = jnp.broadcast_to((blocks_TGN >= 0)[..., None], (T, K, N, hg))
    return merge_partials(*part, axis=2, valid=valid).reshape(T, H, D).astype(q_THD.dtype)
