"""Attention implementation choice (dense ragged paged attention; MSA index + top-k; block-sparse attention).

Today: the jnp references everywhere. Pallas kernels plug in here by backend and shape.
"""

from __future__ import annotations

from pallas_kernels.attention.reference import paged_dense_attention
from pallas_kernels.msa.reference import paged_block_sparse_attention, paged_select_blocks

__all__ = ["paged_dense_attention", "paged_select_blocks", "paged_block_sparse_attention"]
