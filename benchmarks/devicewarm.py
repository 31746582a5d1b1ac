"""Shared by the GPU benchmarks: bring the device to its working clocks before the first timing."""

from __future__ import annotations

import subprocess
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


# What tells two machines apart when the same code times differently on them (the H200 loans differ run to run,
# docs/benchmarks.md "Attention kernels"): which GPU, its clocks against their maxima, power, and why it throttles.
_GPU_FIELDS = ("uuid", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.draw", "power.limit",
               "temperature.gpu", "clocks_throttle_reasons.active")


def gpu_state() -> dict[str, str]:
    """nvidia-smi's view of GPU 0 now (call it right after the warm-up); {"error": ...} where it cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={','.join(_GPU_FIELDS)}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    values = [v.strip() for v in out.stdout.strip().split(",")]
    if out.returncode != 0 or len(values) != len(_GPU_FIELDS):
        return {"error": (out.stderr or out.stdout).strip()[:300]}
    return dict(zip(_GPU_FIELDS, values, strict=True))
