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
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.moe import layout

FORMATS = ("bf16", "mxfp8", "mxfp4")


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def _prepare_layer_into(stacked: Any, moe: dict[str, Any], j: jax.Array, fmt: str) -> Any:
    """Layer j's kernel layout written into the stacked result in one program: XLA slices, stacks the shared
    expert and quantises straight into the donated buffer, so no per-layer copy is ever materialised."""
    one = _kernel_experts(jax.tree.map(lambda x: x[j], moe), fmt)
    return jax.tree.map(lambda a, b: a.at[j].set(b), stacked, one)


def _check(moe: dict[str, Any], fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"MoE weight format {fmt!r}: expected one of {FORMATS}")
    d_model, d_ff = moe["w_gate"].shape[-2:]
    if fmt != "bf16" and (d_model % layout.MX_GROUP or d_ff % layout.MX_GROUP):
        raise ValueError(f"{fmt} kernel layout needs D={d_model} and F={d_ff} multiples of {layout.MX_GROUP}")


def _assemble(moe: dict[str, Any], experts: dict[str, Any], slots: int, keep_reference: bool) -> dict[str, Any]:
    """`slots`: expert slots per layer (E + 1 when the shared expert was stacked with the routed ones)."""
    out = dict(moe) if keep_reference else {k: moe[k] for k in ("router", "router_bias")}
    if not keep_reference and "shared" in moe and slots != moe["router"].shape[-1] + 1:
        out["shared"] = moe["shared"]  # not stackable (other width): it stays a dense MLP
    out["experts"] = layout.mark_wide_scales(experts)
    return out


def _kernel_experts(moe: dict[str, Any], fmt: str) -> dict[str, Any]:
    return layout.quantize_experts(layout.stack_dense(moe), "dense" if fmt == "bf16" else fmt)


def prepare_moe(moe: dict[str, Any], fmt: str = "bf16", *, keep_reference: bool = True) -> dict[str, Any]:
    """One MoE layer's params -> the same dict plus "experts" (see the module docstring)."""
    _check(moe, fmt)
    experts = _kernel_experts(moe, fmt)
    return _assemble(moe, experts, layout.num_slots(experts), keep_reference)


def prepare_run(moe: dict[str, Any], fmt: str = "bf16", *, keep_reference: bool = True) -> dict[str, Any]:
    """One MoE run's params (stacked over its layers) -> the same dict plus stacked "experts".

    Layer by layer into a preallocated stacked result: besides the weights and their prepared copy, only one
    layer's intermediates are ever on the device."""
    _check(moe, fmt)
    n = moe["router"].shape[0]
    one = jax.eval_shape(lambda m: _kernel_experts(jax.tree.map(lambda x: x[0], m), fmt), moe)
    stacked = jax.tree.map(lambda x: jnp.zeros((n, *x.shape), x.dtype), one)
    for j in range(n):
        stacked = _prepare_layer_into(stacked, moe, jnp.int32(j), fmt)
    # The wide-scale marker reads the whole stack: one structure for every layer of the scan.
    return _assemble(moe, stacked, layout.num_slots(one), keep_reference)


def prepare_params(params: dict[str, Any], fmt: str = "bf16", *, keep_reference: bool = True) -> dict[str, Any]:
    """The whole params tree with every MoE run prepared (other runs untouched, arrays shared)."""
    runs = [dict(run, moe=prepare_run(run["moe"], fmt, keep_reference=keep_reference))
            if "moe" in run else run for run in params["runs"]]
    return dict(params, runs=runs)
