"""MoE / MLP implementation choice: the one place that picks kernel or reference for the MoE ops.

  M3JAX_MOE_IMPL unset: the Pallas grouped-GEMM kernels on a single GPU (`jax.default_backend() == "gpu"`), the
                        jnp reference elsewhere (and on several devices, until the kernels get a shard_map).
  M3JAX_MOE_IMPL=reference | pallas | interpret: force one (interpret = the Pallas kernels run by the Pallas
                        interpreter, how CI checks them on the CPU).

The kernels read the layout that `checkpoints.prepare.prepare_params` adds at load time, `p["experts"]` (keys
and shapes in pallas_kernels/moe/layout.py: dense bf16, MXFP8 or MXFP4, the shared expert as one more slot).
Without it they read the params' own w_gate / w_up / w_down in place (bf16 only) and run the shared expert
through XLA. Tile shapes per token count come from pallas_kernels/moe/tiles.py.

`dense_mlp` (layers 0-2) stays the XLA reference: three dense GEMMs that XLA already runs near its matmul
rate at prefill sizes.
"""

from __future__ import annotations

import os

import jax

from pallas_kernels.moe import layout, reference
from pallas_kernels.moe.kernel import experts_of, kernel_tiles, moe_pallas
from pallas_kernels.moe.reference import dense_mlp

__all__ = ["dense_mlp", "moe", "moe_impl"]

IMPLS = ("reference", "pallas", "interpret")


def moe_impl() -> str:
    impl = os.environ.get("M3JAX_MOE_IMPL")
    if impl:
        if impl not in IMPLS:
            raise ValueError(f"M3JAX_MOE_IMPL={impl!r}: expected one of {IMPLS}")
        return impl
    # One device only: the pallas_call has no shard_map wrapper yet, so under TP / EP sharding XLA would gather
    # every expert's weights onto each device before the kernel.
    return "pallas" if jax.default_backend() == "gpu" and jax.device_count() == 1 else "reference"


def moe(h_TD: jax.Array, p: dict, *, top_k: int, routed_scaling: float, alpha: float, limit: float) -> jax.Array:
    impl = moe_impl()
    if impl != "reference" and kernel_tiles(h_TD.shape[0], experts_of(p)[0]) is None:
        impl = "reference"  # shapes no tile divides (tiny test configs; MXFP4 needs K % 128 == 0)
    if impl == "reference":
        # Prepared-only params (no w_gate left) are dequantised back: the reference of what the kernel computes.
        ref_p = layout.reference_params(p, h_TD.dtype) if "w_gate" not in p else p
        return reference.moe(h_TD, ref_p, top_k=top_k, routed_scaling=routed_scaling, alpha=alpha, limit=limit)
    return moe_pallas(h_TD, p, top_k=top_k, routed_scaling=routed_scaling, alpha=alpha, limit=limit,
                      interpret=impl == "interpret")
