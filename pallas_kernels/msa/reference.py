"""MiniMax Sparse Attention (m3-spec section 4): index scores -> block max -> per-group top-k -> block-sparse
attention. Plain jnp over a contiguous cache; the definition the Pallas kernels must equal."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import causal_mask, gather_context, gqa_attention


def select_blocks(iq_BTGD: jax.Array, ik_BSD: jax.Array, q_pos_BT: jax.Array, *, block_size: int, topk: int,
                  local_blocks: int, init_blocks: int = 0) -> jax.Array:
    """Top-k key blocks per (KV group g, query row t): `blocks[B, G, T, topk]` int32, -1 padded.

    score[g, s] = iq_g . ik_s in fp32 for keys s <= the query's position (token-exact cutoff);
    a block's score is the max over its keys; the query's own `local_blocks` blocks (and the first
    `init_blocks`) are forced in. Blocks are anchored at absolute position 0 (slot s = position s).
    """
    B, T, G, _ = iq_BTGD.shape
    S = ik_BSD.shape[1]
    nb = -(-S // block_size)
    scores = jnp.einsum("btgd,bsd->bgts", iq_BTGD.astype(jnp.float32), ik_BSD.astype(jnp.float32))
    visible = causal_mask(q_pos_BT, S)[:, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, nb * block_size - S)), constant_values=-jnp.inf)
    block_BGTN = scores.reshape(B, G, T, nb, block_size).max(axis=-1)

    q_block = (q_pos_BT // block_size)[:, None, :, None]
    b = jnp.arange(nb)[None, None, None, :]
    forced = (b <= q_block) & ((b > q_block - local_blocks) | (b < init_blocks))
    block_BGTN = jnp.where(forced, jnp.inf, block_BGTN)

    k = min(topk, nb)
    vals, idx = jax.lax.top_k(block_BGTN, k)
    idx = jnp.where(vals == -jnp.inf, -1, idx).astype(jnp.int32)
    if k < topk:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, 0), (0, topk - k)), constant_values=-1)
    return idx


def block_sparse_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, q_pos_BT: jax.Array,
                           blocks_BKTN: jax.Array, *, block_size: int, scale: float) -> jax.Array:
    """Attention of each query head over its KV group's selected blocks, causal at token level."""
    B, S = k_BSKD.shape[:2]
    nb = -(-S // block_size)
    # Scatter the selection into a [.., nb] keep-mask; -1 slots land in a dropped extra column.
    safe = jnp.where(blocks_BKTN < 0, nb, blocks_BKTN)
    keep = jax.nn.one_hot(safe, nb + 1, dtype=jnp.bool_).any(axis=-2)[..., :nb]
    keep_BKTS = jnp.repeat(keep, block_size, axis=-1)[..., :S]
    mask_BKTS = keep_BKTS & causal_mask(q_pos_BT, S)[:, None]
    return gqa_attention(q_BTHD, k_BSKD, v_BSKD, mask_BKTS, scale)


def paged_select_blocks(iq_TGD: jax.Array, ik_pages: jax.Array, page_table_RN: jax.Array, token_row_T: jax.Array,
                        pos_T: jax.Array, *, topk: int, local_blocks: int, init_blocks: int = 0) -> jax.Array:
    """`select_blocks` for a flat ragged batch over the paged index-K: logical block ids [T, G, topk]."""
    ik = gather_context(ik_pages, page_table_RN, token_row_T)
    blocks = select_blocks(iq_TGD[:, None], ik, pos_T[:, None], block_size=ik_pages.shape[1], topk=topk,
                           local_blocks=local_blocks, init_blocks=init_blocks)
    return blocks[:, :, 0, :]


def paged_block_sparse_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                 page_table_RN: jax.Array, token_row_T: jax.Array, pos_T: jax.Array,
                                 blocks_TGN: jax.Array, *, scale: float) -> jax.Array:
    """`block_sparse_attention` for a flat ragged batch: each KV group reads its selected pages only."""
    k = gather_context(k_pages, page_table_RN, token_row_T)
    v = gather_context(v_pages, page_table_RN, token_row_T)
    return block_sparse_attention(q_THD[:, None], k, v, pos_T[:, None], blocks_TGN[:, :, None, :],
                                  block_size=k_pages.shape[1], scale=scale)[:, 0]
