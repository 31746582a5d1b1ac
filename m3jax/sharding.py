"""The one sharding-rules table: logical weight axes -> mesh axes.

TP2 / TP4 / TP8 and expert parallelism are different rules over the same model code. The mesh has a single
axis "tp"; with `expert_parallel` the routed experts are split across it instead of their inner width.
A logical axis whose size the mesh axis does not divide stays replicated (M3's 4 KV heads under TP8, say).

The kernels read the same table: `ShardingRules.topology` is its hashable copy that rides in the static
`KernelChoice`, and both place arrays through `Topology.spec_for`. What each device runs under a rules object
(attention heads split or KV heads replicated, MoE split by width or by experts) is decided from it in
`pallas_kernels/topology.py`; the page pool's KV-head axis follows (`Topology.kv_heads`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from m3jax.config import M3Config
from m3jax.params import ParamSpec, map_specs, param_specs
from pallas_kernels.topology import Topology

TP = "tp"

# Logical axis -> mesh axis. Axes not listed ("embed", "head_dim", "norm", ...) are replicated.
_TENSOR_PARALLEL: dict[str, str | None] = {
    "vocab": TP,
    "q_heads": TP,
    "kv_heads": TP,
    "index_heads": TP,
    "mlp": TP,
    "expert_mlp": TP,
    "experts": None,
    # The MoE kernels' prepared stacks (checkpoints/prepare.py): routed experts and the shared one as slots.
    "expert_slots": None,
}
_EXPERT_PARALLEL = {**_TENSOR_PARALLEL, "experts": TP, "expert_slots": TP, "expert_mlp": None}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    mesh: Mesh | AbstractMesh  # abstract: shapes-only models (M3Model.abstract), lowered without devices
    rules: dict[str, str | None]

    @functools.cached_property
    def topology(self) -> Topology:
        """This table as the kernels see it (static, hashable): the mesh axis, its size and the rules."""
        return Topology(int(self.mesh.shape[TP]), TP, tuple(sorted(self.rules.items())))

    def spec_for(self, shape: tuple[int, ...], axes: tuple[str, ...], what: str = "") -> PartitionSpec:
        return self.topology.spec_for(shape, axes, what)

    def sharding(self, shape: tuple[int, ...], axes: tuple[str, ...], what: str = "") -> NamedSharding:
        return NamedSharding(self.mesh, self.spec_for(shape, axes, what))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def param_shardings(self, cfg: M3Config) -> Any:
        return map_specs(lambda s: self.sharding(s.shape, s.axes, str(s)), param_specs(cfg))


def make_rules(tensor_parallel_size: int = 1, expert_parallel: bool = False,
               devices: list[Any] | None = None) -> ShardingRules:
    devices = list(devices if devices is not None else jax.devices())
    if tensor_parallel_size < 1 or tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but {len(devices)} device(s) are visible")
    mesh = Mesh(np.array(devices[:tensor_parallel_size]), (TP,))
    return ShardingRules(mesh, _EXPERT_PARALLEL if expert_parallel else _TENSOR_PARALLEL)


def make_abstract_rules(tensor_parallel_size: int = 1, expert_parallel: bool = False) -> ShardingRules:
    """The same rules over an abstract mesh of `tensor_parallel_size` devices (no devices needed): for tracing and
    lowering a deployment's step ahead of time, e.g. for N GPUs on a CPU (`pallas_kernels.gpu_lowering`)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}")
    mesh = AbstractMesh((tensor_parallel_size,), (TP,), axis_types=(AxisType.Auto,))
    return ShardingRules(mesh, _EXPERT_PARALLEL if expert_parallel else _TENSOR_PARALLEL)


def shard_params(params: Any, cfg: M3Config, rules: ShardingRules) -> Any:
    """Place host arrays on the mesh, one leaf at a time (no second full copy on any device)."""
    shardings = rules.param_shardings(cfg)
    return jax.tree.map(lambda x, s: jax.device_put(x, s), params, shardings,
                        is_leaf=lambda x: isinstance(x, ParamSpec))
