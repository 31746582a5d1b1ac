"""MXFP8 weights as the MiniMax-M3-MXFP8 release stores them (OCP Microscaling, E4M3 elements, E8M0 scales).

A Linear weight `[..., N, K]` is stored as `float8_e4m3fn` of the same shape plus one unsigned-byte exponent
per 32 consecutive input-dim elements, `[..., N, ceil(K/32)]`:
    w[n, k] = fp8[n, k] * 2^(scale[n, k // 32] - 127).
The release calls that tensor `weight_scale_inv`, but it is multiplied, not divided.

All released K are multiples of 32. For other K (tiny test configs) the last block is partial; note that
transformers' FP8 dequantiser instead derives the block width as K / scale columns, so it would read such a
tensor differently.

The format itself (quantise / dequantise, also MXFP4) lives in `pallas_kernels/mx.py`, shared with the kernels;
this module adds the checks that name a bad checkpoint tensor.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from checkpoints.errors import CheckpointError
from pallas_kernels import mx
from pallas_kernels.mx import BLOCK, FP8, quantize_mxfp8, scale_shape

__all__ = ["BLOCK", "FP8", "dequantize_mxfp8", "quantize_mxfp8", "scale_shape"]


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
    return mx.dequantize_mxfp8(fp8, scale, dtype)
