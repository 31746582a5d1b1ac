"""The one entry point the model calls for each hot op. Each op takes `impl`, its family's part of the static
`pallas_kernels.choice.KernelChoice`; the family's `dispatch` module then picks kernel tiles (or the jnp
reference where a shape cannot be tiled) from the real shapes. Callers never import a kernel directly."""

from __future__ import annotations

from pallas_kernels.attention.dispatch import (
    paged_block_sparse_attention,
    paged_dense_attention,
    paged_select_blocks,
    write_kv_pages,
)
from pallas_kernels.moe.dispatch import dense_mlp, moe

__all__ = ["paged_dense_attention", "paged_select_blocks", "paged_block_sparse_attention", "write_kv_pages", "moe",
           "dense_mlp"]
