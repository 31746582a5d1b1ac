"""MoE / MLP implementation choice: the one place that picks kernel or reference for the MoE ops.

`moe(..., impl=...)` takes the MoE part of a resolved `pallas_kernels.choice.KernelChoice` (a static value of the
forward): "pallas" (the Pallas grouped-GEMM kernels; what `KernelChoice.resolve` picks on GPUs: on several, each
device runs this on its shard inside pallas_kernels/sharded.py's shard_map),
"interpret" (the same kernels run by the Pallas interpreter, how CI checks them on the CPU) or "reference".

The kernels read the layout that `checkpoints.prepare.prepare_params` adds at load time, `p["experts"]` (keys
and shapes in pallas_kernels/moe/layout.py: dense bf16, MXFP8 or MXFP4, the shared expert as one more slot).
Without it they read the params' own w_gate / w_up / w_down in place (bf16 only) and run the shared expert
through XLA. Tile shapes per token count come from pallas_kernels/moe/tiles.py.

`dense_mlp` here (layers 0-2) is the XLA reference: three dense GEMMs that XLA already runs near its matmul rate at
prefill sizes; `pallas_kernels.ops.dense_mlp` takes the small-M linear kernel (pallas_kernels/linear) at M <= 64.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.choice import IMPLS
from pallas_kernels.linear.dispatch import linear, linear_fp32
from pallas_kernels.moe import layout, reference
from pallas_kernels.moe.kernel import experts_of, kernel_tiles, moe_pallas
from pallas_kernels.moe.reference import dense_mlp
from pallas_kernels.moe.tiles import invariant_tiles

__all__ = ["dense_mlp", "moe"]


def moe(h_TD: jax.Array, p: dict, *, top_k: int, routed_scaling: float, alpha: float, limit: float,
        impl: str, layer: jax.Array | int | None = None, num_valid: jax.Array | None = None,
        invariant: bool = False) -> jax.Array:
    """`layer`: p["experts"] (the prepared layout) is a whole run's stack [layers, S, ...] and this is layer
    `layer`; the other params are that layer's. `num_valid`: the rows of h past it are a bucket's padding.
    `invariant`: the batch-invariant tiles (tiles.invariant_tiles) instead of the table's for this T."""
    if impl not in IMPLS:
        raise ValueError(f"MoE impl {impl!r}: expected one of {IMPLS} (resolve the KernelChoice first)")
    tiles = None
    if impl != "reference" and invariant:
        tiles = invariant_tiles(layout.weight_format(experts_of(p)[0]), h_TD.shape[0],
                                interpret=impl == "interpret")
    if impl != "reference" and kernel_tiles(h_TD.shape[0], experts_of(p)[0], tiles=tiles) is None:
        impl = "reference"  # shapes no tile divides (tiny test configs; MXFP4 needs K % 128 == 0)
    if impl == "reference":
        if layer is not None and "experts" in p:
            p = dict(p, experts={k: v[layer] if k != layout.WIDE_SCALES else v for k, v in p["experts"].items()})
        # Prepared-only params (no w_gate left) are dequantised back: the reference of what the kernel computes.
        ref_p = layout.reference_params(p, h_TD.dtype) if "w_gate" not in p else p
        return reference.moe(h_TD, ref_p, top_k=top_k, routed_scaling=routed_scaling, alpha=alpha, limit=limit)
    return moe_pallas(h_TD, p, top_k=top_k, routed_scaling=routed_scaling, alpha=alpha, limit=limit,
                      interpret=impl == "interpret", layer=layer, num_valid=num_valid, tiles=tiles,
                      **(invariant_routing(h_TD, p, impl) if invariant else {}))


def kernel_dense_mlp(h_TD: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *, alpha: float,
                     limit: float, impl: str, layer: jax.Array | int | None = None,
                     invariant: bool = False) -> jax.Array:
    """`dense_mlp` through the linear kernel (its small-M tiles, or the batch-invariant ones at any M); `layer`:
    the weights are a scan's stacks, read at that layer. Callers check `linear.dispatch.uses_kernel` first."""
    kw = {"impl": impl, "layer": layer, "invariant": invariant}
    act = reference.swiglu_oai(linear(h_TD, w_gate, **kw), linear(h_TD, w_up, **kw), alpha=alpha, limit=limit)
    return linear(act, w_down, **kw)


def invariant_routing(h_TD: jax.Array, p: dict, impl: str) -> dict:
    """moe_pallas' keyword arguments for the batch-invariant path: the router logits and an unslotted shared
    expert through the linear kernel's invariant tiles (XLA's GEMMs may regroup a row's sum with T, and a flipped
    logit re-routes a token)."""
    return {"router_logits": invariant_router_logits(h_TD, p["router"], impl=impl),
            "shared_mlp": functools.partial(kernel_dense_mlp, impl=impl, invariant=True)}


def invariant_router_logits(h_TD: jax.Array, router_DE: jax.Array, *, impl: str) -> jax.Array:
    """fp32 router logits [T, E] through the linear kernel's batch-invariant tiles (`linear_fp32`: the exact
    products of the activations and the fp32 router): XLA's GEMM may change its algorithm, and with it a row's sum,
    with T, and a flipped logit re-routes a token."""
    return linear_fp32(h_TD, router_DE, impl=impl)
