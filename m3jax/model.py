"""MiniMax M3, one token at a time from embedding to logits.

Read top to bottom: norms and RoPE, the KV state, attention (dense, or MSA: index branch -> block selection ->
block-sparse attention), the MLPs (dense SwiGLU-OAI, MoE with a shared expert), the decoder layer, `forward`.
Everything is a pure function of a params pytree (`m3jax.params.param_specs` declares it), so `jax.jit` and
sharding apply unchanged. The hot ops go through `pallas_kernels.ops`, which picks kernel or jnp reference.

Shape letters: B batch rows, T new tokens per row, S cache slots (= positions), D hidden, H query heads,
K kv heads (= index heads = MSA groups), hd head dim, E experts, F expert width, N selected blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from m3jax.config import M3Config
from pallas_kernels import ops

Params = dict[str, Any]


# ---- norms and rotary embedding ----------------------------------------------------------------------------

def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma RMSNorm: normalise in fp32, scale by (1 + w), cast back."""
    v = x.astype(jnp.float32)
    v = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    return (v * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def rope_tables(pos_BT: jax.Array, rotary_dim: int, theta: float, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos/sin `[B, T, rotary_dim]` (NeoX: the frequencies repeated twice). Computed in fp32, then cast to the
    activation dtype before use, as the reference does."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    f = pos_BT.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x_BTHD: jax.Array, cos_BTR: jax.Array, sin_BTR: jax.Array) -> jax.Array:
    """Rotate-half RoPE on the first R dims of each head (pairs j, j + R/2); the rest pass through."""
    r = min(cos_BTR.shape[-1], x_BTHD.shape[-1])
    cos, sin = cos_BTR[:, :, None, :r], sin_BTR[:, :, None, :r]
    rot, rest = x_BTHD[..., :r], x_BTHD[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
    rotated = rot * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
    return jnp.concatenate([rotated, rest], axis=-1)


# ---- the KV state ------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVState:
    """Contiguous per-row caches: slot s of row b holds position s. K, V and index-K move together.

    k[layer], v[layer]: [B, S, K, hd] (post-norm, post-RoPE K; raw V). index_k[layer]: [B, S, hd_idx] for sparse
    layers, None for dense ones. lengths[B]: tokens already cached per row. (The engine's paged cache replaces
    this; the model only needs "append the new tokens, read all visible ones".)
    """

    k: list[jax.Array]
    v: list[jax.Array]
    index_k: list[jax.Array | None]
    lengths: jax.Array

    @classmethod
    def empty(cls, cfg: M3Config, batch: int, max_len: int, dtype: Any) -> KVState:
        kv_shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return cls(
            k=[jnp.zeros(kv_shape, dtype) for _ in range(cfg.num_layers)],
            v=[jnp.zeros(kv_shape, dtype) for _ in range(cfg.num_layers)],
            index_k=[jnp.zeros((batch, max_len, cfg.index_head_dim), dtype) if t == "sparse" else None
                     for t in cfg.attn_types],
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def _append(cache_BS: jax.Array, new_BT: jax.Array, start_B: jax.Array) -> jax.Array:
    """Write each row's new tokens at its own offset."""
    def one(c, n, s):
        return jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), s, axis=0)
    return jax.vmap(one)(cache_BS, new_BT, start_B)


# ---- attention ---------------------------------------------------------------------------------------------

def msa_select(p: Params, cfg: M3Config, h_BTD: jax.Array, pos_BT: jax.Array, rope: tuple[jax.Array, jax.Array],
               ik_cache_BSI: jax.Array, start_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MSA index branch: returns (the updated index-K cache, selected blocks [B, K, T, N])."""
    iq = jnp.einsum("btd,dgi->btgi", h_BTD, p["wq"])
    ik = jnp.einsum("btd,di->bti", h_BTD, p["wk"])[:, :, None, :]
    iq = rms_norm(iq, p["q_norm"], cfg.rms_norm_eps)
    ik = rms_norm(ik, p["k_norm"], cfg.rms_norm_eps)
    iq, ik = apply_rope(iq, *rope), apply_rope(ik, *rope)
    ik_cache_BSI = _append(ik_cache_BSI, ik[:, :, 0, :], start_B)
    blocks = ops.select_blocks(iq, ik_cache_BSI, pos_BT, block_size=cfg.index_block_size,
                               topk=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks,
                               init_blocks=cfg.index_init_blocks)
    return ik_cache_BSI, blocks


def attention(p: Params, cfg: M3Config, layer: int, h_BTD: jax.Array, pos_BT: jax.Array,
              rope: tuple[jax.Array, jax.Array], kv: KVState, start_B: jax.Array,
              reuse_blocks: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """Self-attention of one layer; updates kv's caches for this layer in place (functionally)."""
    a = p["attn"]
    q = rms_norm(jnp.einsum("btd,dhk->bthk", h_BTD, a["wq"]), a["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(jnp.einsum("btd,dhk->bthk", h_BTD, a["wk"]), a["k_norm"], cfg.rms_norm_eps)
    v = jnp.einsum("btd,dhk->bthk", h_BTD, a["wv"])
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    kv.k[layer] = k_cache = _append(kv.k[layer], k, start_B)
    kv.v[layer] = v_cache = _append(kv.v[layer], v, start_B)
    scale = cfg.head_dim ** -0.5

    blocks = None
    if cfg.attn_types[layer] == "dense":
        o = ops.dense_causal_attention(q, k_cache, v_cache, pos_BT, scale)
    else:
        if cfg.index_recomputes(layer) or reuse_blocks is None:
            kv.index_k[layer], blocks = msa_select(p["index"], cfg, h_BTD, pos_BT, rope, kv.index_k[layer],
                                                   start_B)
        else:
            # Cross-layer top-k reuse (opt-in): this layer's index-K is never read, so it is not written.
            blocks = reuse_blocks
        o = ops.block_sparse_attention(q, k_cache, v_cache, pos_BT, blocks,
                                       block_size=cfg.index_block_size, scale=scale)
    return jnp.einsum("bthk,hkd->btd", o, a["wo"]), blocks


# ---- MLPs --------------------------------------------------------------------------------------------------

def mlp(p: Params, cfg: M3Config, layer: int, h_BTD: jax.Array) -> jax.Array:
    B, T, D = h_BTD.shape
    h_TD = h_BTD.reshape(B * T, D)
    if cfg.mlp_types[layer] == "dense":
        m = p["mlp"]
        out = ops.dense_mlp(h_TD, m["w_gate"], m["w_up"], m["w_down"], alpha=cfg.swiglu_alpha,
                            limit=cfg.swiglu_limit)
    else:
        out = ops.moe(h_TD, p["moe"], top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor,
                      alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    return out.reshape(B, T, D)


# ---- the decoder -------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOutput:
    logits: jax.Array  # [B, T, vocab] fp32 ([B, 1, vocab] with logit_index_B)
    kv: KVState
    selections: dict[int, jax.Array]  # sparse layer -> blocks [B, K, T, N] (-1 padded)


def forward(params: Params, cfg: M3Config, tokens_BT: jax.Array, kv: KVState,
            logit_index_B: jax.Array | None = None) -> ForwardOutput:
    """Run T new tokens per row through M3, appending them to `kv` (row b's tokens sit at positions
    kv.lengths[b] ... kv.lengths[b] + T - 1). Prefill is T = prompt length on an empty state; decode is T = 1.

    Logits come for every new token, or only for token `logit_index_B[b]` of each row when given (the row
    that will be sampled: the lm_head over a 200k vocabulary is not free).
    """
    kv = KVState(list(kv.k), list(kv.v), list(kv.index_k), kv.lengths)
    start_B = kv.lengths
    T = tokens_BT.shape[1]
    pos_BT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]

    x = params["embed"][tokens_BT]  # no embedding scale in M3
    rope = rope_tables(pos_BT, cfg.rotary_dim, cfg.rope_theta, x.dtype)
    selections: dict[int, jax.Array] = {}
    blocks = None
    for i, lp in enumerate(params["layers"]):
        o, layer_blocks = attention(lp, cfg, i, rms_norm(x, lp["input_norm"], cfg.rms_norm_eps), pos_BT, rope,
                                    kv, start_B, blocks)
        if layer_blocks is not None:
            selections[i] = blocks = layer_blocks
        x = x + o
        x = x + mlp(lp, cfg, i, rms_norm(x, lp["post_attn_norm"], cfg.rms_norm_eps))

    if logit_index_B is not None:
        x = jnp.take_along_axis(x, logit_index_B[:, None, None].astype(jnp.int32), axis=1)
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = jnp.einsum("btd,dv->btv", x, params["lm_head"], preferred_element_type=jnp.float32)
    kv.lengths = start_B + T
    return ForwardOutput(logits, kv, selections)
