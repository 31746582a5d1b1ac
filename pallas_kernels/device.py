"""What the device under the kernels can run, for the tile tables that choose between backends."""

from __future__ import annotations

import functools

import jax


@functools.cache
def wgmma_device() -> bool:
    """Whether the default device runs the Mosaic GPU kernels (warp-specialised wgmma): a Hopper (sm_90) GPU."""
    d = jax.devices()[0]
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")) == "9.0"
