"""Load-time preparation of the MoE kernels' weight layout, so the serving loop converts nothing.

`prepare_params(params, fmt)` adds `layers[i]["moe"]["experts"]` to every MoE layer (layout and keys:
pallas_kernels/moe/layout.py): the routed experts and the shared expert stacked into S = E + 1 slots, K-major,
in one of
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

from typing import Any

from pallas_kernels.moe import layout

FORMATS = ("bf16", "mxfp8", "mxfp4")


def prepare_moe(moe: dict[str, Any], fmt: str = "bf16", *, keep_reference: bool = True) -> dict[str, Any]:
    """One MoE layer's params -> the same dict plus "experts" (see the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"MoE weight format {fmt!r}: expected one of {FORMATS}")
    d_model, d_ff = moe["w_gate"].shape[-2:]
    if fmt != "bf16" and (d_model % layout.MX_GROUP or d_ff % layout.MX_GROUP):
        raise ValueError(f"{fmt} kernel layout needs D={d_model} and F={d_ff} multiples of {layout.MX_GROUP}")
    dense = layout.stack_dense(moe)
    experts = layout.mark_wide_scales(layout.quantize_experts(dense, "dense" if fmt == "bf16" else fmt))
    out = dict(moe) if keep_reference else {k: moe[k] for k in ("router", "router_bias")}
    if not keep_reference and "shared" in moe and dense["gate"].shape[0] != moe["router"].shape[1] + 1:
        out["shared"] = moe["shared"]  # not stackable (other width): it stays a dense MLP
    out["experts"] = experts
    return out


def prepare_params(params: dict[str, Any], fmt: str = "bf16", *, keep_reference: bool = True) -> dict[str, Any]:
    """The whole params tree with every MoE layer prepared (other layers untouched, arrays shared)."""
    layers = [dict(layer, moe=prepare_moe(layer["moe"], fmt, keep_reference=keep_reference))
              if "moe" in layer else layer for layer in params["layers"]]
    return dict(params, layers=layers)
