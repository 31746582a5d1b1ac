"""M3 as a Flax NNX module, for users who compose models with Flax.

The module holds every weight as an `nnx.Param` annotated with its logical axes (from `m3jax.params`), and
its `__call__` is the pure `m3jax.model.forward`: one definition of the model, two ways to hold the weights.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from m3jax.batch import Batch, KVPages
from m3jax.config import M3Config
from m3jax.model import ForwardOutput, forward
from m3jax.params import is_spec, param_specs
from pallas_kernels.choice import REFERENCE, KernelChoice


class M3(nnx.Module):
    def __init__(self, cfg: M3Config, params: Any, kernels: KernelChoice = REFERENCE):
        self.cfg = cfg
        self.kernels = kernels
        specs = param_specs(cfg)
        leaves_spec, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
        leaves = treedef.flatten_up_to(params)
        wrapped = [nnx.Param(jnp.asarray(x), logical_axes=s.axes) for x, s in zip(leaves, leaves_spec, strict=True)]
        self._treedef = treedef
        self.weights = nnx.List(wrapped)

    def params(self) -> Any:
        """The plain params pytree `m3jax.model.forward` takes."""
        return jax.tree.unflatten(self._treedef, [w[...] for w in self.weights])

    def logical_axes(self) -> list[tuple[str, ...]]:
        return [w.logical_axes for w in self.weights]

    def __call__(self, kv: KVPages, batch: Batch) -> ForwardOutput:
        return forward(self.params(), self.cfg, kv, batch, self.kernels)

