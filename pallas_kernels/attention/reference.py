"""Masked grouped-query attention: the definition both dense and MSA block-sparse attention reduce to."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_mask(q_pos_BT: jax.Array, num_keys: int) -> jax.Array:
    """[B, T, S] True where key slot s (= absolute position s in a contiguous cache) is visible to the query."""
    s = jnp.arange(num_keys, dtype=q_pos_BT.dtype)
    return s[None, None, :] <= q_pos_BT[:, :, None]


def gqa_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, mask_BKTS: jax.Array,
                  scale: float) -> jax.Array:
    """Softmax attention where query head h reads KV head h // (H // K) under that group's mask.

    Scores and softmax are fp32 whatever the input dtype; a row with no visible key returns zeros.
    """
    B, T, H, D = q_BTHD.shape
    K = k_BSKD.shape[2]
    q_BTKGD = q_BTHD.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD.astype(jnp.float32), k_BSKD.astype(jnp.float32)) * scale
    mask = mask_BKTS[:, :, None, :, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(scores - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v_BSKD.astype(jnp.float32))
    return o.reshape(B, T, H, D).astype(q_BTHD.dtype)


def dense_causal_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, q_pos_BT: jax.Array,
                           scale: float) -> jax.Array:
    """Dense causal attention over a contiguous cache (key slot s holds position s)."""
    K = k_BSKD.shape[2]
    mask = causal_mask(q_pos_BT, k_BSKD.shape[1])
    mask_BKTS = jnp.broadcast_to(mask[:, None], (mask.shape[0], K, *mask.shape[1:]))
    return gqa_attention(q_BTHD, k_BSKD, v_BSKD, mask_BKTS, scale)


def gather_context(pages_PS: jax.Array, page_table_RN: jax.Array, token_row_T: jax.Array) -> jax.Array:
    """Each query token's request context as a contiguous cache: [T, N * page_size, ...].

    Logical slot j of a request (page j // ps, offset j % ps) holds its token at position j. Slots past the
    request's length hold whatever the page has (sink-page padding, stale data): the causal cutoff hides them.
    """
    ctx = pages_PS[page_table_RN[token_row_T]]  # [T, N, ps, ...]
    return ctx.reshape(ctx.shape[0], ctx.shape[1] * ctx.shape[2], *ctx.shape[3:])


def paged_dense_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table_RN: jax.Array,
                          token_row_T: jax.Array, pos_T: jax.Array, scale: float) -> jax.Array:
    """Ragged paged causal attention: every token of a flat batch against its own request's pages."""
    k = gather_context(k_pages, page_table_RN, token_row_T)
    v = gather_context(v_pages, page_table_RN, token_row_T)
    return dense_causal_attention(q_THD[:, None], k, v, pos_T[:, None], scale)[:, 0]
