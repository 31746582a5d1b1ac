"""The one place that picks an implementation for each hot op.

Today every op resolves to its plain-jnp reference (the definition, and what CPUs run). The Pallas kernels
plug in here by backend and shape; callers (`m3jax.model`) never import an implementation directly.
"""

from __future__ import annotations

from pallas_kernels.attention.reference import paged_dense_attention
from pallas_kernels.moe.reference import dense_mlp, moe
from pallas_kernels.msa.reference import paged_block_sparse_attention, paged_select_blocks

__all__ = ["paged_dense_attention", "paged_select_blocks", "paged_block_sparse_attention", "moe", "dense_mlp"]
