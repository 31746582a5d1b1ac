"""Expert-weight layouts the MoE kernels read, built once at load time (checkpoints/prepare.py calls these).

The prepared layout is a dict `p["experts"]` inside the MoE params, holding three matrices, gate / up
`[S, D, F]` and down `[S, F, D]`, K-major like every m3jax matrix (`x @ w`). S = E routed experts plus,
when the shared expert has the routed width, one more slot (index E) holding the shared expert, which the
kernels then treat as an always-selected expert of weight 1. Per format:

  dense   {"gate", "up", "down"}: float arrays (bf16 on the GPU).
  mxfp8   {"gate_q8", "gate_s", ...}: uint16 `[S, K/2, N]`, two float8_e4m3fn bytes a word, E8M0 scales packed
          four to a uint32 `[S, K/128, N]` (byte j of word g: the scale of K block 4g + j).
  mxfp4   {"gate_q4", "gate_s", ...}: uint16 `[S, K/4, N]`, four E2M1 nibbles a word, scales packed as for mxfp8.

Word packing (both MX formats): a checkpoint packs K neighbours (2i, 2i+1) into one byte (MXFP4), which a
kernel would have to interleave back along K. Instead K is cut into groups of 128, a group into `per_word`
(= 16 / bits) runs of 128 / per_word elements, and word r of a group holds element r of every run (run j in bits
[j * bits, (j + 1) * bits)): MXFP8 word r holds elements r and r + 64, MXFP4 word r elements r, r + 32, r + 64 and
r + 96. A kernel step then widens one field of a [rows, bn] word tile into a [rows, bn] weight tile for x
columns that are contiguous: no shuffles, for every tile with bk a multiple of 128. The words are 16-bit for a
reason outside the formats: Pallas' Triton lowering indexes arrays under 4 GiB with 32-bit element offsets,
which wrap past 2^31 elements (M3's stacked fp8 gate is 2.4e9 bytes), and two 16-bit words fill the 32-bit
register that the inline-PTX widening works on.

Scale packing: a kernel step reads the four block scales of each 128-group per column. As single bytes those
loads are too narrow for Triton's asynchronous copies (4 bytes at least), so they were plain global loads that
every K step waited on (seen in the sm_90 build: one LDG.U8 per half group, then a shared-memory round trip and a
barrier to broadcast them). One 32-bit word per (group, column) is pipelined with the weight tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import mx

MATS = ("gate", "up", "down")
MX_GROUP = 128  # K elements per pair-packing group
BITS = {"mxfp8": 8, "mxfp4": 4}
PER_WORD = {fmt: 16 // bits for fmt, bits in BITS.items()}  # elements in one 16-bit kernel word
_KEY = {"mxfp8": "q8", "mxfp4": "q4"}


def weight_format(experts: dict) -> str:
    if "gate_q8" in experts:
        return "mxfp8"
    if "gate_q4" in experts:
        return "mxfp4"
    return "dense"


def weight_arrays(experts: dict, mat: str) -> tuple[jax.Array, ...]:
    """The arrays a kernel reads for one matrix, in kernel argument order."""
    fmt = weight_format(experts)
    if fmt == "dense":
        return (experts[mat],)
    return experts[f"{mat}_{_KEY[fmt]}"], experts[f"{mat}_s"]


def num_slots(experts: dict) -> int:
    # [.., S, K, N]: the slot axis counted from the end, so a run's stack of layers reads the same.
    return int(weight_arrays(experts, "gate")[0].shape[-3])


def has_shared_slot(p: dict) -> bool:
    return "experts" in p and num_slots(p["experts"]) == p["router"].shape[-1] + 1


def stack_dense(p: dict, dtype: jnp.dtype | None = None) -> dict:
    """{"gate", "up", "down"} `[S, K, N]` from the MoE params, the shared expert as slot E when it fits."""
    mats = {"gate": p["w_gate"], "up": p["w_up"], "down": p["w_down"]}
    s = p.get("shared")
    if s is not None and s["w_gate"].shape == p["w_gate"].shape[1:]:
        mats = {"gate": jnp.concatenate([mats["gate"], s["w_gate"][None]]),
                "up": jnp.concatenate([mats["up"], s["w_up"][None]]),
                "down": jnp.concatenate([mats["down"], s["w_down"][None]])}
    return {k: jnp.asarray(v, dtype) for k, v in mats.items()}


def _kn(w_SKN: jax.Array) -> jax.Array:
    return jnp.swapaxes(w_SKN, -1, -2)


def word_pack(codes_SNK: jax.Array, fmt: str) -> jax.Array:
    """Element codes `[S, N, K]` (K-contiguous, natural order) -> kernel words uint16 `[S, K/per_word, N]`."""
    *lead, n, k = codes_SNK.shape
    assert k % MX_GROUP == 0, f"MX kernel layout needs K={k} a multiple of {MX_GROUP}"
    per = PER_WORD[fmt]
    c = codes_SNK.astype(jnp.uint32).reshape(*lead, n, k // MX_GROUP, per, MX_GROUP // per)
    words = c[..., 0, :]
    for j in range(1, per):
        words = words | (c[..., j, :] << (BITS[fmt] * j))
    return _kn(words.astype(jnp.uint16).reshape(*lead, n, k // per))


def word_unpack(words_SKwN: jax.Array, fmt: str) -> jax.Array:
    """Kernel words `[S, K/per_word, N]` -> element codes `[S, N, K]` (int32) in natural K order."""
    b = _kn(words_SKwN).astype(jnp.int32)
    *lead, n, kw = b.shape
    per = PER_WORD[fmt]
    g = b.reshape(*lead, n, kw // (MX_GROUP // per), MX_GROUP // per)
    mask = (1 << BITS[fmt]) - 1
    return jnp.stack([(g >> (BITS[fmt] * j)) & mask for j in range(per)], axis=-2).reshape(*lead, n, per * kw)


SCALES_PER_WORD = MX_GROUP // mx.BLOCK  # 4 block scales of a 128-group in one uint32


def pack_scales(scale_SNKb: jax.Array) -> jax.Array:
    """E8M0 bytes `[S, N, K/32]` -> kernel scale words uint32 `[S, K/128, N]` (see above)."""
    *lead, n, kb = scale_SNKb.shape
    assert kb % SCALES_PER_WORD == 0, f"MX kernel layout needs K={kb * mx.BLOCK} a multiple of {MX_GROUP}"
    b = scale_SNKb.astype(jnp.uint32).reshape(*lead, n, kb // SCALES_PER_WORD, SCALES_PER_WORD)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return _kn(words)


def unpack_scales(words_SKgN: jax.Array) -> jax.Array:
    """Kernel scale words `[S, K/128, N]` -> E8M0 bytes `[S, K/32, N]` (uint8)."""
    *lead, kg, n = words_SKgN.shape
    b = jnp.stack([(words_SKgN >> (8 * j)) & 0xFF for j in range(SCALES_PER_WORD)], axis=-2)
    return b.reshape(*lead, kg * SCALES_PER_WORD, n).astype(jnp.uint8)


def mxfp8_from_checkpoint(fp8_SNK: jax.Array, scale_SNKb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Checkpoint MXFP8 (`[S, N, K]` float8_e4m3fn + `[S, N, K/32]`, HF Linear layout) -> kernel layout."""
    return word_pack(jax.lax.bitcast_convert_type(fp8_SNK, jnp.uint8), "mxfp8"), pack_scales(scale_SNKb)


def mxfp4_from_checkpoint(packed_SNK2: jax.Array, scale_SNKb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Checkpoint MXFP4 (`[S, N, K/2]`, element 2i low nibble, + `[S, N, K/32]`) -> kernel layout."""
    return word_pack(mx.unpack_e2m1_jnp(packed_SNK2), "mxfp4"), pack_scales(scale_SNKb)


def decode_codes(codes: jax.Array, fmt: str, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Element codes (int32) -> values (unscaled). Ops that Pallas' Triton lowering supports: kernels use it."""
    if fmt == "mxfp8":
        # The byte reinterpreted as e4m3, then the hardware conversion.
        return jax.lax.bitcast_convert_type(codes.astype(jnp.uint8), jnp.float8_e4m3fn).astype(dtype)
    return mx.e2m1_to_f32(codes).astype(dtype)


# e4m3 pairs -> bf16 pairs by bit moves in one 32-bit register (the "expand_asm" kernel mode's inline PTX, which
# these constants build; tests/test_moe_kernels.py emulates the same steps). A register holds two of our 16-bit
# words, i.e. bytes [lo(w0), hi(w0), lo(w1), hi(w1)]. PRMT makes each 16-bit lane [sign byte | e4m3 byte]: one
# byte of each word, under it its sign replicated to 8 bits (PRMT's sign-extend selectors). A left shift by 4 moves
# e4m3's exponent and mantissa into bf16's fields and a replicated sign bit into bit 15; the AND clears what is
# left of the sign replicas (and what the shift carried in from the lower lane). The bf16 is then exactly 2^-120
# times the e4m3 value, subnormals included (they become bf16 subnormals, which the packed bf16 multiply keeps).
# Three integer ops a register: the integer pipe runs at half rate on the H200 and bounds this kernel. The block
# scale carries the 2^120: 2^(s - 7), bf16 bits (s + 120) << 7, exact for s <= ASM_BF16_MAX_SCALE["mxfp8"].
E4M3_BF16_PRMT = (0xA280, 0xB391)  # low bytes of the two words, high bytes of the two words, each with its sign
E4M3_BF16_SHIFT, E4M3_BF16_MASK = 4, 0x87F087F0
# E2M1 nibbles -> bf16 pairs the same way (MXFP4's "expand_asm"): a register holds two words of four nibbles; for
# field j of both, one shift puts its sign bit at bf16's bit 15 and another its 3 magnitude bits (2 exponent, 1
# mantissa) at bf16's bits 6..8, two ANDs keep just those, an OR joins them (ptxas fuses the logic into LOP3s).
# The bf16 is then exactly 2^-126 times the E2M1 value (exponent field e, top mantissa bit m; e = 0 is the
# subnormal 0.5 m). The block scale carries the 2^126: 2^(s - 1), bf16 bits (s + 126) << 7.
E2M1_BF16_SIGN_MASK, E2M1_BF16_MAG_MASK = 0x80008000, 0x01C001C0
# Per format: the bias folded into the scale's bf16 exponent, and the largest E8M0 scale that stays finite.
ASM_BF16_BIAS = {"mxfp8": 120, "mxfp4": 126}
ASM_BF16_MAX_SCALE = {fmt: 254 - bias for fmt, bias in ASM_BF16_BIAS.items()}
# Marker key (an empty array) in MX experts with a scale above ASM_BF16_MAX_SCALE (weight blocks whose largest
# magnitude reaches 2^16 in MXFP8 or 16 in MXFP4; trained weights stay far below): the kernels then widen those
# weights the "expand" way. A key, not a value, because the choice is static at trace time.
WIDE_SCALES = "wide_scales"


def mark_wide_scales(experts: dict) -> dict:
    """`experts` plus the WIDE_SCALES marker where the "expand_asm" widening cannot represent a scale (one
    host sync per layer: for load time, not the serving loop)."""
    fmt = weight_format(experts)
    if fmt == "dense" or any(isinstance(experts[f"{m}_s"], jax.core.Tracer) for m in MATS):
        return experts  # abstract weights (shapes only, e.g. compiling ahead of time) hold no scale to read
    top = max(int(jnp.max(unpack_scales(experts[f"{m}_s"]))) for m in MATS)
    return dict(experts, **{WIDE_SCALES: jnp.zeros((0,), jnp.uint8)}) if top > ASM_BF16_MAX_SCALE[fmt] else experts


def widening_ptx(fmt: str, field: int) -> str:
    """Inline PTX: $1 = two 16-bit words, $2 = a bf16x2 block scale -> $0 = bf16x2 of field `field` of both words
    (MXFP8: byte 0 or 1; MXFP4: nibble 0..3), scaled. (One result per asm: Pallas' Triton lowering takes a single
    result.)"""
    if fmt == "mxfp8":
        return f"""{{
.reg .b32 a;
prmt.b32 a, $1, 0, {E4M3_BF16_PRMT[field]:#x};
shl.b32 a, a, {E4M3_BF16_SHIFT};
and.b32 a, a, {E4M3_BF16_MASK:#x};
mul.rn.bf16x2 $0, a, $2;
}}"""
    sign_shift, mag_shift = 12 - 4 * field, 6 - 4 * field  # bit 4j + 3 -> 15; bits 4j .. 4j + 2 -> 6 .. 8
    mag_op = f"shl.b32 b, $1, {mag_shift}" if mag_shift >= 0 else f"shr.b32 b, $1, {-mag_shift}"
    return f"""{{
.reg .b32 a, b;
shl.b32 a, $1, {sign_shift};
and.b32 a, a, {E2M1_BF16_SIGN_MASK:#x};
{mag_op};
and.b32 b, b, {E2M1_BF16_MAG_MASK:#x};
or.b32 a, a, b;
mul.rn.bf16x2 $0, a, $2;
}}"""


def asm_bf16_scale(s: jax.Array, fmt: str) -> jax.Array:
    """E8M0 bytes -> the bf16 block scale times the power of two that the bit-moved values lack: 2^(s - 7) for
    e4m3 (values 2^-120 small), 2^(s - 1) for E2M1 (2^-126)."""
    bits = (s.astype(jnp.int32) + ASM_BF16_BIAS[fmt]) << 7
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def quantize_experts(dense: dict, fmt: str) -> dict:
    """Dense `[S, K, N]` matrices -> the `fmt` kernel layout (quantised on the device they live on)."""
    if fmt == "dense":
        return dense
    if fmt not in BITS:
        raise ValueError(f"unknown MoE weight format {fmt!r} (dense, mxfp8, mxfp4)")
    out = {}
    for mat in MATS:
        w_SNK = _kn(dense[mat])
        # One slot at a time: the fp32 intermediates of all 129 M3 experts at once would not fit beside them.
        if fmt == "mxfp8":
            q, s = jax.lax.map(mx.quantize_mxfp8_jnp, w_SNK)
            out[f"{mat}_q8"], out[f"{mat}_s"] = mxfp8_from_checkpoint(q, s)
        else:
            q, s = jax.lax.map(mx.quantize_mxfp4_jnp, w_SNK)
            out[f"{mat}_q4"], out[f"{mat}_s"] = mxfp4_from_checkpoint(q, s)
    return out


def dequantize_experts(experts: dict, dtype: jnp.dtype = jnp.float32) -> dict:
    """Any kernel layout -> dense {"gate", "up", "down"} `[S, K, N]` (the weights the kernels compute with)."""
    fmt = weight_format(experts)
    out = {}
    for mat in MATS:
        if fmt == "dense":
            out[mat] = experts[mat].astype(dtype)
            continue
        words, scale = weight_arrays(experts, mat)
        vals = decode_codes(word_unpack(words, fmt), fmt)
        vals = vals.reshape(*vals.shape[:-1], -1, mx.BLOCK) * mx.e8m0_to_f32(_kn(unpack_scales(scale)))[..., None]
        out[mat] = _kn(vals.reshape(*vals.shape[:-2], -1)).astype(dtype)
    return out


def reference_params(p: dict, dtype: jnp.dtype | None = None) -> dict:
    """MoE params in the reference's layout (w_gate/w_up/w_down `[E, ...]`, shared) from a prepared dict.

    The dequantised weights, so the reference computes exactly what the kernels compute (tests, the
    `reference` override on prepared params).
    """
    if "experts" not in p:
        return p
    dt = dtype or p["router"].dtype
    dense = dequantize_experts(p["experts"], dt)
    num_e = p["router"].shape[1]
    out = {k: v for k, v in p.items() if k not in ("experts", "w_gate", "w_up", "w_down")}
    out.update(w_gate=dense["gate"][:num_e], w_up=dense["up"][:num_e], w_down=dense["down"][:num_e])
    if has_shared_slot(p):
        out["shared"] = {"w_gate": dense["gate"][num_e], "w_up": dense["up"][num_e],
                         "w_down": dense["down"][num_e]}
    return out
