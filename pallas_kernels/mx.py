"""OCP Microscaling (MX) weight formats, shared by the checkpoint loader and the kernels (m3-spec 2.2-2.3).

Both formats keep one E8M0 scale byte per 32 consecutive elements along K (the input / contraction axis, the
last axis here), value `2^(b - 127)` (255 is NaN):
  MXFP8: float8_e4m3fn elements, `[..., K]`; `w = fp8 * 2^(s - 127)`.
  MXFP4: E2M1 codes (sign bit, 2 exponent bits, 1 mantissa bit; magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}) packed
         two per byte along K, `[..., K/2]` uint8, element 2i in the low nibble and 2i+1 in the high one.

Three kinds of helpers live here:
  - numpy quantise / dequantise (host side: the checkpoint loader and writer),
  - jnp quantise / dequantise (device side: load-time layout preparation on the GPU, references in tests),
  - in-kernel decoders (`e8m0_to_f32`, `e2m1_to_f32`) written with the bit operations that Pallas' Triton
    lowering supports, so a kernel streams the 8- or 4-bit bytes and widens them in registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

BLOCK = 32
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
_E4M3_EMAX = 8  # exponent of the largest normal e4m3 value, floor(log2(448))
E2M1_MAX = 6.0
_E2M1_EMAX = 2  # 6 = 1.5 * 2^2
E8M0_NAN = 255
E2M1_LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
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


def _shared_exponent(amax: np.ndarray, emax: int) -> np.ndarray:
    """Biased E8M0 exponent floor(log2(amax)) - emax + 127 (the OCP MX rule), 0 for all-zero blocks."""
    # frexp gives amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1 exactly (log2 can round up).
    _, e = np.frexp(amax)
    shared = np.where(amax > 0, e - 1 - emax, -127)
    return np.clip(shared + 127, 0, 254).astype(np.int32)


def _check_finite(w: np.ndarray, name: str) -> None:
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{name}: weights contain inf or NaN")


# ---- MXFP8, numpy ----------------------------------------------------------------------------------------


def quantize_mxfp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantise `[..., K]` weights by the OCP MX rule -> (fp8 `[..., K]`, uint8 scales `[..., ceil(K/32)]`).

    Shared exponent = floor(log2(block amax)) - 8, so the block maximum lands in e4m3's top binade; elements
    that then round above 448 saturate to ±448 (e4m3fn has no infinity and ml_dtypes would make them NaN).
    """
    w = np.asarray(w, dtype=np.float32)
    _check_finite(w, "quantize_mxfp8")
    blocks = _blocks(w)
    biased = _shared_exponent(np.max(np.abs(blocks), axis=-1), _E4M3_EMAX)
    elems = np.ldexp(blocks, (127 - biased)[..., None])
    fp8 = np.clip(elems, -E4M3_MAX, E4M3_MAX).astype(FP8)
    k = w.shape[-1]
    return fp8.reshape(*w.shape[:-1], -1)[..., :k], biased.astype(np.uint8)


def dequantize_mxfp8(fp8: np.ndarray, scale: np.ndarray, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """fp8 `[..., K]` + uint8 E8M0 scales `[..., ceil(K/32)]` -> `dtype` weights (no validation: see checkpoints)."""
    # A 256-entry table decodes fp8 several times faster than a dtype cast; the per-block factors are exact
    # powers of two (2^-127 is a float32 subnormal), so the product equals fp8 * 2^(s-127) exactly.
    out = _blocks(_FP8_TO_F32[fp8.view(np.uint8)])
    out *= _e8m0_factor(scale)[..., None]
    k = fp8.shape[-1]
    return out.reshape(*fp8.shape[:-1], -1)[..., :k].astype(dtype, copy=False)


def _e8m0_factor(scale: np.ndarray) -> np.ndarray:
    factor = np.ldexp(np.float32(1.0), scale.astype(np.int32) - 127)
    factor[scale == E8M0_NAN] = np.nan  # E8M0 0xFF encodes NaN
    return factor


# ---- MXFP4, numpy ----------------------------------------------------------------------------------------


def _round_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code (4-bit, sign in bit 3) of each value, ties to the even code, |x| > 6 saturating."""
    mag = np.minimum(np.abs(x), E2M1_MAX)
    grid = E2M1_LUT[:8]
    # The midpoints between neighbouring magnitudes; a tie goes to the even code (mantissa bit 0).
    mid = (grid[1:] + grid[:-1]) / 2
    code = np.searchsorted(mid, mag, side="left").astype(np.uint8)  # mag == mid -> lower code
    tie = (code < 7) & (mag == mid[np.minimum(code, 6)])
    code = np.where(tie & (code % 2 == 1), code + 1, code).astype(np.uint8)
    return code | (np.signbit(x) & (code > 0)).astype(np.uint8) << 3


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """4-bit codes `[..., K]` (K even) -> bytes `[..., K/2]`, element 2i in the low nibble."""
    codes = np.asarray(codes, np.uint8)
    return (codes[..., 0::2] & 0xF) | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """Bytes `[..., K/2]` -> 4-bit codes `[..., K]`."""
    lo, hi = packed & 0xF, packed >> 4
    return np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], -1)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`[..., K]` weights (K a multiple of 32) -> (packed E2M1 `[..., K/2]` uint8, E8M0 scales `[..., K/32]`).

    Shared exponent = floor(log2(block amax)) - 2 (E2M1's emax), as for MXFP8; elements round to nearest
    (ties to even) and saturate at ±6.
    """
    w = np.asarray(w, dtype=np.float32)
    _check_finite(w, "quantize_mxfp4")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"quantize_mxfp4: K={w.shape[-1]} is not a multiple of {BLOCK}")
    blocks = _blocks(w)
    biased = _shared_exponent(np.max(np.abs(blocks), axis=-1), _E2M1_EMAX)
    codes = _round_e2m1(np.ldexp(blocks, (127 - biased)[..., None]))
    return pack_e2m1(codes.reshape(w.shape)), biased.astype(np.uint8)


def dequantize_mxfp4(packed: np.ndarray, scale: np.ndarray, dtype: np.dtype | type = np.float32) -> np.ndarray:
    vals = _blocks(E2M1_LUT[unpack_e2m1(packed)])
    vals = vals * _e8m0_factor(scale)[..., None]
    return vals.reshape(*packed.shape[:-1], -1).astype(dtype, copy=False)


# ---- jnp (device) versions -------------------------------------------------------------------------------


def _jblocks(x: jax.Array) -> jax.Array:
    k = x.shape[-1]
    assert k % BLOCK == 0, f"K={k} must be a multiple of {BLOCK} on the device path"
    return x.reshape(*x.shape[:-1], k // BLOCK, BLOCK)


def _jshared_exponent(amax: jax.Array, emax: int) -> jax.Array:
    _, e = jnp.frexp(amax)
    shared = jnp.where(amax > 0, e - 1 - emax, -127)
    return jnp.clip(shared + 127, 0, 254).astype(jnp.int32)


def e8m0_to_f32(s: jax.Array) -> jax.Array:
    """E8M0 byte -> 2^(s - 127) in float32, by placing s in the exponent field.

    Exact for s in 1..254 (every scale a real checkpoint uses); s = 0 gives 0 instead of 2^-127 and 255 gives
    inf instead of NaN. Bit operations only, so it lowers inside Pallas Triton kernels.
    """
    return jax.lax.bitcast_convert_type(s.astype(jnp.int32) << 23, jnp.float32)


def e2m1_to_f32(code: jax.Array) -> jax.Array:
    """4-bit E2M1 code (int32, sign in bit 3) -> float32 value, built bit by bit (no table gathers in kernels).

    Exponent bits e, mantissa bit m: e == 0 is 0 or 0.5 (subnormal); otherwise (1 + m/2) * 2^(e-1), whose
    float32 exponent field is e + 126 and whose top mantissa bit is m.
    """
    e = (code >> 1) & 3
    m = code & 1
    normal = ((e + 126) << 23) | (m << 22)
    bits = jnp.where(e == 0, m * 0x3F000000, normal) | ((code >> 3) << 31)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def quantize_mxfp8_jnp(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Device version of `quantize_mxfp8` (K a multiple of 32); bit-identical to it."""
    blocks = _jblocks(w.astype(jnp.float32))
    biased = _jshared_exponent(jnp.max(jnp.abs(blocks), axis=-1), _E4M3_EMAX)
    elems = jnp.ldexp(blocks, (127 - biased)[..., None])
    fp8 = jnp.clip(elems, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return fp8.reshape(w.shape), biased.astype(jnp.uint8)


def dequantize_mxfp8_jnp(fp8: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    vals = _jblocks(fp8.astype(jnp.float32)) * e8m0_to_f32(scale)[..., None]
    return vals.reshape(fp8.shape).astype(dtype)


def quantize_mxfp4_jnp(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Device version of `quantize_mxfp4` (K a multiple of 32); bit-identical to it."""
    blocks = _jblocks(w.astype(jnp.float32))
    biased = _jshared_exponent(jnp.max(jnp.abs(blocks), axis=-1), _E2M1_EMAX)
    x = jnp.ldexp(blocks, (127 - biased)[..., None]).reshape(w.shape)
    mag = jnp.minimum(jnp.abs(x), E2M1_MAX)
    grid = np.asarray(E2M1_LUT[:8], np.float32)
    mids = [float(m) for m in (grid[1:] + grid[:-1]) / 2]
    # One compare per midpoint, summed: a [..., 7] broadcast would hold 7 fp32 copies of every expert at once.
    code = sum((mag > m).astype(jnp.int32) for m in mids)  # mag == mid -> lower code
    tie = jnp.zeros(mag.shape, bool)
    for m in mids:
        tie |= mag == m
    code = jnp.where(tie & (code % 2 == 1), code + 1, code)
    code = code | ((jnp.signbit(x) & (code > 0)).astype(jnp.int32) << 3)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(jnp.uint8)
    return packed, biased.astype(jnp.uint8)


def unpack_e2m1_jnp(packed: jax.Array) -> jax.Array:
    b = packed.astype(jnp.int32)
    return jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def dequantize_mxfp4_jnp(packed: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    vals = _jblocks(e2m1_to_f32(unpack_e2m1_jnp(packed))) * e8m0_to_f32(scale)[..., None]
    return vals.reshape(*packed.shape[:-1], -1).astype(dtype)
