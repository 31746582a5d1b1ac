"""Load-time preparation of the MoE kernels' weight layout, so the serving loop converts nothing.

`prepare_params(params, fmt)` adds `runs[r]["moe"]["experts"]` to every MoE run (layout and keys:
pallas_kernels/moe/layout.py; a leading layer axis like every weight of the run): the routed experts and the
shared expert stacked into S = E + 1 slots, K-major, in one of
  "bf16"   dense bf16 (or the params' own float dtype),
  "mxfp8"  float8_e4m3fn + one E8M0 byte per 32 K (8-bit on the device, widened inside the kernel),
  "mxfp4"  E2M1 + E8M0 per 32 K,
both MX formats pair-packed along K in groups of 128 (D and F must be multiples of 128; M3's are).
Quantisation runs with jnp on whatever device the params live on (the GPU after `shard_params`: seconds for
all of M3). An MXFP8 checkpoint that the loader dequantised comes back bit-exact: dequantise-then-quantise is
the identity for MXFP8 (tests/test_checkpoints.py checks that idempotence).

With `keep_reference=False` the original w_gate / w_up / w_down / shared arrays are dropped (the prepared copy
replaces them: half the memory for MXFP8); the reference path then dequantises `experts` when asked for.
Call it after sharding: the sharding rules know only the declared params.

On several devices (`topology`, the rules' `ShardingRules.topology`) each device prepares its own shard inside a
`jax.shard_map`, from the weights it already holds, into the stack the sharded MoE reads (pallas_kernels/
topology.py, MoE modes): under TP every slot's F/devices columns of gate / up and rows of down (for MX formats
whole 128-groups of F per device: F / devices a multiple of 128; M3's 3072 / 8 = 384 is), the shared expert's
share of its width as the last slot; under EP the device's E/devices experts and, as its last slot, the whole
shared expert (all-gathered once, here). So an EP stack has devices * (E/devices + 1) slots, device-major.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import sharded
from pallas_kernels.moe import layout
from pallas_kernels.topology import SINGLE, Topology

FORMATS = ("bf16", "mxfp8", "mxfp4")


@functools.partial(jax.jit, static_argnums=(3, 4), donate_argnums=(0,))
def _prepare_layer_into(stacked: Any, moe: dict[str, Any], j: jax.Array, fmt: str, topology: Topology) -> Any:
    """Layer j's kernel layout written into the stacked result in one program: XLA slices, stacks the shared
    expert and quantises straight into the donated buffer, so no per-layer copy is ever materialised."""
    one = _layer_experts(jax.tree.map(lambda x: x[j], moe), fmt, topology)
    return jax.tree.map(lambda a, b: a.at[j].set(b), stacked, one)


def _layer_experts(moe: dict[str, Any], fmt: str, topology: Topology) -> dict[str, Any]:
    """One layer's prepared experts: whole on one device, per shard on several."""
    if not topology.sharded:
        return _kernel_experts(moe, fmt)
    mode = topology.moe_mode(moe["router"].shape[-1], moe["w_gate"].shape[-1])
    in_specs = sharded.moe_specs(moe, topology)
    out_keys = jax.eval_shape(lambda m: _kernel_experts(m, fmt), moe)  # the keys (shapes: global, unused)
    out_specs = {k: sharded.expert_spec(k, v.ndim, topology, mode) for k, v in out_keys.items()}
    gather_shared = mode == "ep" and _stackable(moe) and in_specs["shared"]["w_gate"] != P()

    def local(m: dict[str, Any]) -> dict[str, Any]:
        if gather_shared:  # EP: every device holds the whole shared expert as its last slot
            s = m["shared"]
            m = dict(m, shared={"w_gate": jax.lax.all_gather(s["w_gate"], topology.axis, axis=1, tiled=True),
                                "w_up": jax.lax.all_gather(s["w_up"], topology.axis, axis=1, tiled=True),
                                "w_down": jax.lax.all_gather(s["w_down"], topology.axis, axis=0, tiled=True)})
        return _kernel_experts(m, fmt)

    return jax.shard_map(local, mesh=topology.mesh(), in_specs=(in_specs,), out_specs=out_specs,
                         check_vma=False)(moe)


def _stackable(moe: dict[str, Any]) -> bool:
    s = moe.get("shared")
    return s is not None and s["w_gate"].shape[-1] == moe["w_gate"].shape[-1]


def _check(moe: dict[str, Any], fmt: str, topology: Topology = SINGLE) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"MoE weight format {fmt!r}: expected one of {FORMATS}")
    d_model, d_ff = moe["w_gate"].shape[-2:]
    if fmt != "bf16" and (d_model % layout.MX_GROUP or d_ff % layout.MX_GROUP):
        raise ValueError(f"{fmt} kernel layout needs D={d_model} and F={d_ff} multiples of {layout.MX_GROUP}")
    if (fmt != "bf16" and topology.moe_mode(moe["router"].shape[-1], d_ff) == "tp"
            and (d_ff // topology.size) % layout.MX_GROUP):
        raise ValueError(f"{fmt} kernel layout split over {topology.size} devices needs F/{topology.size} = "
                         f"{d_ff // topology.size} a multiple of {layout.MX_GROUP} (down's K groups)")


def _assemble(moe: dict[str, Any], experts: dict[str, Any], shared_stacked: bool,
              keep_reference: bool) -> dict[str, Any]:
    """`shared_stacked`: the shared expert is a slot of `experts` (it has the routed width)."""
    out = dict(moe) if keep_reference else {k: moe[k] for k in ("router", "router_bias")}
    if not keep_reference and "shared" in moe and not shared_stacked:
        out["shared"] = moe["shared"]  # not stackable (other width): it stays a dense MLP
    out["experts"] = layout.mark_wide_scales(experts)
    return out


def _kernel_experts(moe: dict[str, Any], fmt: str) -> dict[str, Any]:
    return layout.quantize_experts(layout.stack_dense(moe), "dense" if fmt == "bf16" else fmt)


def prepare_moe(moe: dict[str, Any], fmt: str = "bf16", *, keep_reference: bool = True) -> dict[str, Any]:
    """One MoE layer's params -> the same dict plus "experts" (see the module docstring)."""
    _check(moe, fmt)
    experts = _kernel_experts(moe, fmt)
    return _assemble(moe, experts, layout.num_slots(experts) == moe["router"].shape[-1] + 1, keep_reference)


def prepare_run(moe: dict[str, Any], fmt: str = "bf16", *, keep_reference: bool = True,
                topology: Topology = SINGLE) -> dict[str, Any]:
    """One MoE run's params (stacked over its layers) -> the same dict plus stacked "experts".

    Layer by layer into a preallocated stacked result: besides the weights and their prepared copy, only one
    layer's intermediates are ever on the device. On several devices (`topology`) each device prepares its own
    shard (the module docstring)."""
    _check(moe, fmt, topology)
    n = moe["router"].shape[0]
    one = jax.eval_shape(lambda m: _layer_experts(jax.tree.map(lambda x: x[0], m), fmt, topology), moe)
    stacked = {k: _zeros((n, *v.shape), v.dtype, moe["router"], topology, sharded.expert_spec(
        k, v.ndim + 1, topology, topology.moe_mode(moe["router"].shape[-1], moe["w_gate"].shape[-1])))
        for k, v in one.items()}
    for j in range(n):
        stacked = _prepare_layer_into(stacked, moe, jnp.int32(j), fmt, topology)
    # The wide-scale marker reads the whole stack: one structure for every layer of the scan.
    return _assemble(moe, stacked, _stackable(moe), keep_reference)


def _zeros(shape: tuple[int, ...], dtype: Any, like: Any, topology: Topology, spec: P) -> jax.Array:
    """A zero stack placed as the sharded MoE reads it (on the mesh of `like`, a param already placed)."""
    mesh = getattr(getattr(like, "sharding", None), "mesh", None)
    if not topology.sharded or mesh is None or isinstance(like, jax.core.Tracer):
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, spec))()


def prepare_params(params: dict[str, Any], fmt: str = "bf16", *, keep_reference: bool = True,
                   topology: Topology = SINGLE) -> dict[str, Any]:
    """The whole params tree with every MoE run prepared (other runs untouched, arrays shared)."""
    runs = [dict(run, moe=prepare_run(run["moe"], fmt, keep_reference=keep_reference, topology=topology))
            if "moe" in run else run for run in params["runs"]]
    return dict(params, runs=runs)
