"""Lower a function for an abstract GPU on any machine: the Pallas Triton lowering's checks without a GPU.

`jax.jit(fn).trace(...).lower(lowering_platforms=("cuda",))` under an abstract mesh of one GPU device runs, for
every `pallas_call` (not in interpret mode), the real Pallas Triton lowering
(`jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module`) and emits StableHLO holding one
`__gpu$xla.gpu.triton` custom call per kernel. Nothing is compiled or run, so it works on the CPU backend, and
what would crash the GPU at lowering time surfaces here as the same exception: arrays inside a kernel whose
size is not a power of two, primitives the lowering does not support, bad block shapes. (What it cannot see:
Triton's own compilation to PTX, i.e. shared-memory or register limits, and anything that happens at run time.)

    text = lower_for_gpu(fn, jax.ShapeDtypeStruct((8, 128), jnp.bfloat16), params)
    assert count_triton_kernels(text) > 0  # the kernel path, not a jnp fallback

Arguments are abstract (jax.ShapeDtypeStruct) or concrete arrays, in any pytree; concrete ones are only used
for their shapes and dtypes, so real sizes cost nothing. Static arguments: bind them with functools.partial, or
pass an already jitted function (`jax.jit(f, static_argnums=..., donate_argnums=...)`), whose own options are
then kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

__all__ = ["TRITON_CUSTOM_CALL", "abstract_gpu", "count_triton_kernels", "lower_for_gpu"]

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"

# Multiprocessor counts of the devices we lower for (the abstract device needs one; the Triton lowering itself
# only reads the device kind, for the compute capability).
_NUM_CORES = {"NVIDIA H200": 132, "NVIDIA H100": 132}


def _abstract(x: Any) -> Any:
    """Arrays (and anything else with a shape and dtype) -> jax.ShapeDtypeStruct; other leaves unchanged."""
    if isinstance(x, jax.ShapeDtypeStruct) or not (hasattr(x, "shape") and hasattr(x, "dtype")):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def abstract_gpu(device_kind: str = "NVIDIA H200", num_cores: int | None = None) -> Any:
    """Context in which `traced.lower(lowering_platforms=("cuda",))` lowers for one abstract `device_kind` GPU."""
    cores = num_cores if num_cores is not None else _NUM_CORES.get(device_kind, 132)
    device = AbstractDevice(device_kind=device_kind, num_cores=cores, platform="gpu")
    return use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device))


def lower_for_gpu(fn: Callable[..., Any], *args: Any, device_kind: str = "NVIDIA H200",
                  num_cores: int | None = None) -> str:
    """StableHLO text of `fn(*args)` lowered for one abstract `device_kind` GPU (CUDA), Pallas kernels through
    the Triton lowering. Raises whatever the lowering raises (e.g. ValueError for a non-power-of-two array
    inside a kernel). `fn`: a plain function (jitted here) or a jitted one (its static / donated arguments are
    kept); `args`: jax.ShapeDtypeStruct or arrays, in any pytree."""
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    abstract_args = jax.tree.map(_abstract, args)
    with abstract_gpu(device_kind, num_cores):
        lowered = jitted.trace(*abstract_args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def count_triton_kernels(text: str) -> int:
    """Triton custom calls (= Pallas kernel launch sites) in lowered StableHLO text; 0 means every op took a
    non-Pallas path. A kernel inside a loop or a branch counts once per call site, not per execution."""
    return text.count(f"custom_call @{TRITON_CUSTOM_CALL}(")
