"""MoE / MLP implementation choice. Today: the jnp references everywhere; Pallas kernels plug in here."""

from __future__ import annotations

from pallas_kernels.moe.reference import dense_mlp, moe

__all__ = ["dense_mlp", "moe"]
