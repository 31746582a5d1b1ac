"""The one entry point the model calls for each hot op. Each op family's `dispatch` module picks the
implementation (Pallas kernel or jnp reference) by backend and shape; callers never import one directly."""

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
