"""Every weight of M3, declared once: shape, dtype class and logical axes.

The params pytree is nested dicts of arrays. Matrices are stored `[in, out]` (so the model computes `x @ w`),
with head axes split out where attention needs them (`wq[D, H, hd]`). The checkpoint loader converts the
Hugging Face `[out, in]` layout into this one at load time; the serving loop never transposes.

Layers are stacked by run (`M3Config.layer_runs`: consecutive layers of one attention kind and MLP kind):
`params["runs"][r]` holds run r's weights with a leading layer axis, which the decoder scans over. `layer_view`
gives one layer's weights as slices of it.

Logical axis names (the sharding rules table in `m3jax/sharding.py` maps them onto mesh axes):
  vocab, embed, q_heads, kv_heads, head_dim, index_heads, mlp, experts, expert_mlp, layers and norm (never
  sharded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.config import LayerRun, M3Config


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    # "compute": stored in the model's dtype; "fp32": always float32 (the router stays fp32, as released).
    dtype_class: str = "compute"
    # How a random init should scale it: "matrix" (1/sqrt(fan_in)), "norm" (Gemma weight, centred at 0), "zeros".
    init: str = "matrix"
    fan_in: int = 1

    def __post_init__(self) -> None:
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


def _mat(shape: tuple[int, ...], axes: tuple[str, ...], fan_in: int, dtype_class: str = "compute") -> ParamSpec:
    return ParamSpec(tuple(shape), axes, dtype_class, "matrix", fan_in)


def _norm(n: int) -> ParamSpec:
    return ParamSpec((n,), ("norm",), "compute", "norm")


def layer_specs(cfg: M3Config, i: int) -> dict[str, Any]:
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer: dict[str, Any] = {
        "input_norm": _norm(d),
        "post_attn_norm": _norm(d),
        "attn": {
            "wq": _mat((d, h, hd), ("embed", "q_heads", "head_dim"), d),
            "wk": _mat((d, kv, hd), ("embed", "kv_heads", "head_dim"), d),
            "wv": _mat((d, kv, hd), ("embed", "kv_heads", "head_dim"), d),
            "wo": _mat((h, hd, d), ("q_heads", "head_dim", "embed"), h * hd),
            "q_norm": _norm(hd),
            "k_norm": _norm(hd),
        },
    }
    if cfg.attn_types[i] == "sparse":
        ih, ihd = cfg.index_num_heads, cfg.index_head_dim
        layer["index"] = {
            "wq": _mat((d, ih, ihd), ("embed", "index_heads", "head_dim"), d),
            "wk": _mat((d, ihd), ("embed", "head_dim"), d),
            "q_norm": _norm(ihd),
            "k_norm": _norm(ihd),
        }
    if cfg.mlp_types[i] == "dense":
        f = cfg.dense_intermediate_size
        layer["mlp"] = {
            "w_gate": _mat((d, f), ("embed", "mlp"), d),
            "w_up": _mat((d, f), ("embed", "mlp"), d),
            "w_down": _mat((f, d), ("mlp", "embed"), f),
        }
    else:
        e, f = cfg.num_experts, cfg.moe_intermediate_size
        moe: dict[str, Any] = {
            "router": _mat((d, e), ("embed", "experts_replicated"), d, "fp32"),
            "router_bias": ParamSpec((e,), ("experts_replicated",), "fp32", "zeros"),
            "w_gate": _mat((e, d, f), ("experts", "embed", "expert_mlp"), d),
            "w_up": _mat((e, d, f), ("experts", "embed", "expert_mlp"), d),
            "w_down": _mat((e, f, d), ("experts", "expert_mlp", "embed"), f),
        }
        if cfg.num_shared_experts:
            fs = cfg.shared_intermediate_size
            moe["shared"] = {
                "w_gate": _mat((d, fs), ("embed", "mlp"), d),
                "w_up": _mat((d, fs), ("embed", "mlp"), d),
                "w_down": _mat((fs, d), ("mlp", "embed"), fs),
            }
        layer["moe"] = moe
    return layer


def param_specs(cfg: M3Config) -> dict[str, Any]:
    d, v = cfg.hidden_size, cfg.vocab_size

    def stacked(run: LayerRun) -> dict[str, Any]:
        return map_specs(lambda s: dataclasses.replace(s, shape=(run.count, *s.shape), axes=("layers", *s.axes)),
                         layer_specs(cfg, run.start))

    return {
        "embed": ParamSpec((v, d), ("vocab", "embed"), "compute", "matrix", 1),
        "runs": [stacked(run) for run in cfg.layer_runs],
        "final_norm": _norm(d),
        "lm_head": _mat((d, v), ("embed", "vocab"), d),
    }


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def map_specs(fn: Callable[[ParamSpec], Any], specs: Any) -> Any:
    return jax.tree.map(fn, specs, is_leaf=is_spec)


def layer_view(params: dict[str, Any], cfg: M3Config, layer: int) -> dict[str, Any]:
    """Layer `layer`'s weights (views into its run's stacked arrays), shaped as `layer_specs(cfg, layer)`."""
    r, j = cfg.run_of(layer)
    return jax.tree.map(lambda x: x[j], params["runs"][r])


def spec_dtype(spec: ParamSpec, dtype: Any) -> np.dtype:
    return np.dtype(np.float32) if spec.dtype_class == "fp32" else np.dtype(jnp.dtype(dtype))


def random_params(cfg: M3Config, seed: int = 0, dtype: Any = jnp.float32, scale: float = 1.0) -> dict[str, Any]:
    """Random weights at a scale where norms, clamps and routing bias matter (tests, synthetic checkpoints).

    Host numpy arrays; `scale` multiplies the matrix std (1/sqrt(fan_in) at scale 1).
    """
    rng = np.random.default_rng(seed)

    def make(spec: ParamSpec) -> np.ndarray:
        if spec.init == "norm":
            x = rng.normal(0.0, 0.3, spec.shape)
        elif spec.init == "zeros":
            x = rng.normal(0.0, 0.05, spec.shape)  # routing bias: small, but large enough to move top-k
        else:
            x = rng.normal(0.0, scale / np.sqrt(spec.fan_in), spec.shape)
        return x.astype(spec_dtype(spec, dtype))

    return map_specs(make, param_specs(cfg))


def init_params(cfg: M3Config, seed: int = 0, dtype: Any = jnp.bfloat16) -> dict[str, Any]:
    """Random weights drawn on the default device in one jitted call: what a preset with no checkpoint serves
    (the 25B-parameter `m3-slice` in seconds on a GPU, where host numpy would take many minutes).
    Same scales as `random_params`, different numbers."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)

    def std(s: ParamSpec) -> float:
        return 0.3 if s.init == "norm" else 0.05 if s.init == "zeros" else 1.0 / float(np.sqrt(s.fan_in))

    @jax.jit
    def make(key: jax.Array) -> list[jax.Array]:
        keys = jax.random.split(key, len(leaves))
        return [(jax.random.normal(k, s.shape, jnp.float32) * std(s)).astype(spec_dtype(s, dtype))
                for k, s in zip(keys, leaves, strict=True)]

    return jax.tree.unflatten(treedef, make(jax.random.key(seed)))
