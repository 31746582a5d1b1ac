"""Write an m3jax params tree as a Hugging Face checkpoint (config.json + safetensors) in any layout.

The inverse of `loader`, driven by the same `names` table, so a round trip tests both directions at once.
Used for synthetic test checkpoints and for exporting; tensors are assembled one at a time as their bytes are
written.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from checkpoints.errors import CheckpointError
from checkpoints.mxfp8 import FP8, quantize_mxfp8, scale_shape
from checkpoints.names import LAYOUTS, Layout, TensorRule, hf_view, param_slot, tensor_rules
from checkpoints.safetensors_io import LazyTensor
from checkpoints.shards import write_checkpoint_files
from m3jax.config import M3Config
from m3jax.params import is_spec, param_specs

MXFP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "mxfp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [1, 32],
    "ignored_layers": ["lm_head", "model.embed_tokens", "vision_tower"],
}
_STORE_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32),
                                      "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def config_dict(cfg: M3Config, layout: Layout, dtype: str, mxfp8: bool) -> dict[str, Any]:
    """config.json in the spelling that goes with the tensor layout."""
    if layout.name == "released":
        config = cfg.to_released_dict()
        config["torch_dtype"] = dtype
    elif layout.name == "transformers":
        config = cfg.to_hf_text_dict()
        config["dtype"] = dtype
    else:
        config = {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
                  "text_config": cfg.to_hf_text_dict(), "tie_word_embeddings": cfg.tie_word_embeddings,
                  "dtype": dtype}
    if mxfp8:
        config["quantization_config"] = dict(MXFP8_QUANTIZATION_CONFIG)
    return config


def _check_params(cfg: M3Config, params: dict[str, Any]) -> None:
    """The tree must match param_specs(cfg) leaf for leaf, or the table would write garbage or fail midway."""
    def walk(spec: Any, node: Any, path: str) -> None:
        if is_spec(spec):
            if tuple(np.shape(node)) != spec.shape:
                raise CheckpointError(f"param {path}: shape {list(np.shape(node))}, "
                                      f"expected {list(spec.shape)}")
        elif isinstance(spec, dict):
            if not isinstance(node, dict) or set(node) != set(spec):
                raise CheckpointError(f"param {path or '<root>'}: keys do not match param_specs(cfg)")
            for k in spec:
                walk(spec[k], node[k], f"{path}.{k}" if path else k)
        else:
            if not isinstance(node, list | tuple) or len(node) != len(spec):
                raise CheckpointError(f"param {path}: expected a list of {len(spec)}")
            for i, (s, n) in enumerate(zip(spec, node, strict=True)):
                walk(s, n, f"{path}[{i}]")

    walk(param_specs(cfg), params, "")


def assemble(rule: TensorRule, params: dict[str, Any], dtype: np.dtype) -> np.ndarray:
    """One HF tensor built from its param slots (the loader's copy, run backwards)."""
    out = np.empty(rule.shape, dtype)
    for e in range(rule.shape[0]) if rule.stacked else [None]:
        block = out if e is None else out[e]
        for piece in rule.pieces:
            dst = hf_view(block, piece)
            np.copyto(dst, np.reshape(np.asarray(param_slot(params, piece, e)), dst.shape), casting="unsafe")
    return out


def write_checkpoint(out_dir: str | os.PathLike[str], cfg: M3Config, params: dict[str, Any],
                     layout: str = "released", dtype: str = "float32", max_shard_bytes: int | None = None,
                     mxfp8: bool = False) -> Path:
    """Write config.json and the safetensors (sharded with an index when `max_shard_bytes` is given).

    `dtype` is the storage dtype; router weight and bias are always float32, as released. With `mxfp8`, every
    attention (incl. index), dense-MLP, shared- and routed-expert Linear is stored as fp8 + UE8M0 scale.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {layout!r}")
    if dtype not in _STORE_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_STORE_DTYPES)}, got {dtype!r}")
    lay = LAYOUTS[layout]
    _check_params(cfg, params)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_dict(cfg, lay, dtype, mxfp8), indent=2) + "\n")

    store = _STORE_DTYPES[dtype]
    f32 = np.dtype(np.float32)

    # The weight and its scale are written back to back, so one cached quantisation serves both.
    @functools.lru_cache(maxsize=1)
    def quantised(rule: TensorRule) -> tuple[np.ndarray, np.ndarray]:
        return quantize_mxfp8(assemble(rule, params, f32))

    def part(rule: TensorRule, i: int) -> np.ndarray:
        return quantised(rule)[i]

    tensors: list[LazyTensor] = []
    for rule in tensor_rules(cfg, lay).values():
        if cfg.tie_word_embeddings and rule.name == lay.lm_head:
            continue  # tied: transformers does not save lm_head either
        if mxfp8 and rule.quantizable:
            tensors += [LazyTensor(rule.name, rule.shape, FP8, functools.partial(part, rule, 0)),
                        LazyTensor(rule.scale_name, scale_shape(rule.shape), np.dtype(np.uint8),
                                   functools.partial(part, rule, 1))]
        else:
            dt = f32 if rule.fp32 else store
            make = functools.partial(assemble, rule, params, dt)
            tensors.append(LazyTensor(rule.name, rule.shape, dt, make))
    write_checkpoint_files(out, tensors, max_shard_bytes)
    return out
