"""m3jax: MiniMax M3 in JAX. `from m3jax import load_model`."""

from m3jax.api import M3Model, load_model
from m3jax.config import M3Config, preset

__all__ = ["load_model", "M3Model", "M3Config", "preset"]
