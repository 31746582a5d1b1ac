"""Writing a step's K / V / index-K rows into their page slots: XLA scatter, and a Pallas kernel measured against it.

Both take pages [pages, page_size, ...], new rows [T, ...] and flat slots [T] (page * page_size + offset) and
return the updated pages; under jit with the pages donated both update in place. Padding tokens all write the
sink slot 0: whichever lands there is fine, nothing reads it. Which one the model should use is decided on the
H200 (docs/benchmarks.md, "Attention kernels").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def write_pages_xla(pages: jax.Array, new_T: jax.Array, slot_T: jax.Array) -> jax.Array:
    """One XLA scatter over the flattened slot axis (padding rows all land in the sink page)."""
    flat = pages.reshape(-1, *pages.shape[2:])
    return flat.at[slot_T].set(new_T.astype(pages.dtype)).reshape(pages.shape)


def _write_kernel(slot_ref, new_ref, pages_in_ref, pages_ref, *, bt: int, T: int):
    del pages_in_ref  # aliased to pages_ref: the pool is updated in place
    t0 = pl.program_id(0) * bt
    F = new_ref.shape[-1]
    ok_B = t0 + lax.broadcasted_iota(jnp.int32, (bt,), 0) < T
    slot_B = plgpu.load(slot_ref.at[pl.ds(t0, bt)], mask=ok_B, other=0)
    rows_BF = plgpu.load(new_ref.at[pl.ds(t0, bt), :], mask=jnp.broadcast_to(ok_B[:, None], (bt, F)), other=0)
    # Full [bt, F] index arrays: a scattered row store (interpret mode has no array-plus-slice indexing).
    row_BF = jnp.broadcast_to(slot_B[:, None], (bt, F))
    col_BF = jnp.broadcast_to(lax.broadcasted_iota(jnp.int32, (F,), 0)[None, :], (bt, F))
    plgpu.store(pages_ref.at[row_BF, col_BF], rows_BF.astype(pages_ref.dtype),
                mask=jnp.broadcast_to(ok_B[:, None], (bt, F)))


def write_pages_pallas(pages: jax.Array, new_T: jax.Array, slot_T: jax.Array, *, bt: int = 16,
                       interpret: bool = False) -> jax.Array:
    """One program per `bt` new tokens, each row stored straight to its slot; the pool is aliased in place."""
    T = new_T.shape[0]
    flat = pages.reshape(pages.shape[0] * pages.shape[1], -1)
    new_TF = new_T.reshape(T, -1)
    out = pl.pallas_call(
        functools.partial(_write_kernel, bt=bt, T=T),
        grid=(-(-T // bt),),  # the last tile's rows past T are masked
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"kv_write_bt{bt}",
    )(slot_T.astype(jnp.int32), new_TF, flat)
    return out.reshape(pages.shape)
