"""MiniMax M3, one token at a time from embedding to logits.

Read top to bottom: norms and RoPE, attention (dense, or MSA: index branch -> block selection ->
block-sparse attention), the MLPs (dense SwiGLU-OAI, MoE with a shared expert), the decoder layer, `forward`.
Everything is a pure function of a params pytree (`m3jax.params.param_specs` declares it), so `jax.jit` and
sharding apply unchanged. The hot ops go through `pallas_kernels.ops`; which implementation each family runs
(Pallas kernel, interpreter or jnp reference) is the static `KernelChoice` handed to `forward`.

A step is a flat ragged `Batch` (m3jax/batch.py): T query tokens of R requests, K/V/index-K in pages of one MSA
block each. Consecutive layers of the same kind form a run (`M3Config.layer_runs`; m3-full has two: 3 dense
layers, then 57 MSA + MoE layers) whose weights and pages are stacked, and `forward` runs each run as one
`lax.scan`: tracing and compiling cost one layer per run, whatever the depth.

Shape letters: T tokens, D hidden, H query heads, K kv heads (= index heads = MSA groups), hd head dim,
E experts, F expert width, N selected blocks, L sampled rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from m3jax.batch import Batch, KVPages
from m3jax.config import LayerRun, M3Config
from pallas_kernels import ops
from pallas_kernels.choice import KernelChoice

Params = dict[str, Any]


# ---- norms and rotary embedding ----------------------------------------------------------------------------

def rms_norm(x: jax.Array, w: jax.Array, eps: float, kernels: KernelChoice | None = None) -> jax.Array:
    """Gemma RMSNorm: normalise in fp32, scale by (1 + w), cast back. With batch-invariant kernels the mean of
    squares is summed by a kernel whose order per row does not depend on the row count (ops.rms_norm_mean_square)."""
    v = x.astype(jnp.float32)
    if kernels is not None and kernels.batch_invariant:
        ms = ops.rms_norm_mean_square(v, impl=kernels.attention, topology=kernels.topology)
    else:
        ms = jnp.mean(v * v, axis=-1, keepdims=True)
    v = v * jax.lax.rsqrt(ms + eps)
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

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerPages:
    """One run's page pool as the layers of the scan see it: [layers * pages, page_size, ...], layer j's pages
    starting at j * pages (so the kernels index one flat pool through an offset page table)."""

    k: jax.Array
    v: jax.Array
    index_k: jax.Array | None


def msa_select(p: Params, cfg: M3Config, h_TD: jax.Array, batch: Batch, rope: tuple[jax.Array, ...],
               index_k: jax.Array, kernels: KernelChoice, layer: jax.Array | int,
               projected: list[jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """MSA index branch: write this step's index-K, then pick blocks per (KV group, query token): [T, K, N].
    `projected`: h @ the index's wq and wk, when the caller ran them (with q, k and v, in one launch)."""
    impl, topo, inv = kernels.attention, kernels.topology, kernels.batch_invariant
    if projected is None:
        projected = ops.project_many(h_TD, [(p["wq"], "index.wq"), (p["wk"], "index.wk")], impl=impl,
                                     topology=topo, layer=layer, invariant=inv)
    iq = rms_norm(projected[0], p["q_norm"], cfg.rms_norm_eps, kernels)
    ik = rms_norm(projected[1][:, None, :], p["k_norm"], cfg.rms_norm_eps, kernels)
    iq, ik = apply_rope(iq, *rope), apply_rope(ik, *rope)
    index_k = ops.write_kv_pages(index_k, ik[:, 0], batch.slot_mapping, impl=impl, topology=topo)
    blocks = ops.paged_select_blocks(iq, index_k, batch.page_table, batch.token_row, batch.positions,
                                     topk=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks,
                                     init_blocks=cfg.index_init_blocks, impl=impl, topology=topo, invariant=inv)
    return index_k, blocks


def projections_of_h(p: Params, selects: bool) -> list[tuple[jax.Array, str]]:
    """The (weight, name) pairs a layer applies to its normed input h, as `attention` runs them in one
    `ops.project_many`: q, k, v, then the index's q and k if the layer selects its own blocks."""
    a = p["attn"]
    weights = [(a["wq"], "attn.wq"), (a["wk"], "attn.wk"), (a["wv"], "attn.wv")]
    if selects:
        weights += [(p["index"]["wq"], "index.wq"), (p["index"]["wk"], "index.wk")]
    return weights


def attention(p: Params, cfg: M3Config, kind: str, h_TD: jax.Array, batch: Batch, rope: tuple[jax.Array, ...],
              pages: LayerPages, reuse_blocks: jax.Array | None, recompute: jax.Array | bool,
              kernels: KernelChoice, layer: jax.Array | int) -> tuple[jax.Array, LayerPages, jax.Array | None]:
    """Self-attention of one layer: project, QK-norm, RoPE, write K/V pages, attend (dense or MSA). The
    projection weights (p["attn"]["w*"], p["index"]["w*"]) are the run's whole stacks, read at `layer`."""
    a = p["attn"]
    impl, topo, inv = kernels.attention, kernels.topology, kernels.batch_invariant
    # Every projection of h, in one launch at decode sizes: q, k, v, and the index branch's q and k when this
    # layer selects its own blocks (a layer reusing another's selection never reads them).
    selects = kind != "dense" and (reuse_blocks is None or recompute is True)
    q, k, v, *index_qk = ops.project_many(h_TD, projections_of_h(p, selects), impl=impl, topology=topo, layer=layer,
                                          invariant=inv)
    q = rms_norm(q, a["q_norm"], cfg.rms_norm_eps, kernels)
    k = rms_norm(k, a["k_norm"], cfg.rms_norm_eps, kernels)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # norm before RoPE; V gets neither
    k_pages = ops.write_kv_pages(pages.k, k, batch.slot_mapping, impl=impl, topology=topo)
    v_pages = ops.write_kv_pages(pages.v, v, batch.slot_mapping, impl=impl, topology=topo)
    scale = cfg.head_dim ** -0.5

    index_k, blocks = pages.index_k, None
    if kind == "dense":
        o = ops.paged_dense_attention(q, k_pages, v_pages, batch.page_table, batch.token_row, batch.positions, scale,
                                      impl=impl, topology=topo, invariant=inv)
    else:
        def select() -> tuple[jax.Array, jax.Array]:
            return msa_select(p["index"], cfg, h_TD, batch, rope, index_k, kernels, layer, index_qk or None)

        # Cross-layer top-k reuse (opt-in): a reusing layer's index-K is never read, so it is not written.
        if reuse_blocks is None or recompute is True:
            index_k, blocks = select()
        elif recompute is False:
            blocks = reuse_blocks
        else:  # decided per layer inside a scan
            index_k, blocks = jax.lax.cond(recompute, select, lambda: (index_k, reuse_blocks))
        o = ops.paged_block_sparse_attention(q, k_pages, v_pages, batch.page_table, batch.token_row,
                                             batch.positions, blocks, scale=scale, impl=impl, topology=topo,
                                             invariant=inv, union=kernels.sparse_prefill == "union")
    out = ops.project(o, a["wo"], "attn.wo", impl=impl, topology=topo, layer=layer, invariant=inv)
    return out, LayerPages(k_pages, v_pages, index_k), blocks


# ---- MLPs --------------------------------------------------------------------------------------------------

def mlp(p: Params, cfg: M3Config, kind: str, h_TD: jax.Array, batch: Batch, kernels: KernelChoice,
        layer: jax.Array | int) -> jax.Array:
    """The dense MLP's weights and the MoE's prepared experts (p["moe"]["experts"]) are the run's whole stacks,
    read at `layer`."""
    if kind == "dense":
        m = p["mlp"]
        return ops.dense_mlp(h_TD, m["w_gate"], m["w_up"], m["w_down"], alpha=cfg.swiglu_alpha,
                             limit=cfg.swiglu_limit, impl=kernels.moe, topology=kernels.topology, layer=layer,
                             invariant=kernels.batch_invariant)
    return ops.moe(h_TD, p["moe"], top_k=cfg.num_experts_per_tok, routed_scaling=cfg.routed_scaling_factor,
                   alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, impl=kernels.moe,
                   layer=layer if "experts" in p["moe"] else None, num_valid=batch.query_start[-1],
                   topology=kernels.topology, invariant=kernels.batch_invariant)


# ---- the decoder -------------------------------------------------------------------------------------------

def decoder_layer(lp: Params, cfg: M3Config, run: LayerRun, x_TD: jax.Array, batch: Batch,
                  rope: tuple[jax.Array, ...], pages: LayerPages, reuse_blocks: jax.Array | None,
                  recompute: jax.Array | bool, kernels: KernelChoice, layer: jax.Array | int
                  ) -> tuple[jax.Array, LayerPages, jax.Array | None]:
    """Pre-norm residual block: x + attention(norm(x)), then + MLP(norm(x)). `lp` is layer `layer`'s weights,
    except the big matrices (`IN_PLACE`), which are the run's whole stacks."""
    h_TD = rms_norm(x_TD, lp["input_norm"], cfg.rms_norm_eps, kernels)
    o, pages, blocks = attention(lp, cfg, run.attn, h_TD, batch, rope, pages, reuse_blocks, recompute, kernels, layer)
    x_TD = x_TD + o
    h_TD = rms_norm(x_TD, lp["post_attn_norm"], cfg.rms_norm_eps, kernels)
    x_TD = x_TD + mlp(lp, cfg, run.mlp, h_TD, batch, kernels, layer)
    return x_TD, pages, blocks


# The weights each layer reads in place from its run's stack [layers, ...] (group -> names; see `run_layers`).
IN_PLACE = {"attn": ("wq", "wk", "wv", "wo"), "index": ("wq", "wk"), "mlp": ("w_gate", "w_up", "w_down"),
            "moe": ("experts",)}


def split_in_place(rp: Params) -> tuple[Params, Params]:
    """A run's stacked weights as (the `IN_PLACE` matrices, kept whole; the rest, which the scan slices per
    layer)."""
    whole = {g: {n: rp[g][n] for n in names if n in rp.get(g, {})} for g, names in IN_PLACE.items()}
    rest = {g: ({n: w for n, w in v.items() if n not in whole.get(g, {})} if g in whole else v) for g, v in rp.items()}
    return whole, rest


def with_in_place(lp: Params, whole: Params) -> Params:
    """One layer's sliced weights with the run's whole `IN_PLACE` stacks put back (read at the layer index)."""
    return {g: {**v, **whole[g]} if g in whole else v for g, v in lp.items()}


def run_layers(rp: Params, cfg: M3Config, run: LayerRun, x_TD: jax.Array, batch: Batch,
               rope: tuple[jax.Array, ...], pages: LayerPages, blocks: jax.Array | None, kernels: KernelChoice,
               unroll: bool = False, capture: tuple[int, ...] = (), aux_ATD: jax.Array | None = None
               ) -> tuple[jax.Array, LayerPages, jax.Array | None, jax.Array | None, jax.Array | None]:
    """A run's layers as one `lax.scan` over their stacked weights (`rp`, leading layer axis), or with `unroll`
    as a Python loop over the same layer function (for code that must see each layer's ops at the top level,
    such as training's routing statistics). Returns the new residual stream, the run's pages, the last selection
    (for the next run's reuse), every layer's selection [layers, T, K, N] (sparse runs; unused outputs cost
    nothing once XLA drops them), and `aux_ATD` with the residual stream at the input of each layer of `capture`
    written into its slot (what an EAGLE-3 draft reads)."""
    num_pages = pages.k.shape[0] // run.count
    ps = pages.k.shape[1]
    sparse = run.attn == "sparse"
    if sparse and blocks is None:
        blocks = jnp.full((batch.num_tokens, cfg.num_kv_heads, cfg.index_topk_blocks), -1, jnp.int32)
    # Which layers select their own blocks (all of them unless cross-layer top-k reuse is on): static when every
    # layer does, so the default traces no cond.
    selects = [cfg.index_recomputes(i) for i in run.layers] if sparse else [True] * run.count
    recompute_all = all(selects)

    # The aux slot each layer's input goes to (-1: none).
    slots = [capture.index(i) if i in capture else -1 for i in run.layers]
    capturing = any(s >= 0 for s in slots)
    # The big matrices are not sliced by the scan: the ops read the whole stack at the layer (a sliced operand of
    # a custom call is copied into a buffer of its own every iteration, all of a layer's weights).
    whole, rp = split_in_place(rp)

    def layer(carry: tuple, xs: tuple) -> tuple[tuple, jax.Array | None]:
        x, pages, reuse, aux = carry
        lp, j, recompute, slot = xs
        lp = with_in_place(lp, whole)
        if capturing:
            if isinstance(slot, int):  # unrolled: static
                aux = aux if slot < 0 else aux.at[slot].set(x)
            else:  # no lax.cond: on the GPU its predicate is read back on the host, stalling the dispatch
                at = jnp.maximum(slot, 0)
                aux = jax.lax.dynamic_update_index_in_dim(aux, jnp.where(slot >= 0, x, aux[at]), at, 0)
        x, pages, sel = decoder_layer(lp, cfg, run, x, batch.with_page_offset(j * num_pages, ps), rope, pages,
                                      reuse if sparse else None, True if recompute_all else recompute, kernels, j)
        return (x, pages, sel if sparse else reuse, aux), sel

    if unroll:
        carry, per_layer = (x_TD, pages, blocks, aux_ATD), []
        for j in range(run.count):
            carry, sel = layer(carry, (jax.tree.map(lambda a, j=j: a[j], rp), j, selects[j], slots[j]))
            per_layer.append(sel)
        (x_TD, pages, blocks, aux_ATD) = carry
        return x_TD, pages, blocks, jnp.stack(per_layer) if sparse else None, aux_ATD
    xs = (rp, jnp.arange(run.count, dtype=jnp.int32), jnp.asarray(selects), jnp.asarray(slots, jnp.int32))
    (x_TD, pages, blocks, aux_ATD), selections = jax.lax.scan(layer, (x_TD, pages, blocks, aux_ATD), xs)
    return x_TD, pages, blocks, selections, aux_ATD


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOutput:
    logits: jax.Array  # [L, vocab] fp32, one row per batch.logit_rows entry
    kv: KVPages
    selections: dict[int, jax.Array]  # sparse layer -> logical blocks [T, K, N] (-1 padded)
    # [len(capture), T, D]: the residual stream at the input of each captured layer (None without capture).
    aux_hidden: jax.Array | None = None
    # [T, D]: every token's final-normed hidden state, what the lm_head reads (with `all_hidden`; prompt logprobs).
    hidden: jax.Array | None = None


def lm_head(x_TD: jax.Array, w_DV: jax.Array, kernels: KernelChoice) -> jax.Array:
    """fp32 logits [T, V]. Batch-invariant kernels take the lm_head through the Pallas linear kernel (one tile set
    at every row count; x handed over in fp32 so that the kernel writes fp32); XLA's GEMM otherwise."""
    if kernels.batch_invariant:
        return ops.project(x_TD.astype(jnp.float32), w_DV, "lm_head", impl=kernels.attention,
                           topology=kernels.topology, invariant=True)
    return jnp.einsum("td,dv->tv", x_TD, w_DV, preferred_element_type=jnp.float32)


def forward(params: Params, cfg: M3Config, kv: KVPages, batch: Batch, kernels: KernelChoice,
            unroll: bool = False, capture: tuple[int, ...] = (), all_hidden: bool = False) -> ForwardOutput:
    """One step of M3 over a flat ragged batch: every token's K/V/index-K is written to its slot, every token
    attends to its own request's pages up to its position, and logits come only for `batch.logit_rows`.
    `kernels` must be resolved (no "auto"): it is static, part of the compiled step's identity. `unroll`: layers
    in a Python loop instead of scans (same function; see `run_layers`). `capture`: layer ids whose input
    residual stream (every token's) comes back as `aux_hidden`, for an EAGLE-3 draft. `all_hidden`: every token's
    final-normed hidden state comes back as `hidden` (the norm is per token, so the logit rows are rows of it)."""
    if not kernels.resolved:
        raise ValueError(f"{kernels} is not resolved: call KernelChoice.resolve() first")
    x = params["embed"][batch.token_ids]  # [T, D]; no embedding scale in M3
    rope = rope_tables(batch.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
    aux = jnp.zeros((len(capture), *x.shape), x.dtype) if capture else None
    new_kv = KVPages([], [], [])
    selections: dict[int, jax.Array] = {}
    blocks = None
    # The attention ops' query blocks depend on token_row and positions alone: computed once here, not per layer.
    with ops.step_query_blocks(batch.token_row, batch.positions, batch.page_table.shape[0], impl=kernels.attention):
        for r, run in enumerate(cfg.layer_runs):
            # The run's pool as one flat page axis: a reshape of contiguous memory, free in and out of the scan.
            flat = LayerPages(*(None if a is None else a.reshape(-1, *a.shape[2:])
                                for a in (kv.k[r], kv.v[r], kv.index_k[r])))
            x, flat, blocks, sel, aux = run_layers(params["runs"][r], cfg, run, x, batch, rope, flat, blocks,
                                                   kernels, unroll, capture, aux)
            new_kv.k.append(flat.k.reshape(kv.k[r].shape))
            new_kv.v.append(flat.v.reshape(kv.v[r].shape))
            new_kv.index_k.append(None if flat.index_k is None else flat.index_k.reshape(kv.index_k[r].shape))
            if sel is not None:
                selections.update({i: sel[j] for j, i in enumerate(run.layers)})

    hidden = None
    if all_hidden:  # the norm is per token: the logit rows are rows of every token's normed state
        hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, kernels)
        x = hidden[batch.logit_rows]
    else:
        x = rms_norm(x[batch.logit_rows], params["final_norm"], cfg.rms_norm_eps, kernels)
    logits = lm_head(x, params["lm_head"], kernels)
    return ForwardOutput(logits, new_kv, selections, aux, hidden)
