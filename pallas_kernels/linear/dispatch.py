"""Dense linear implementation choice: the small-M Pallas kernel, or XLA's GEMM.

`linear(x, w, impl=...)` takes an op family's part of a resolved `KernelChoice` (the attention projections: the
attention family's; the dense MLPs: the MoE / MLP family's): "pallas" / "interpret" run the split-K kernel where
`tiles.pick_tiles` gives tiles for the shard's shapes (M <= 64 rows; every M with `invariant`, the batch-invariant
mode's one tile set), "reference" and every other shape run
`reference.linear` (XLA). `uses_kernel` tells callers, statically, which one a call will take, so that a sharded
caller wraps only the kernel in a shard_map and leaves XLA's GEMMs to XLA's partitioner. `layer`: w is a scan's
whole stack [layers, K, N] (see kernel.py); the kernel reads the layer in place, XLA's GEMM its slice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.choice import IMPLS
from pallas_kernels.linear import kernel, reference
from pallas_kernels.linear.tiles import LinearTiles, pick_tiles


def tiles_for(m: int, k: int, n: int, impl: str, invariant: bool = False) -> LinearTiles | None:
    if impl not in IMPLS:
        raise ValueError(f"linear impl {impl!r}: expected one of {IMPLS} (resolve the KernelChoice first)")
    return None if impl == "reference" else pick_tiles(m, k, n, invariant=invariant)


def uses_kernel(m: int, k: int, n: int, impl: str, invariant: bool = False) -> bool:
    return tiles_for(m, k, n, impl, invariant) is not None


# Columns of the all-ones matrix `mean_square` multiplies by (the narrowest output tile; column 0 is used).
_SUM_COLUMNS = 16


def mean_square(x_ND: jax.Array, *, impl: str) -> jax.Array:
    """fp32 mean of x^2 over the last axis, [N]: the squares summed by the linear kernel's batch-invariant tiles
    (x^2 @ ones, full fp32 products), so a row's sum has the same order however many rows share the call. XLA's
    row reductions need not: the CPU's regroups rows by count (tests/test_batch_invariant.py)."""
    D = x_ND.shape[-1]
    v = x_ND.astype(jnp.float32)
    ones = jnp.ones((D, _SUM_COLUMNS), jnp.float32)
    return linear(v * v, ones, impl=impl, invariant=True)[:, 0] / D


def linear(x_MK: jax.Array, w_KN: jax.Array, *, impl: str, layer: jax.Array | int | None = None,
           invariant: bool = False) -> jax.Array:
    tiles = tiles_for(x_MK.shape[0], *w_KN.shape[-2:], impl, invariant)
    if tiles is None:
        return reference.linear(x_MK, w_KN if layer is None else w_KN[layer])
    return kernel.linear(x_MK, w_KN, tiles=tiles, interpret=impl == "interpret", layer=layer)
