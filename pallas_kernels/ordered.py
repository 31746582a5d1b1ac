"""Sums whose order does not depend on the shapes around them.

XLA picks a reduction's strategy (how a row is split over threads, and so the order of its additions) from the
whole operand's shape, and the batch-invariant mode (KernelChoice.batch_invariant) needs a token's sums not to
change with how many tokens share the step. A short sum written as one add after another is elementwise code:
XLA does not reassociate floating-point adds, so every element is summed in index order at every shape.
"""

from __future__ import annotations

import functools

import jax
from jax import lax


def ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    """x summed over `axis` (a short one: a K split's partials, a token's expert choices) in index order."""
    parts = [lax.index_in_dim(x, i, axis=axis, keepdims=False) for i in range(x.shape[axis])]
    return functools.reduce(lambda acc, part: acc + part, parts[1:], parts[0])
