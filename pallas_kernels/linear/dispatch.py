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


def tiles_for_many(m: int, k: int, ns: list[int], impl: str, invariant: bool = False) -> LinearTiles | None:
    """One tile set for several weights of one K in one launch (`linear_many`): the tiles of their columns side by
    side, if its output tile divides every weight's N; else None (each weight on its own: the kernel would pad a
    weight no tile divides, a copy of it every call). One weight: `tiles_for`."""
    tiles = tiles_for(m, k, sum(ns), impl, invariant)
    return None if tiles is None or (len(ns) > 1 and any(n % tiles.bn for n in ns)) else tiles


# Columns of the all-ones matrix `mean_square` multiplies by (the narrowest output tile; column 0 is used).
_SUM_COLUMNS = 16


def mean_square(x_ND: jax.Array, *, impl: str) -> jax.Array:
    """fp32 mean of x^2 over the last axis, [N]: the squares summed by the linear kernel's batch-invariant tiles
    (x^2 @ ones through `linear_fp32`), so a row's sum has the same order however many rows share the call. XLA's
    row reductions need not: the CPU's regroups rows by count (tests/test_batch_invariant.py)."""
    D = x_ND.shape[-1]
    v = x_ND.astype(jnp.float32)
    ones = jnp.ones((D, _SUM_COLUMNS), jnp.bfloat16)
    return linear_fp32(v * v, ones, impl=impl)[:, 0] / D


# bf16 pieces an fp32 operand is cut into: 3 x 8 significant bits hold all 24 of an fp32 mantissa.
_FP32_PIECES = 3


def bf16_pieces(a: jax.Array) -> list[jax.Array]:
    """A bf16 operand as itself; an fp32 one as bf16 pieces, largest first, whose exact sum is it. Each piece is
    the top 16 bits of what is left (truncation, so the rest is exact in fp32 and fits the next piece). Bit masks
    rather than casts: XLA may fold an f32 -> bf16 -> f32 round trip away, which would zero the later pieces."""
    if a.dtype == jnp.bfloat16:
        return [a]
    rest = a.astype(jnp.float32)
    pieces = []
    for _ in range(_FP32_PIECES):
        top = jax.lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(0xFFFF0000)
        pieces.append(jax.lax.bitcast_convert_type((top >> 16).astype(jnp.uint16), jnp.bfloat16))
        rest = rest - jax.lax.bitcast_convert_type(top, jnp.float32)
    return pieces


def linear_fp32(x_MK: jax.Array, w_KN: jax.Array, *, impl: str) -> jax.Array:
    """x @ w in fp32 with fp32-exact operands, through the batch-invariant tiles on the matrix units: x and w as
    bf16 pieces (`bf16_pieces`), the products of piece pairs whose sum carries fp32's precision laid side by side
    along K, one bf16 GEMM with fp32 accumulation. A bf16 x times an fp32 w (the router) is three exact products;
    two fp32 operands keep the six largest of nine. The same row gives the same bits at every M, as `linear` with
    `invariant`; full-fp32 products in the kernel would run on the FMA units, far slower."""
    xs, ws = bf16_pieces(x_MK), bf16_pieces(w_KN)
    pairs = [(i, j) for i in range(len(xs)) for j in range(len(ws)) if i + j < max(len(xs), len(ws))]
    K = x_MK.shape[1] * len(pairs)
    tiles = tiles_for(x_MK.shape[0], K, w_KN.shape[1], impl, invariant=True)
    if tiles is None:
        return jnp.dot(x_MK.astype(jnp.float32), w_KN.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    x = jnp.concatenate([xs[i] for i, _ in pairs], axis=1)
    w = jnp.concatenate([ws[j] for _, j in pairs], axis=0)
    return kernel.linear(x, w, tiles=tiles, interpret=impl == "interpret", out_dtype=jnp.float32)


def linear(x_MK: jax.Array, w_KN: jax.Array, *, impl: str, layer: jax.Array | int | None = None,
           invariant: bool = False) -> jax.Array:
    return linear_many(x_MK, [w_KN], impl=impl, layer=layer, invariant=invariant)[0]


def linear_many(x_MK: jax.Array, ws_KN: list[jax.Array], *, impl: str, layer: jax.Array | int | None = None,
                invariant: bool = False) -> list[jax.Array]:
    """[x @ w for w in ws_KN]: one launch of the kernel where `tiles_for_many` gives tiles; else each weight on its
    own (the kernel, or XLA's GEMM where no tiles fit it)."""
    tiles = tiles_for_many(x_MK.shape[0], x_MK.shape[1], [w.shape[-1] for w in ws_KN], impl, invariant)
    if tiles is not None:
        return kernel.linear_many(x_MK, ws_KN, tiles=tiles, interpret=impl == "interpret", layer=layer)
    if len(ws_KN) > 1:
        return [linear(x_MK, w, impl=impl, layer=layer, invariant=invariant) for w in ws_KN]
    return [reference.linear(x_MK, ws_KN[0] if layer is None else ws_KN[0][layer])]
