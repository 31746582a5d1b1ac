"""Shared by the GPU benchmarks: bring the device to its working clocks before the first timing."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def warm_up_device(seconds: float) -> None:
    """bf16 matmuls for `seconds`. Without this the first case of a run measured 20-40% slow on the H200 (clocks
    still ramping), which made the 8k attention case look slower than 32k."""
    x = jnp.ones((8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda a: (a @ a) * (1.0 / 8192))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x = jax.block_until_ready(mm(x))
