"""MiniMax M3, one token at a time from embedding to logits.

Read top to bottom: norms and RoPE, attention (dense, or MSA: index branch -> block selection ->
block-sparse attention), the MLPs (dense SwiGLU-OAI, MoE with a shared expert), the decoder layer, `forward`.
Everything is a pure function of a params pytree (`m3jax.params.param_specs` declares it), so `jax.jit` and
sharding apply unchanged. The hot ops go through `pallas_kernels.ops`, which picks kernel or jnp reference.

A step is a flat ragged `Batch` (m3jax/batch.py): T query tokens of R requests, K/V/index-K in pages of one MSA
block each. Shape letters: T tokens, D hidden, H query heads, K kv heads (= index heads = MSA groups),
hd head dim, E experts, F expert width, N selected blocks, L sampled rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from m3jax.batch import Batch, KVPages
from m3jax.config import M3Config
from pallas_kernels import ops

Params = dict[str, Any]


# ---- norms and rotary embedding ----------------------------------------------------------------------------

def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma RMSNorm: normalise in fp32, scale by (1 + w), cast back."""
    v = x.astype(jnp.float32)
    v = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    return (v * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def rope_tables(pos_T: jax.Array, rotary_dim: int, theta: float, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos/sin `[T, rotary_dim]` (NeoX: the frequencies repeated twice). Computed in fp32, then cast to the
    activation dtype before use, as the reference does."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    f = pos_T.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x_THD: jax.Array, cos_TR: jax.Array, sin_TR: jax.Array) -> jax.Array:
    """Rotate-half RoPE on the first R dims of each head (pairs j, j + R/2); the rest pass through.
    A head narrower than R (a small index head) rotates its own width, as the reference does."""
    r = min(cos_TR.shape[-1], x_THD.shape[-1])
    cos, sin = cos_TR[:, None, :r], sin_TR[:, None, :r]
    rot, rest = x_THD[..., :r], x_THD[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
    rotated = rot * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
    return jnp.concatenate([rotated, rest], axis=-1)


# ---- attention ---------------------------------------------------------------------------------------------

def msa_select(p: Params, cfg: M3Config, layer: int, h_TD: jax.Array, batch: Batch, rope: tuple[jax.Array, ...],
               kv: KVPages) -> jax.Array:
    """MSA index branch: write this step's index-K, then pick blocks per (KV group, query token): [T, K, N]."""
    iq = rms_norm(jnp.einsum("td,dgi->tgi", h_TD, p["wq"]), p["q_norm"], cfg.rms_norm_eps)
    ik = rms_norm(jnp.einsum("td,di->ti", h_TD, p["wk"])[:, None, :], p["k_norm"], cfg.rms_norm_eps)
    iq, ik = apply_rope(iq, *rope), apply_rope(ik, *rope)
    kv.index_k[layer] = ops.write_kv_pages(kv.index_k[layer], ik[:, 0], batch.slot_mapping)
    return ops.paged_select_blocks(iq, kv.index_k[layer], batch.page_table, batch.token_row, batch.positions,
                                   topk=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks,
                                   init_blocks=cfg.index_init_blocks)


def attention(p: Params, cfg: M3Config, layer: int, h_TD: jax.Array, batch: Batch, rope: tuple[jax.Array, ...],
              kv: KVPages, reuse_blocks: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """Self-attention of one layer: project, QK-norm, RoPE, write K/V pages, attend (dense or MSA)."""
    a = p["attn"]
    q = rms_norm(jnp.einsum("td,dhk->thk", h_TD, a["wq"]), a["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(jnp.einsum("td,dhk->thk", h_TD, a["wk"]), a["k_norm"], cfg.rms_norm_eps)
    v = jnp.einsum("td,dhk->thk", h_TD, a["wv"])
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # norm before RoPE; V gets neither
    kv.k[layer] = ops.write_kv_pages(kv.k[layer], k, batch.slot_mapping)
    kv.v[layer] = ops.write_kv_pages(kv.v[layer], v, batch.slot_mapping)
    scale = cfg.head_dim ** -0.5

    blocks = None
    if cfg.attn_types[layer] == "dense":
        o = ops.paged_dense_attention(q, kv.k[layer], kv.v[layer], batch.page_table, batch.token_row,
                                      batch.positions, scale)
    else:
        if cfg.index_recomputes(layer) or reuse_blocks is None:
            blocks = msa_select(p["index"], cfg, layer, h_TD, batch, rope, kv)
        else:
            # Cross-layer top-k reuse (opt-in): this layer's index-K is never read, so it is not written.
            blocks = reuse_blocks
        o = ops.paged_block_sparse_attention(q, kv.k[layer], kv.v[layer], batch.page_table, batch.token_row,
                                             batch.positions, blocks, scale=scale)
    return jnp.einsum("thk,hkd->td", o, a["wo"]), blocks


# ---- MLPs --------------------------------------------------------------------------------------------------

def mlp(p: Params, cfg: M3Config, layer: int, h_TD: jax.Array) -> jax.Array:
    if cfg.mlp_types[layer] == "dense":
        m = p["mlp"]
        return ops.dense_mlp(h_TD, m["w_gate"], m["w_up"], m["w_down"], alpha=cfg.swiglu_alpha,
                             limit=cfg.swiglu_limit)
    return ops.moe(h_TD, p["moe"], top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor,
                   alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)


# ---- the decoder -------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOutput:
    logits: jax.Array  # [L, vocab] fp32, one row per batch.logit_rows entry
    kv: KVPages
    selections: dict[int, jax.Array]  # sparse layer -> logical blocks [T, K, N] (-1 padded)


def forward(params: Params, cfg: M3Config, kv: KVPages, batch: Batch) -> ForwardOutput:
    """One step of M3 over a flat ragged batch: every token's K/V/index-K is written to its slot, every token
    attends to its own request's pages up to its position, and logits come only for `batch.logit_rows`."""
    kv = KVPages(list(kv.k), list(kv.v), list(kv.index_k))
    x = params["embed"][batch.token_ids]  # [T, D]; no embedding scale in M3
    rope = rope_tables(batch.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
    selections: dict[int, jax.Array] = {}
    blocks = None
    for i, lp in enumerate(params["layers"]):
        o, layer_blocks = attention(lp, cfg, i, rms_norm(x, lp["input_norm"], cfg.rms_norm_eps), batch, rope, kv,
                                    blocks)
        if layer_blocks is not None:
            selections[i] = blocks = layer_blocks
        x = x + o
        x = x + mlp(lp, cfg, i, rms_norm(x, lp["post_attn_norm"], cfg.rms_norm_eps))

    x = rms_norm(x[batch.logit_rows], params["final_norm"], cfg.rms_norm_eps)
    logits = jnp.einsum("td,dv->tv", x, params["lm_head"], preferred_element_type=jnp.float32)
    return ForwardOutput(logits, kv, selections)
