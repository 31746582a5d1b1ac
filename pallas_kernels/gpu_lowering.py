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

Several GPUs (`num_devices` = N): the abstract mesh is N devices on one axis named `axis` ("tp", the sharding
rules' axis), and an argument placed by a `NamedSharding` (on a concrete or abstract mesh of that axis) keeps its
spec on it. The sharded ops' shard_maps run over the context mesh (`pallas_kernels.topology.Topology.mesh`), so a
TP / EP step lowers as N GPUs would run it: the Triton kernels inside one manual computation, the collectives
around it (M3Model.abstract(..., tensor_parallel_size=N) gives the params and `page_shapes` the pages).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding, use_abstract_mesh

__all__ = ["TRITON_CUSTOM_CALL", "abstract_gpu", "count_triton_kernels", "gpu_mesh", "lower_for_gpu"]

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"

# Multiprocessor counts of the devices we lower for (the abstract device needs one; the Triton lowering itself
# only reads the device kind, for the compute capability).
_NUM_CORES = {"NVIDIA H200": 132, "NVIDIA H100": 132}


def _abstract(x: Any, mesh: AbstractMesh | None = None) -> Any:
    """Arrays (and anything else with a shape and dtype) -> jax.ShapeDtypeStruct, a NamedSharding's spec moved
    onto `mesh` (several devices; on one, placements on this machine's devices are dropped); other leaves
    unchanged."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        return x
    sharding = getattr(x, "sharding", None)
    if mesh is not None and isinstance(sharding, NamedSharding) and sharding.mesh.axis_names == mesh.axis_names:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, sharding.spec))
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def gpu_mesh(device_kind: str = "NVIDIA H200", num_cores: int | None = None, num_devices: int = 1,
             axis: str = "tp") -> AbstractMesh:
    """An abstract mesh of `num_devices` `device_kind` GPUs (one device: the axis "x", explicit, as before)."""
    cores = num_cores if num_cores is not None else _NUM_CORES.get(device_kind, 132)
    device = AbstractDevice(device_kind=device_kind, num_cores=cores, platform="gpu")
    if num_devices == 1:
        return AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=device)
    return AbstractMesh((num_devices,), (axis,), (AxisType.Auto,), abstract_device=device)


def abstract_gpu(device_kind: str = "NVIDIA H200", num_cores: int | None = None, num_devices: int = 1,
                 axis: str = "tp") -> Any:
    """Context in which `traced.lower(lowering_platforms=("cuda",))` lowers for `num_devices` abstract
    `device_kind` GPUs."""
    return use_abstract_mesh(gpu_mesh(device_kind, num_cores, num_devices, axis))


def lower_for_gpu(fn: Callable[..., Any], *args: Any, device_kind: str = "NVIDIA H200",
                  num_cores: int | None = None, num_devices: int = 1, axis: str = "tp") -> str:
    """StableHLO text of `fn(*args)` lowered for `num_devices` abstract `device_kind` GPUs (CUDA), Pallas kernels
    through the Triton lowering. Raises whatever the lowering raises (e.g. ValueError for a non-power-of-two array
    inside a kernel). `fn`: a plain function (jitted here) or a jitted one (its static / donated arguments are
    kept); `args`: jax.ShapeDtypeStruct or arrays, in any pytree (placements kept on several devices)."""
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    mesh = gpu_mesh(device_kind, num_cores, num_devices, axis)
    abstract_args = jax.tree.map(lambda x: _abstract(x, mesh if num_devices > 1 else None), args)
    with use_abstract_mesh(mesh):
        lowered = jitted.trace(*abstract_args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def count_triton_kernels(text: str) -> int:
    """Triton custom calls (= Pallas kernel launch sites) in lowered StableHLO text; 0 means every op took a
    non-Pallas path. A kernel inside a loop or a branch counts once per call site, not per execution."""
    return text.count(f"custom_call @{TRITON_CUSTOM_CALL}(")
