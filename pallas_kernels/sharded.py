"""The hot ops on several devices: each wrapped in a `jax.shard_map`, so that every device runs the kernel (or the
reference) on its own shard. XLA cannot partition a `pallas_call`: given sharded operands it would gather them onto
every device first. What each device holds and runs is `pallas_kernels/topology.py`'s decision (its docstring
has the table); the operand specs come from the one rules table through `Topology.spec_for`; inside, the
family's dispatch picks tiles from the shard's shapes.

`pallas_kernels.ops` calls these when `topology.sharded`; the functions take the arguments of their single-device
counterparts plus the topology. Under jit the shard_maps bind to the operands' mesh (an abstract mesh of
`topology.size` devices; `Topology.mesh`).

Logical axes of the operands (the rules table's names): q `[T, H, hd]` (tokens, q_heads, head_dim); the flat K/V
pools `[pages, page_size, K', hd]` (pages, page_slots, kv_heads, head_dim), K' = `Topology.kv_heads`; new K/V rows
`[T, K, hd]`; index queries `[T, K, hdi]` (tokens, index_heads, head_dim); selections `[T, K, topk]` (tokens,
kv_heads, topk); the index-K pool and everything of the batch: replicated. MoE: the params' own axes
(m3jax/params.py) and, for the prepared stacks, (layers,) expert_slots, embed / expert_mlp (`expert_axes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.attention import dispatch as attn
from pallas_kernels.attention import ragged
from pallas_kernels.linear import dispatch as lin
from pallas_kernels.moe import dispatch as moe_dispatch
from pallas_kernels.moe import layout
from pallas_kernels.moe.kernel import experts_of, kernel_tiles, pairs_pallas
from pallas_kernels.moe.reference import dense_mlp as xla_dense_mlp
from pallas_kernels.moe.reference import route, routed_experts
from pallas_kernels.moe.tiles import invariant_tiles
from pallas_kernels.topology import Topology

__all__ = ["paged_dense_attention", "paged_select_blocks", "paged_block_sparse_attention", "write_kv_pages", "moe",
           "expert_axes", "expert_spec", "moe_specs", "project_many", "project_local_many", "dense_mlp",
           "moe_ep_device", "local_shape"]

_Q = ("tokens", "q_heads", "head_dim")
_POOL = ("pages", "page_slots", "kv_heads", "head_dim")
_NEW_KV = ("tokens", "kv_heads", "head_dim")
_INDEX_Q = ("tokens", "index_heads", "head_dim")
_BLOCKS = ("tokens", "kv_heads", "topk")


def _smap(topology: Topology, fn: Callable[..., Any], in_specs: Any, out_specs: Any) -> Callable[..., Any]:
    # check_vma=False: the kernels' out_shape structs carry no varying-axes annotation; the specs here state
    # which outputs are replicated, and the tests hold them to it (every device's shard equals TP1's).
    return jax.shard_map(fn, mesh=topology.mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=False)


def mean_square(x_ND: jax.Array, *, impl: str, topology: Topology) -> jax.Array:
    """`lin.mean_square` on every device over the whole (replicated) activations."""
    return _smap(topology, lambda x: lin.mean_square(x, impl=impl), (P(),), P())(x_ND)


def _device(topology: Topology) -> jax.Array:
    return jax.lax.axis_index(topology.axis)


def _group_of_device(topology: Topology, num_groups: int) -> jax.Array:
    """replicate_kv: the KV group (= KV head = index head) device i serves, i // (size / K)."""
    return _device(topology) // (topology.size // num_groups)


def _pick_group(x_TG: jax.Array, topology: Topology) -> jax.Array:
    """x[:, g : g + 1] for this device's group g (replicated operands of a replicate_kv device)."""
    g = _group_of_device(topology, x_TG.shape[1])
    return jax.lax.dynamic_slice_in_dim(x_TG, g, 1, axis=1)


def _heads_split(topology: Topology, num_heads: int, pool_heads: int) -> bool:
    """Query heads and the pool's KV heads both split (modes split and replicate_kv); else the op runs whole on
    every device."""
    return (topology.splits("q_heads", num_heads) and topology.splits("kv_heads", pool_heads)
            and num_heads % pool_heads == 0)


def _attention_specs(topology: Topology, q: jax.Array, pool: jax.Array) -> tuple[P, P, bool]:
    split = _heads_split(topology, q.shape[1], pool.shape[2])
    if not split:
        return P(), P(), False
    return topology.spec_for(q.shape, _Q), topology.spec_for(pool.shape, _POOL), True


def _copies(token_row_T: jax.Array, pos_T: jax.Array, page_table_RN: jax.Array) -> dict[int, ragged.QueryBlocks]:
    """The step's query blocks (`ragged.step_query_blocks`), handed into an attention op's shard_map as replicated
    operands: inside, the body's own token_row / pos take them (`ragged.given_query_blocks`) instead of computing
    them in every layer. Sizes the op does not read are dropped by XLA."""
    return ragged.step_copies(token_row_T, pos_T, page_table_RN.shape[0])


def paged_dense_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table_RN: jax.Array,
                          token_row_T: jax.Array, pos_T: jax.Array, scale: float, *, impl: str,
                          topology: Topology, invariant: bool = False) -> jax.Array:
    q_spec, pool_spec, _ = _attention_specs(topology, q_THD, k_pages)

    def local(q, kp, vp, pt, row, pos, copies):
        with ragged.given_query_blocks(row, pos, pt.shape[0], copies):
            return attn.paged_dense_attention(q, kp, vp, pt, row, pos, scale, impl=impl, invariant=invariant)

    return _smap(topology, local, (q_spec, pool_spec, pool_spec, P(), P(), P(), P()), q_spec)(
        q_THD, k_pages, v_pages, page_table_RN, token_row_T, pos_T, _copies(token_row_T, pos_T, page_table_RN))


def paged_block_sparse_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                 page_table_RN: jax.Array, token_row_T: jax.Array, pos_T: jax.Array,
                                 blocks_TGN: jax.Array, *, scale: float, impl: str, topology: Topology,
                                 invariant: bool = False, union: bool = False) -> jax.Array:
    q_spec, pool_spec, split = _attention_specs(topology, q_THD, k_pages)
    blocks_spec = topology.spec_for(blocks_TGN.shape, _BLOCKS) if split else P()
    local_groups = k_pages.shape[2] // topology.size if split else k_pages.shape[2]

    def local(q, kp, vp, pt, row, pos, blocks, copies):
        if blocks.shape[1] != local_groups:  # replicate_kv: every device holds all groups' selections
            blocks = _pick_group(blocks, topology)
        with ragged.given_query_blocks(row, pos, pt.shape[0], copies):
            return attn.paged_block_sparse_attention(q, kp, vp, pt, row, pos, blocks, scale=scale, impl=impl,
                                                     invariant=invariant, union=union)

    return _smap(topology, local, (q_spec, pool_spec, pool_spec, P(), P(), P(), blocks_spec, P()), q_spec)(
        q_THD, k_pages, v_pages, page_table_RN, token_row_T, pos_T, blocks_TGN,
        _copies(token_row_T, pos_T, page_table_RN))


def paged_select_blocks(iq_TGD: jax.Array, ik_pages: jax.Array, page_table_RN: jax.Array, token_row_T: jax.Array,
                        pos_T: jax.Array, *, topk: int, local_blocks: int, init_blocks: int = 0, impl: str,
                        topology: Topology, invariant: bool = False) -> jax.Array:
    G = iq_TGD.shape[1]
    kw = {"topk": topk, "local_blocks": local_blocks, "init_blocks": init_blocks, "impl": impl,
          "invariant": invariant}
    args = (iq_TGD, ik_pages, page_table_RN, token_row_T, pos_T, _copies(token_row_T, pos_T, page_table_RN))

    def select(iq, ik, pt, row, pos, copies):
        with ragged.given_query_blocks(row, pos, pt.shape[0], copies):
            return attn.paged_select_blocks(iq, ik, pt, row, pos, **kw)

    if topology.splits("index_heads", G):  # split: a device scores its own groups
        spec = topology.spec_for(iq_TGD.shape, _INDEX_Q)
        return _smap(topology, select, (spec, P(), P(), P(), P(), P()), spec)(*args)
    if topology.mesh_axis("index_heads") == topology.axis and topology.size % G == 0:
        # replicate_kv: a device scores its own group only; the selections are all-gathered (tiny: int32 ids), so
        # every device holds [T, K, topk] as the model carries it from layer to layer.
        r = topology.size // G

        def local_group(iq, ik, pt, row, pos, copies):
            mine = select(_pick_group(iq, topology), ik, pt, row, pos, copies)  # [T, 1, topk]
            every = jax.lax.all_gather(mine, topology.axis, axis=1, tiled=True)  # [T, size, topk]
            return every[:, ::r]

        return _smap(topology, local_group, (P(),) * 6, P())(*args)
    return _smap(topology, select, (P(),) * 6, P())(*args)


def write_kv_pages(pages: jax.Array, new_T: jax.Array, slot_T: jax.Array, *, impl: str,
                   topology: Topology) -> jax.Array:
    """K / V rows into a KV pool `[pages, page_size, K', hd]` (each device its own heads' pages; with replicated
    KV heads, K' = devices and each device writes its group's head), or index-K rows into the replicated index
    pool `[pages, page_size, hdi]` (every device the same rows)."""
    if pages.ndim == 4 and topology.splits("kv_heads", pages.shape[2]):
        pool_spec = topology.spec_for(pages.shape, _POOL)
        expanded = new_T.shape[1] != pages.shape[2]  # replicate_kv: [T, K] rows into a `devices`-wide pool
        new_spec = P() if expanded else topology.spec_for(new_T.shape, _NEW_KV)

        def local(pg, new, slot):
            return attn.write_kv_pages(pg, _pick_group(new, topology) if expanded else new, slot, impl=impl)

        return _smap(topology, local, (pool_spec, new_spec, P()), pool_spec)(pages, new_T, slot_T)

    def whole(pg, new, slot):
        return attn.write_kv_pages(pg, new, slot, impl=impl)

    return _smap(topology, whole, (P(), P(), P()), P())(pages, new_T, slot_T)


# ---- dense linears (the small-M kernel) ---------------------------------------------------------------------


def project_many(x: jax.Array, ws: list[jax.Array], ws_axes: list[tuple[str, ...]], *, impl: str,
                 topology: Topology, layer: jax.Array | int | None = None, invariant: bool = False
                 ) -> list[jax.Array]:
    """x [T, *in] @ each w [*in, *out] (w's first x.ndim - 1 axes contracted) through the small-M linear kernel on
    each device's shard of the weights, one launch per device for all of them (`project_local_many`):
    column-parallel when an output axis is split (x whole, the output split like it), row-parallel when a
    contracted one is (x split like it, partial outputs summed), whole when neither is. The weights' contracted
    axes must split alike, so that one x shard serves them all. Only called where the kernel takes the shards'
    shapes (`ops.project_many`); XLA's GEMMs partition themselves. `layer`: the weights are a scan's stacks
    [layers, *in, *out], read at that layer (the layer axis unsplit)."""
    n_in = x.ndim - 1
    stacked = layer is not None
    shapes = [w.shape[1:] if stacked else w.shape for w in ws]
    specs = [tuple(topology.spec_for(shape, axes)) + (None,) * len(shape)
             for shape, axes in zip(shapes, ws_axes, strict=True)]
    if len({spec[:n_in] for spec in specs}) != 1:
        raise ValueError(f"project_many: the weights' contracted axes split differently: {ws_axes}")
    x_spec = P(None, *specs[0][:n_in])
    out_specs = [P(None, *spec[n_in:len(shape)]) for spec, shape in zip(specs, shapes, strict=True)]
    summed = any(a is not None for a in specs[0][:n_in])

    def local(xl, ll, *wls):
        ys = project_local_many(xl, list(wls), impl=impl, layer=ll if stacked else None, invariant=invariant)
        return [jax.lax.psum(y, topology.axis) for y in ys] if summed else ys

    w_specs = [P(None, *spec[:len(shape)]) if stacked else P(*spec[:len(shape)])
               for spec, shape in zip(specs, shapes, strict=True)]
    return _smap(topology, local, (x_spec, P(), *w_specs), out_specs)(x, _layer_arg(layer), *ws)


def project_local_many(x: jax.Array, ws: list[jax.Array], *, impl: str, layer: jax.Array | int | None = None,
                       invariant: bool = False) -> list[jax.Array]:
    """On one device: x [T, *in] @ each w [*in, *out_i] as 2-D GEMMs, in one kernel launch where one tile set fits
    them all (`linear.dispatch.linear_many`)."""
    n_in = x.ndim - 1
    stacked = layer is not None
    shapes = [w.shape[1:] if stacked else w.shape for w in ws]
    k = math.prod(shapes[0][:n_in])
    w2s = [w.reshape(w.shape[0], k, -1) if stacked else w.reshape(k, -1) for w in ws]
    ys = lin.linear_many(x.reshape(x.shape[0], k), w2s, impl=impl, layer=layer, invariant=invariant)
    return [y.reshape(x.shape[0], *shape[n_in:]) for y, shape in zip(ys, shapes, strict=True)]


def _layer_arg(layer: jax.Array | int | None) -> jax.Array:
    """A stacked weight's layer as a replicated shard_map operand (0, unused, when the weight is not stacked)."""
    return jnp.asarray(0 if layer is None else layer, jnp.int32)


def local_shape(shape: tuple[int, ...], axes: tuple[str, ...], topology: Topology) -> tuple[int, ...]:
    """A shard's shape under the rules."""
    spec = tuple(topology.spec_for(shape, axes)) + (None,) * len(shape)
    return tuple(d // topology.size if a is not None else d for d, a in zip(shape, spec, strict=False))


def dense_mlp(h_TD: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *, alpha: float, limit: float,
              impl: str, topology: Topology, layer: jax.Array | int | None = None,
              invariant: bool = False) -> jax.Array:
    """The dense SwiGLU-OAI MLP through the small-M kernel on each device's share of F (gate / up columns, down
    rows), the partial outputs summed. `layer`: the weights are a scan's stacks, read at that layer."""
    stacked = layer is not None
    lead = (None,) if stacked else ()
    cols = P(*lead, *topology.spec_for(w_gate.shape[-2:], ("embed", "mlp")))
    rows_spec = topology.spec_for(w_down.shape[-2:], ("mlp", "embed"))
    summed = rows_spec != P()
    rows = P(*lead, *rows_spec)

    def local(h, g, u, d, ll):
        y = moe_dispatch.kernel_dense_mlp(h, g, u, d, alpha=alpha, limit=limit, impl=impl,
                                          layer=ll if stacked else None, invariant=invariant)
        return jax.lax.psum(y, topology.axis) if summed else y

    return _smap(topology, local, (P(), cols, cols, rows, P()), P())(h_TD, w_gate, w_up, w_down, _layer_arg(layer))


# ---- MoE ---------------------------------------------------------------------------------------------------

_DOWN_KEYS = {"down", "down_q8", "down_q4", "down_s"}


def expert_axes(key: str, ndim: int) -> tuple[str, ...]:
    """Logical axes of a prepared expert array (pallas_kernels/moe/layout.py): gate / up `[S, D(words), F]`,
    down `[S, F(words), D]`, with a leading layer axis on a run's stack; the MX scale words likewise."""
    if key == layout.WIDE_SCALES:
        return ("none",) * ndim
    axes = ("expert_slots", "expert_mlp", "embed") if key in _DOWN_KEYS else ("expert_slots", "embed", "expert_mlp")
    return ("layers",) * (ndim - 3) + axes


_PARAM_AXES = {
    "router": ("embed", "experts_replicated"),
    "router_bias": ("experts_replicated",),
    "w_gate": ("experts", "embed", "expert_mlp"),
    "w_up": ("experts", "embed", "expert_mlp"),
    "w_down": ("experts", "expert_mlp", "embed"),
}
_SHARED_AXES = {"w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}


def expert_spec(key: str, ndim: int, topology: Topology, mode: str) -> P:
    """The placement of a prepared expert array under MoE mode `mode`: its slots split (ep), its width split (tp:
    gate / up columns, down rows; the MX words and scale words of down hold whole 128-groups of F per device, which
    `checkpoints.prepare` checks), or replicated."""
    axes = expert_axes(key, ndim)
    split = {"ep": "expert_slots", "tp": "expert_mlp"}.get(mode)
    return P(*[topology.axis if a == split else None for a in axes]) if split in axes else P()


def moe_specs(p: dict, topology: Topology) -> dict:
    """The in_specs of one MoE layer's params (or a prepared run's: `experts` with its layer axis)."""
    mode = topology.moe_mode(p["router"].shape[-1], _d_ff(p))
    out: dict[str, Any] = {}
    for k, v in p.items():
        if k == "experts":
            out[k] = {e: expert_spec(e, a.ndim, topology, mode) for e, a in v.items()}
        elif k == "shared":
            out[k] = {e: topology.spec_for(a.shape, _SHARED_AXES[e]) for e, a in v.items()}
        else:
            out[k] = topology.spec_for(v.shape, _PARAM_AXES[k])
    return out


def _d_ff(p: dict) -> int:
    if "experts" in p:
        return int(layout.weight_arrays(p["experts"], "gate")[0].shape[-1])
    return int(p["w_gate"].shape[-1])


def moe(h_TD: jax.Array, p: dict, *, top_k: int, routed_scaling: float, alpha: float, limit: float, impl: str,
        layer: jax.Array | int | None = None, num_valid: jax.Array | None = None,
        topology: Topology, invariant: bool = False) -> jax.Array:
    """`moe_dispatch.moe` on the devices of `topology`: split by each expert's width (tp: every device all slots
    over F / devices, partial outputs summed), by experts (ep: see `moe_ep_device`), or whole everywhere."""
    E = p["router"].shape[-1]
    mode = topology.moe_mode(E, _d_ff(p))
    specs = moe_specs(p, topology)
    shared_split = "shared" in p and specs["shared"]["w_gate"] != P()
    kw = {"top_k": top_k, "routed_scaling": routed_scaling, "alpha": alpha, "limit": limit, "impl": impl}
    stacked = layer is not None
    j_in = jnp.asarray(layer if stacked else 0, jnp.int32)
    n_in = jnp.asarray(h_TD.shape[0] if num_valid is None else num_valid, jnp.int32)

    def local(h, lp, j, n):
        j = j if stacked else None
        if mode == "ep":
            out = moe_ep_device(h, lp, device=_device(topology), num_devices=topology.size, layer=j, num_valid=n,
                                shared_split=shared_split, invariant=invariant, **kw)
        else:
            out = moe_dispatch.moe(h, lp, layer=j, num_valid=n, invariant=invariant, **kw)
        # The partial outputs of tp / ep, summed in the activation dtype (what a row-parallel GEMM's all-reduce
        # moves: bf16 on the GPU).
        return jax.lax.psum(out, topology.axis) if mode != "replicated" else out

    return _smap(topology, local, (P(), specs, P(), P()), P())(h_TD, p, j_in, n_in)


def moe_ep_device(h_TD: jax.Array, p: dict, *, device: jax.Array | int, num_devices: int, top_k: int,
                  routed_scaling: float, alpha: float, limit: float, impl: str, layer: jax.Array | None,
                  num_valid: jax.Array, shared_split: bool, invariant: bool = False) -> jax.Array:
    """Expert-parallel device `device` of `num_devices` (`p`: its shard of the params): every token is routed
    (the router is replicated, so every device routes alike), the pairs of this device's experts
    [lo, lo + E/devices) run on its slots, the others are computed nowhere here (`pairs_pallas`' skipped slot).
    A prepared stack holds the whole shared expert as the device's last slot: it runs for the tokens t with
    t % devices == this device (each token's shared output computed once across the devices); an unstacked
    shared expert is a dense MLP over the device's share of its width (or, when the rules leave its width
    whole, over the device's tokens). Returns this device's partial [T, D] (the caller sums the devices')."""
    T = h_TD.shape[0]
    E = p["router"].shape[-1]
    n_dev, me = num_devices, device
    El = E // n_dev
    experts, _ = experts_of(p)
    slots = layout.num_slots(experts)  # local slots: El, or El + 1 with the shared expert stacked
    shared_slot = "experts" in p and slots == El + 1

    routing = moe_dispatch.invariant_routing(h_TD, p, impl) if invariant and impl != "reference" else {}
    idx_TK, w_TK = route(h_TD, p["router"], p["router_bias"], top_k, routing.get("router_logits"))
    t = jnp.arange(T, dtype=jnp.int32)
    pad_T = t >= num_valid
    # Padding rows are computed nowhere (as in moe_pallas): their outputs are never read.
    mine_TK = (idx_TK >= me * El) & (idx_TK < (me + 1) * El) & ~pad_T[:, None]
    e_TJ = jnp.where(mine_TK, idx_TK - me * El, slots).astype(jnp.int32)  # slots: computed nowhere on this device
    w_TJ = jnp.where(mine_TK, w_TK * routed_scaling, 0.0).astype(jnp.float32)
    if shared_slot:
        ours_T = (t % n_dev == me) & ~pad_T  # padding rows' outputs are never read: no shared rows for them
        e_TJ = jnp.concatenate([e_TJ, jnp.where(ours_T, slots - 1, slots)[:, None]], axis=1)
        w_TJ = jnp.concatenate([w_TJ, ours_T.astype(jnp.float32)[:, None]], axis=1)

    tiles = (invariant_tiles(layout.weight_format(experts), T, interpret=impl == "interpret")
             if invariant and impl != "reference" else None)
    use_kernel = impl != "reference" and kernel_tiles(T, experts, tiles=tiles) is not None
    if use_kernel:
        out = pairs_pallas(h_TD, e_TJ, w_TJ, experts, alpha=alpha, limit=limit, interpret=impl == "interpret",
                           layer=layer if "experts" in p else None, tiles=tiles)
    else:  # the jnp reference of the same pairs: dequantised local slots through ragged_dot
        if "experts" in p:
            local = {k: v[layer] if layer is not None and k != layout.WIDE_SCALES else v for k, v in experts.items()}
            dense = layout.dequantize_experts(local, h_TD.dtype)
        else:
            dense = experts
        valid = e_TJ < slots
        out = routed_experts(h_TD, jnp.where(valid, e_TJ, 0), jnp.where(valid, w_TJ, 0.0), dense["gate"], dense["up"],
                             dense["down"], alpha=alpha, limit=limit)
    if "shared" in p and not shared_slot:
        s = p["shared"]
        sh = routing.get("shared_mlp", xla_dense_mlp)(h_TD, s["w_gate"], s["w_up"], s["w_down"], alpha=alpha,
                                                       limit=limit)
        out = out + (sh if shared_split else jnp.where((t % n_dev == me)[:, None], sh, 0))
    return out.astype(h_TD.dtype)
