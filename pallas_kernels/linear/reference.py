"""Dense linear layers: `x @ w` with fp32 accumulation, the definition the small-M Pallas kernel must equal."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def linear(x_MK: jax.Array, w_KN: jax.Array) -> jax.Array:
    return jnp.dot(x_MK, w_KN, preferred_element_type=jnp.float32).astype(x_MK.dtype)
