"""Mixture of experts with the M3 router (m3-spec section 3): fp32 sigmoid scores, top-k chosen with the
correction bias, weights from the unbiased scores renormalised to 1, routed output scaled, plus the shared
expert. Tokens are sorted by expert and run through `jax.lax.ragged_dot` (the plain-XLA baseline)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ordered import ordered_sum


def swiglu_oai(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """SwiGLU-OAI: the gate is clamped from above only, up on both sides, and up gets +1."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))


def dense_mlp(h_TD: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array, w_down_FD: jax.Array, *,
              alpha: float, limit: float) -> jax.Array:
    return swiglu_oai(h_TD @ w_gate_DF, h_TD @ w_up_DF, alpha=alpha, limit=limit) @ w_down_FD


def route(h_TD: jax.Array, router_DE: jax.Array, bias_E: jax.Array, top_k: int,
          logits_TE: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(expert ids [T, k], weights [T, k] fp32). The bias picks experts; it never weights them. `logits_TE`: the
    router's fp32 logits computed elsewhere (the batch-invariant kernel path), instead of XLA's GEMM here."""
    if logits_TE is None:
        logits_TE = h_TD.astype(jnp.float32) @ router_DE.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits_TE)
    _, idx_TK = jax.lax.top_k(scores + bias_E.astype(jnp.float32), top_k)
    w_TK = jnp.take_along_axis(scores, idx_TK, axis=-1)
    return idx_TK, w_TK / ordered_sum(w_TK, axis=-1)[:, None]  # in choice order at every T (ordered.py)


def routed_experts(h_TD: jax.Array, idx_TK: jax.Array, w_TK: jax.Array, w_gate_EDF: jax.Array,
                   w_up_EDF: jax.Array, w_down_EFD: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """sum_k w[t, k] * Expert_{idx[t, k]}(h[t]) via a stable sort by expert and grouped matmuls."""
    T, D = h_TD.shape
    E = w_gate_EDF.shape[0]
    k = idx_TK.shape[1]
    flat_e = idx_TK.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    token_of = order // k
    x = h_TD[token_of]
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    gate = jax.lax.ragged_dot(x, w_gate_EDF, group_sizes)
    up = jax.lax.ragged_dot(x, w_up_EDF, group_sizes)
    y = jax.lax.ragged_dot(swiglu_oai(gate, up, alpha=alpha, limit=limit), w_down_EFD, group_sizes)
    y = y.astype(jnp.float32) * w_TK.reshape(-1)[order][:, None]
    return jnp.zeros((T, D), jnp.float32).at[token_of].add(y)


def moe(h_TD: jax.Array, p: dict, *, top_k: int, routed_scaling: float, alpha: float, limit: float) -> jax.Array:
    idx_TK, w_TK = route(h_TD, p["router"], p["router_bias"], top_k)
    out = routed_experts(h_TD, idx_TK, w_TK, p["w_gate"], p["w_up"], p["w_down"], alpha=alpha, limit=limit)
    out = out * routed_scaling
    if "shared" in p:
        s = p["shared"]
        out = out + dense_mlp(h_TD, s["w_gate"], s["w_up"], s["w_down"], alpha=alpha, limit=limit)
    return out.astype(h_TD.dtype)
