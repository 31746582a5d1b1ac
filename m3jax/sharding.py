"""The one sharding-rules table: logical weight axes -> mesh axes.

TP2 / TP4 / TP8 and expert parallelism are different rules over the same model code. The mesh has a single
axis "tp"; with `expert_parallel` the routed experts are split across it instead of their inner width.
A logical axis whose size the mesh axis does not divide stays replicated (M3's 4 KV heads under TP8, say).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from m3jax.config import M3Config
from m3jax.params import ParamSpec, map_specs, param_specs

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
}
_EXPERT_PARALLEL = {**_TENSOR_PARALLEL, "experts": TP, "expert_mlp": None}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    mesh: Mesh
    rules: dict[str, str | None]

    def spec_for(self, shape: tuple[int, ...], axes: tuple[str, ...], what: str = "") -> PartitionSpec:
        out: list[str | None] = []
        for size, axis in zip(shape, axes, strict=True):
            mesh_axis = self.rules.get(axis)
            # A mesh axis of size 1 splits nothing; naming it anyway gives shardings that equal a step's
            # (unnamed) output placement in effect but not in jit's cache key, and would recompile every bucket.
            if mesh_axis is not None and (size % self.mesh.shape[mesh_axis] != 0 or self.mesh.shape[mesh_axis] == 1):
                mesh_axis = None
            if mesh_axis is not None and mesh_axis in out:
                raise ValueError(f"{what}: logical axes {axes} put two dimensions on mesh axis {mesh_axis!r}")
            out.append(mesh_axis)
        while out and out[-1] is None:  # the canonical form jit gives its outputs: same placement, same cache key
            out.pop()
        return PartitionSpec(*out)

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


def shard_params(params: Any, cfg: M3Config, rules: ShardingRules) -> Any:
    """Place host arrays on the mesh, one leaf at a time (no second full copy on any device)."""
    shardings = rules.param_shardings(cfg)
    return jax.tree.map(lambda x, s: jax.device_put(x, s), params, shardings,
                        is_leaf=lambda x: isinstance(x, ParamSpec))
