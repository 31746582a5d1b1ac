"""The one entry point the model calls for each hot op. Each op takes `impl`, its family's part of the static
`pallas_kernels.choice.KernelChoice`; the family's `dispatch` module then picks kernel tiles (or the jnp
reference where a shape cannot be tiled) from the real shapes. Callers never import a kernel directly.

`topology` (the choice's `topology`): on more than one device each op runs through its `jax.shard_map` wrapper in
`pallas_kernels/sharded.py`, every device on its own shard with the same dispatch (tiles from the shard's shapes);
on one device (the default) the dispatch is called directly."""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp

from pallas_kernels import sharded
from pallas_kernels.attention import dispatch as _attn
from pallas_kernels.attention import ragged as _ragged
from pallas_kernels.linear import dispatch as _linear
from pallas_kernels.moe import dispatch as _moe
from pallas_kernels.topology import SINGLE, Topology

__all__ = ["paged_dense_attention", "paged_select_blocks", "paged_block_sparse_attention", "write_kv_pages", "moe",
           "dense_mlp", "project", "project_many", "rms_norm_mean_square", "step_query_blocks", "PROJECTION_AXES"]

# Logical axes of the projection weights the model runs through `project` (as declared in m3jax/params.py;
# tests/test_sharding.py holds the two to each other): the sharded kernel path places them by the rules table.
PROJECTION_AXES = {
    "attn.wq": ("embed", "q_heads", "head_dim"),
    "attn.wk": ("embed", "kv_heads", "head_dim"),
    "attn.wv": ("embed", "kv_heads", "head_dim"),
    "attn.wo": ("q_heads", "head_dim", "embed"),
    "index.wq": ("embed", "index_heads", "head_dim"),
    "index.wk": ("embed", "head_dim"),
    "lm_head": ("embed", "vocab"),
}


def project(x: jax.Array, w: jax.Array, name: str, *, impl: str, topology: Topology = SINGLE,
            layer: jax.Array | int | None = None, invariant: bool = False) -> jax.Array:
    """x [T, *in] @ w [*in, *out] for the projection `name` (PROJECTION_AXES), w's leading x.ndim - 1 axes
    contracted. M = T <= 64 rows with a kernel impl: the small-M Pallas kernel (pallas_kernels/linear), per shard
    under a topology; otherwise XLA's GEMM (partitioned by XLA), exactly the einsum the model ran before.
    `layer`: w is a layer scan's whole stack [layers, *in, *out] and this is layer `layer` (the kernel reads it in
    place: a scan-sliced kernel operand is copied every iteration). `invariant`: the batch-invariant kernel tiles
    at every T (KernelChoice.batch_invariant)."""
    return project_many(x, [(w, name)], impl=impl, topology=topology, layer=layer, invariant=invariant)[0]


def project_many(x: jax.Array, weights: list[tuple[jax.Array, str]], *, impl: str, topology: Topology = SINGLE,
                 layer: jax.Array | int | None = None, invariant: bool = False) -> list[jax.Array]:
    """`project` of several (w, name) pairs on one x: a layer's q, k and v (and its index branch's q and k), all
    from the same normed input. Where the small-M kernel takes each of them and one tile set fits their shards'
    shapes, they run as one launch whose grid covers every weight's columns: at decode sizes k, v and the index
    weights (512 or 128 columns, a few MB) are too small to fill the GPU alone, and each would pay a launch and a
    tail of its own. Otherwise each runs on its own, as `project` runs it."""
    n_in, m = x.ndim - 1, x.shape[0]
    ks, ns = [], []
    for w, name in weights:
        shape = w.shape if layer is None else w.shape[1:]
        local = sharded.local_shape(shape, PROJECTION_AXES[name], topology) if topology.sharded else shape
        ks.append(math.prod(local[:n_in]))
        ns.append(math.prod(local[n_in:]))
    k = ks[0]
    one_launch = (ks.count(k) == len(ks)
                  and len({PROJECTION_AXES[name][:n_in] for _, name in weights}) == 1  # one x shard for all
                  and _linear.tiles_for_many(m, k, ns, impl, invariant) is not None)
    if not one_launch:
        if len(weights) > 1:
            return [project(x, w, name, impl=impl, topology=topology, layer=layer, invariant=invariant)
                    for w, name in weights]
        w = weights[0][0]
        return [jnp.tensordot(x, w if layer is None else w[layer], axes=n_in)]
    ws = [w for w, _ in weights]
    if topology.sharded:
        return sharded.project_many(x, ws, [PROJECTION_AXES[name] for _, name in weights], impl=impl,
                                    topology=topology, layer=layer, invariant=invariant)
    return sharded.project_local_many(x, ws, impl=impl, layer=layer, invariant=invariant)


def rms_norm_mean_square(x: jax.Array, *, impl: str, topology: Topology = SINGLE) -> jax.Array:
    """fp32 mean of x^2 over the last axis, [..., 1], for a batch-invariant RMS norm (`linear.dispatch.mean_square`:
    the same sum for a row however many rows the step holds)."""
    flat = x.reshape(-1, x.shape[-1])
    if topology.sharded:
        ms = sharded.mean_square(flat, impl=impl, topology=topology)
    else:
        ms = _linear.mean_square(flat, impl=impl)
    return ms.reshape(*x.shape[:-1], 1)


def dense_mlp(h_TD: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *, alpha: float, limit: float,
              impl: str = "reference", topology: Topology = SINGLE, layer: jax.Array | int | None = None,
              invariant: bool = False) -> jax.Array:
    """The dense SwiGLU-OAI MLP (layers 0-2): through the small-M linear kernel where it applies to every one of
    its GEMMs at the shard's shapes (M <= 64), else XLA's GEMMs (`moe.reference.dense_mlp`). `layer`: the weights
    are a layer scan's stacks, read at that layer (as in `project`)."""
    T, D = h_TD.shape
    gate_shape = w_gate.shape[-2:]
    Fl = sharded.local_shape(gate_shape, ("embed", "mlp"), topology)[1] if topology.sharded else gate_shape[1]
    if not (_linear.uses_kernel(T, D, Fl, impl, invariant) and _linear.uses_kernel(T, Fl, D, impl, invariant)):
        if layer is not None:
            w_gate, w_up, w_down = w_gate[layer], w_up[layer], w_down[layer]
        return _moe.dense_mlp(h_TD, w_gate, w_up, w_down, alpha=alpha, limit=limit)
    if topology.sharded:
        return sharded.dense_mlp(h_TD, w_gate, w_up, w_down, alpha=alpha, limit=limit, impl=impl, topology=topology,
                                 layer=layer, invariant=invariant)
    return _moe.kernel_dense_mlp(h_TD, w_gate, w_up, w_down, alpha=alpha, limit=limit, impl=impl, layer=layer,
                                 invariant=invariant)


def step_query_blocks(token_row_T: jax.Array, pos_T: jax.Array, num_rows: int, *,
                      impl: str) -> contextlib.AbstractContextManager[None]:
    """Wrap a step's layers in it: the attention ops' query-block metadata is computed once for the step instead
    of in every layer (`attention/ragged.py` says why; the sharded ops hand it into their `shard_map`s). The
    references need none."""
    if impl == "reference":
        return contextlib.nullcontext()
    return _ragged.step_query_blocks(token_row_T, pos_T, num_rows)


def paged_dense_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table_RN: jax.Array,
                          token_row_T: jax.Array, pos_T: jax.Array, scale: float, *, impl: str,
                          topology: Topology = SINGLE, invariant: bool = False) -> jax.Array:
    args = (q_THD, k_pages, v_pages, page_table_RN, token_row_T, pos_T, scale)
    if topology.sharded:
        return sharded.paged_dense_attention(*args, impl=impl, topology=topology, invariant=invariant)
    return _attn.paged_dense_attention(*args, impl=impl, invariant=invariant)


def paged_select_blocks(iq_TGD: jax.Array, ik_pages: jax.Array, page_table_RN: jax.Array, token_row_T: jax.Array,
                        pos_T: jax.Array, *, topk: int, local_blocks: int, init_blocks: int = 0, impl: str,
                        topology: Topology = SINGLE, invariant: bool = False) -> jax.Array:
    args = (iq_TGD, ik_pages, page_table_RN, token_row_T, pos_T)
    kw = {"topk": topk, "local_blocks": local_blocks, "init_blocks": init_blocks, "impl": impl,
          "invariant": invariant}
    if topology.sharded:
        return sharded.paged_select_blocks(*args, **kw, topology=topology)
    return _attn.paged_select_blocks(*args, **kw)


def paged_block_sparse_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                 page_table_RN: jax.Array, token_row_T: jax.Array, pos_T: jax.Array,
                                 blocks_TGN: jax.Array, *, scale: float, impl: str,
                                 topology: Topology = SINGLE, invariant: bool = False,
                                 union: bool = False) -> jax.Array:
    args = (q_THD, k_pages, v_pages, page_table_RN, token_row_T, pos_T, blocks_TGN)
    kw = {"scale": scale, "impl": impl, "invariant": invariant, "union": union}
    if topology.sharded:
        return sharded.paged_block_sparse_attention(*args, **kw, topology=topology)
    return _attn.paged_block_sparse_attention(*args, **kw)


def write_kv_pages(pages: jax.Array, new_T: jax.Array, slot_T: jax.Array, *, impl: str,
                   topology: Topology = SINGLE) -> jax.Array:
    if topology.sharded:
        return sharded.write_kv_pages(pages, new_T, slot_T, impl=impl, topology=topology)
    return _attn.write_kv_pages(pages, new_T, slot_T, impl=impl)


def moe(h_TD: jax.Array, p: dict, *, top_k: int, routed_scaling: float, alpha: float, limit: float, impl: str,
        layer: jax.Array | int | None = None, num_valid: jax.Array | None = None,
        topology: Topology = SINGLE, invariant: bool = False) -> jax.Array:
    kw = {"top_k": top_k, "routed_scaling": routed_scaling, "alpha": alpha, "limit": limit, "impl": impl,
          "layer": layer, "num_valid": num_valid, "invariant": invariant}
    if topology.sharded:
        return sharded.moe(h_TD, p, **kw, topology=topology)
    return _moe.moe(h_TD, p, **kw)
