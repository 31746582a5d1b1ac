"""Attention implementation choice (dense ragged paged attention; MSA index + top-k; block-sparse attention).

The one place that picks kernel vs reference for the attention family. Each op takes `impl`, the attention part
of a resolved `pallas_kernels.choice.KernelChoice` (a static value of the forward):
- "pallas": the Pallas kernels (Triton lowering; at prefill on a Hopper GPU the Mosaic GPU ones where they take
  the shapes), tiles from `tuning.py` keyed by the real shapes (rows per request: decode vs prefill; page-table
  width; head dims), or one set for every step with `invariant` (`KernelChoice.batch_invariant`);
- "interpret": the same kernels through Pallas' interpreter (how CI checks them on the CPU);
- "reference": the jnp references (the definitions).

Engine sizes (tokens T, request rows R, page-table width P, top-k) take the kernels at any value: they round
their internal tiles up to powers of two and mask the extra entries (tests/test_triton_lowering.py lowers them
for the GPU at odd sizes). Model dims that the Triton tiles use whole (page size, head dims, heads per group)
must be powers of two; other values fall back to the reference on GPU.
KV writes (`write_kv_pages`): decided by measurement on the H200 against the XLA scatter that
`m3jax.model._write` does today (32 writes in one jitted loop into an 8.6 GB pool): the scatter wins for decode-size
writes (64 rows: 10.3 vs 14.6 us), the Pallas row store for prefill-size ones (8192 rows: 15.3 vs 41.0 us), so
the choice is by row count (`tuning.KV_WRITE_PALLAS_MIN_ROWS`). See docs/benchmarks.md, "Attention kernels".
"""

from __future__ import annotations

import jax

from pallas_kernels.attention import kernel as _kernel
from pallas_kernels.attention import kernel_mgpu as _kernel_mgpu
from pallas_kernels.attention import reference as _ref
from pallas_kernels.attention import tuning
from pallas_kernels.attention.kv_write import write_pages_pallas, write_pages_xla
from pallas_kernels.choice import IMPLS
from pallas_kernels.device import wgmma_device
from pallas_kernels.msa import kernel as _msa_kernel
from pallas_kernels.msa import kernel_mgpu as _msa_kernel_mgpu
from pallas_kernels.msa import reference as _msa_ref
from pallas_kernels.msa import sparse_mgpu as _sparse_mgpu

__all__ = ["paged_dense_attention", "paged_select_blocks", "paged_block_sparse_attention", "write_kv_pages"]



def _pow2(*dims: int) -> bool:
    return all(d > 0 and d & (d - 1) == 0 for d in dims)


def _kernel_mode(impl: str, *pow2_dims: int) -> tuple[bool, bool]:
    """(use the kernel, interpret). Compiled Triton tiles need power-of-two dims; interpret mode takes any."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r}: expected one of {IMPLS} (resolve the KernelChoice first)")
    if impl == "reference":
        return False, False
    if impl == "interpret":
        return True, True
    return _pow2(*pow2_dims), False


def mosaic_for(op: str, heads: int, dim: int, page_size: int, *, interpret: bool) -> bool:
    """Whether the tile table may pick op's Mosaic GPU kernel ("dense", "index", "sparse"): compiled (not
    interpreted), on a device that runs them, at shapes the kernel takes (`heads`: heads per KV group, index heads
    for "index"; `dim`: their head dim)."""
    if interpret or not wgmma_device():
        return False
    if op == "dense":
        return _kernel_mgpu.supports(heads, dim, page_size, min(tuning.MOSAIC_DENSE.key_tile, page_size))
    if op == "index":
        return _msa_kernel_mgpu.supports(heads, dim, page_size, tuning.MOSAIC_INDEX.bp)
    tiles = tuning.MOSAIC_SPARSE
    return _sparse_mgpu.supports(heads, dim, page_size, min(tiles.key_tile, page_size), tiles.num_stages,
                                 _sparse_mgpu.shared_form(tiles.bt, heads))


def paged_dense_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table_RN: jax.Array,
                          token_row_T: jax.Array, pos_T: jax.Array, scale: float, *, impl: str,
                          invariant: bool = False) -> jax.Array:
    T, H, D = q_THD.shape
    _, ps, K, _ = k_pages.shape
    use, interpret = _kernel_mode(impl, ps, D, H // K)
    if not use:
        return _ref.paged_dense_attention(q_THD, k_pages, v_pages, page_table_RN, token_row_T, pos_T, scale)
    R, P = page_table_RN.shape
    mosaic = mosaic_for("dense", H // K, D, ps, interpret=interpret)
    tiles = tuning.dense_tiles(T, R, P, K, H // K, invariant=invariant, mosaic=mosaic)
    return _kernel.paged_dense_attention(q_THD, k_pages, v_pages, page_table_RN, token_row_T, pos_T, scale,
                                         tiles=tiles, interpret=interpret)


def paged_select_blocks(iq_TGD: jax.Array, ik_pages: jax.Array, page_table_RN: jax.Array, token_row_T: jax.Array,
                        pos_T: jax.Array, *, topk: int, local_blocks: int, init_blocks: int = 0,
                        impl: str, invariant: bool = False) -> jax.Array:
    T, G, Di = iq_TGD.shape
    ps = ik_pages.shape[1]
    R, P = page_table_RN.shape
    mosaic = mosaic_for("index", G, Di, ps, interpret=impl == "interpret")
    tiles = tuning.index_tiles(T, R, P, G, invariant=invariant, mosaic=mosaic)
    use, interpret = _kernel_mode(impl, ps, Di, G * tiles.bt)
    if not use:
        return _msa_ref.paged_select_blocks(iq_TGD, ik_pages, page_table_RN, token_row_T, pos_T, topk=topk,
                                            local_blocks=local_blocks, init_blocks=init_blocks)
    return _msa_kernel.paged_select_blocks(iq_TGD, ik_pages, page_table_RN, token_row_T, pos_T, topk=topk,
                                           local_blocks=local_blocks, init_blocks=init_blocks, tiles=tiles,
                                           interpret=interpret)


def paged_block_sparse_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                 page_table_RN: jax.Array, token_row_T: jax.Array, pos_T: jax.Array,
                                 blocks_TGN: jax.Array, *, scale: float, impl: str,
                                 invariant: bool = False, union: bool = False) -> jax.Array:
    """`union`: prefill-shaped steps run the union-of-pages kernel instead of KV-block-major (`KernelChoice.
    sparse_prefill`)."""
    T, H, D = q_THD.shape
    _, ps, K, _ = k_pages.shape
    R, _ = page_table_RN.shape
    use, interpret = _kernel_mode(impl, ps, D, H // K)  # any top-k: the kernels pad it to a power of two
    mosaic = mosaic_for("sparse", H // K, D, ps, interpret=interpret)
    tiles = tuning.sparse_tiles(T, R, blocks_TGN.shape[-1], H // K, num_kv_heads=K, invariant=invariant, union=union,
                                mosaic=mosaic)
    if not use:
        return _msa_ref.paged_block_sparse_attention(q_THD, k_pages, v_pages, page_table_RN, token_row_T, pos_T,
                                                     blocks_TGN, scale=scale)
    return _msa_kernel.paged_block_sparse_attention(q_THD, k_pages, v_pages, page_table_RN, token_row_T, pos_T,
                                                    blocks_TGN, scale=scale, tiles=tiles, interpret=interpret)


def write_kv_pages(pages: jax.Array, new_T: jax.Array, slot_T: jax.Array, *, impl: str) -> jax.Array:
    """K / V / index-K rows into their slots (pages donated under jit: in place either way)."""
    feature = 1
    for d in pages.shape[2:]:
        feature *= d
    use, interpret = _kernel_mode(impl, feature)
    if not use or (not interpret and new_T.shape[0] < tuning.KV_WRITE_PALLAS_MIN_ROWS):
        return write_pages_xla(pages, new_T, slot_T)
    return write_pages_pallas(pages, new_T, slot_T, interpret=interpret)
