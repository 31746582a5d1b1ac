"""MXFP8 weights as the MiniMax-M3-MXFP8 release stores them (OCP Microscaling, E4M3 elements, E8M0 scales).

A Linear weight `[..., N, K]` is stored as `float8_e4m3fn` of the same shape plus one unsigned-byte exponent
per 32 consecutive input-dim elements, `[..., N, ceil(K/32)]`:
    w[n, k] = fp8[n, k] * 2^(scale[n, k // 32] - 127).
The release calls that tensor `weight_scale_inv`, but it is multiplied, not divided.

All released K are multiples of 32. For other K (tiny test configs) the last block is partial; note that
transformers' FP8 dequantiser instead derives the block width as K / scale columns, so it would read such a
tensor differently.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from checkpoints.errors import CheckpointError

BLOCK = 32
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
_E4M3_EMAX = 8  # exponent of the largest normal e4m3 value, floor(log2(448))
_E8M0_NAN = 255
_FP8_TO_F32 = np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32)


def scale_shape(weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*weight_shape[:-1], -(-weight_shape[-1] // BLOCK))


def _blocks(x: np.ndarray) -> np.ndarray:
    """View the last axis as [ceil(K/32), 32], zero-padding a partial last block."""
    k = x.shape[-1]
    pad = -k % BLOCK
    if pad:
        x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], (k + pad) // BLOCK, BLOCK)


def quantize_mxfp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise `[..., K]` weights by the OCP MX rule -> (fp8 `[..., K]`, uint8 scales `[..., ceil(K/32)]`).

    Shared exponent = floor(log2(block amax)) - 8, so the block maximum lands in e4m3's top binade; elements
    that then round above 448 saturate to ±448 (e4m3fn has no infinity and ml_dtypes would make them NaN).
    """
    w = np.asarray(w, dtype=np.float32)
    if not np.all(np.isfinite(w)):
        raise ValueError("quantize_mxfp8: weights contain inf or NaN")
    blocks = _blocks(w)
    amax = np.max(np.abs(blocks), axis=-1)
    # frexp gives amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1 exactly (log2 can round up).
    _, e = np.frexp(amax)
    shared = np.where(amax > 0, e - 1 - _E4M3_EMAX, -127)
    biased = np.clip(shared + 127, 0, 254).astype(np.int32)
    elems = np.ldexp(blocks, (127 - biased)[..., None])
    fp8 = np.clip(elems, -_E4M3_MAX, _E4M3_MAX).astype(FP8)
    k = w.shape[-1]
    return fp8.reshape(*w.shape[:-1], -1)[..., :k], biased.astype(np.uint8)


def dequantize_mxfp8(fp8: np.ndarray, scale: np.ndarray, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """fp8 `[..., K]` + E8M0 scales `[..., ceil(K/32)]` (uint8, or float8_e8m0fnu bits) -> `dtype` weights."""
    if scale.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        scale = scale.view(np.uint8)
    if scale.dtype != np.uint8:
        raise CheckpointError(f"MXFP8 scales must be uint8 (E8M0), got {scale.dtype}")
    if fp8.dtype != FP8:
        raise CheckpointError(f"MXFP8 elements must be float8_e4m3fn, got {fp8.dtype}")
    if scale.shape != scale_shape(fp8.shape):
        raise CheckpointError(f"MXFP8 scale shape {list(scale.shape)} does not fit weight shape "
                              f"{list(fp8.shape)} (expected {list(scale_shape(fp8.shape))})")
    # A 256-entry table decodes fp8 several times faster than a dtype cast; the per-block factors are exact
    # powers of two (2^-127 is a float32 subnormal), so the product equals fp8 * 2^(s-127) exactly.
    out = _blocks(_FP8_TO_F32[fp8.view(np.uint8)])
    factor = np.ldexp(np.float32(1.0), scale.astype(np.int32) - 127)
    factor[scale == _E8M0_NAN] = np.nan  # E8M0 0xFF encodes NaN
    out *= factor[..., None]
    k = fp8.shape[-1]
    return out.reshape(*fp8.shape[:-1], -1)[..., :k].astype(dtype, copy=False)
