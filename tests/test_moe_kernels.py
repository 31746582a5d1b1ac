"""The Pallas MoE kernels (interpret mode) against the jnp reference, and the MX format helpers they share
with the checkpoints. Tiny shapes: E=8 experts of D=256 -> F=128, top-2, plus the shared expert as slot 8."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints.prepare import prepare_moe, prepare_params
from m3jax.config import preset
from m3jax.params import layer_view, random_params
from pallas_kernels import mx
from pallas_kernels.choice import KernelChoice
from pallas_kernels.moe import dispatch, kernel, layout, reference
from pallas_kernels.moe.tiles import GPU_TABLE, INTERPRET_TILES, KernelTiles, MoeTiles, fit_tiles, pick_tiles

E, D, F, TOP_K = 8, 256, 128, 2
KW = {"top_k": TOP_K, "routed_scaling": 2.0, "alpha": 1.702, "limit": 7.0}


def moe_params(seed: int, *, bias: np.ndarray | None = None, shared_width: int = F) -> dict:
    rng = np.random.default_rng(seed)

    def n(*shape: int, std: float = 1.0) -> jax.Array:
        return jnp.asarray(rng.normal(0.0, std, shape).astype(np.float32))

    return {
        "router": n(D, E, std=D**-0.5),
        "router_bias": jnp.asarray(bias, jnp.float32) if bias is not None else n(E, std=0.05),
        # Scaled so that the clamps at ±7 bite on some rows.
        "w_gate": n(E, D, F, std=3 * D**-0.5), "w_up": n(E, D, F, std=3 * D**-0.5), "w_down": n(E, F, D, std=F**-0.5),
        "shared": {"w_gate": n(D, shared_width, std=3 * D**-0.5), "w_up": n(D, shared_width, std=3 * D**-0.5),
                   "w_down": n(shared_width, D, std=shared_width**-0.5)},
    }


def hidden(seed: int, T: int, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(0.0, 2.0, (T, D)).astype(np.float32)).astype(dtype)


def bias_with(hot: list[int] | None = None, cold: list[int] | None = None) -> np.ndarray:
    b = np.zeros(E, np.float32)
    b[hot or []] = 100.0  # chosen by every token (the bias picks; it never weights)
    b[cold or []] = -100.0  # never chosen: empty experts
    return b


# ---- MX formats ------------------------------------------------------------------------------------------


def test_mx_device_quantisers_match_host() -> None:
    w = np.random.default_rng(0).normal(size=(3, 16, 128)).astype(np.float32)
    w[0, 0, :32] = 0.0  # an all-zero block
    w[1, 2, 7] = 1e4  # saturation edges
    # A block whose max 6 sets scale 2^0, holding every E2M1 midpoint (ties round to the even code) and its negative.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    w[2, 0, :32] = [6.0, *mids, *(-m for m in mids), *([0.1] * 17)]
    q8, s8 = mx.quantize_mxfp8(w)
    jq8, js8 = mx.quantize_mxfp8_jnp(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(jq8).view(np.uint8), q8.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(js8), s8)
    q4, s4 = mx.quantize_mxfp4(w)
    jq4, js4 = mx.quantize_mxfp4_jnp(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(jq4), q4)
    np.testing.assert_array_equal(np.asarray(js4), s4)
    nz = s8 > 0  # e8m0_to_f32 maps the 0 byte to 0 instead of 2^-127
    np.testing.assert_array_equal(np.asarray(mx.dequantize_mxfp8_jnp(jq8, js8))[np.repeat(nz, 32, -1)],
                                  mx.dequantize_mxfp8(q8, s8)[np.repeat(nz, 32, -1)])
    np.testing.assert_array_equal(np.asarray(mx.dequantize_mxfp4_jnp(jq4, js4)), mx.dequantize_mxfp4(q4, s4))


def test_expert_quantisation_memory_does_not_scale_with_experts() -> None:
    # The whole M3 expert stack is ~15 GiB of bf16 on one GPU: quantising it must not hold fp32 (or 7x fp32)
    # copies of every slot at once, which is how MXFP4 preparation once ran out of memory on the H200.
    shapes = {m: jax.ShapeDtypeStruct((32, 256, 512) if m != "down" else (32, 512, 256), jnp.bfloat16)
              for m in layout.MATS}
    in_bytes = sum(np.prod(s.shape) * 2 for s in shapes.values())
    for fmt in ("mxfp8", "mxfp4"):
        mem = jax.jit(lambda d, fmt=fmt: layout.quantize_experts(d, fmt)).lower(shapes).compile().memory_analysis()
        assert mem.temp_size_in_bytes < 2.5 * in_bytes, (fmt, mem.temp_size_in_bytes / in_bytes)


def test_mxfp4_rule_and_packing() -> None:
    # Every code decodes to the OCP E2M1 table; the in-kernel bit decoder agrees.
    np.testing.assert_array_equal(np.asarray(mx.e2m1_to_f32(jnp.arange(16, dtype=jnp.int32))), mx.E2M1_LUT)
    s = np.arange(1, 255, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(mx.e8m0_to_f32(jnp.asarray(s))), np.exp2(s.astype(np.float64) - 127))
    # Even element in the low nibble.
    packed = mx.pack_e2m1(np.array([[1, 2, 3, 15]], np.uint8))
    np.testing.assert_array_equal(packed, [[0x21, 0xF3]])
    np.testing.assert_array_equal(mx.unpack_e2m1(packed), [[1, 2, 3, 15]])
    # Block max lands on 6 (scale = floor(log2 amax) - 2); ties round to the even code; the error is bounded.
    w = np.random.default_rng(1).normal(size=(4, 64)).astype(np.float32)
    w[0, :4] = [0.25, 0.75, 2.5, 5.0]  # midpoints between E2M1 magnitudes (block max below 6)
    w[0, 4] = 6.0
    q, sc = mx.quantize_mxfp4(w)
    back = mx.dequantize_mxfp4(q, sc)
    np.testing.assert_array_equal(back[0, :5], [0.0, 1.0, 2.0, 4.0, 6.0])
    step = np.repeat(np.exp2(sc.astype(np.float64) - 127), 32, axis=1)
    assert np.all(np.abs(back - w) <= 0.25 * np.abs(w) + 0.25 * step)
    # Re-quantising is the identity.
    q2, sc2 = mx.quantize_mxfp4(back)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(sc2, sc)


def test_mx_kernel_layout_round_trip() -> None:
    codes = np.random.default_rng(2).integers(0, 16, size=(2, 8, 256)).astype(np.uint8)  # [S, N, K]
    packed = mx.pack_e2m1(codes)
    scales = np.random.default_rng(4).integers(0, 256, size=(2, 8, 8)).astype(np.uint8)  # [S, N, K/32]
    kq, ks = layout.mxfp4_from_checkpoint(jnp.asarray(packed), jnp.asarray(scales))
    assert kq.shape == (2, 64, 8) and kq.dtype == jnp.uint16 and ks.shape == (2, 2, 8) and ks.dtype == jnp.uint32
    # Scale word g of a column: the 4 block scales of K group g, block 4g + j in byte j.
    np.testing.assert_array_equal((np.asarray(ks)[1, 1, 5] >> (8 * np.arange(4))) & 0xFF, scales[1, 5, 4:8])
    np.testing.assert_array_equal(np.asarray(layout.unpack_scales(ks)), np.swapaxes(scales, 1, 2))
    # Word r of each 128-group: element r + 32 j in nibble j.
    b = np.asarray(kq)[0, :, 0]
    for j in range(4):
        np.testing.assert_array_equal((b[32:64] >> (4 * j)) & 0xF, codes[0, 0, 128 + 32 * j:160 + 32 * j])
    np.testing.assert_array_equal(np.asarray(layout.word_unpack(kq, "mxfp4")), codes)
    # MXFP8: word r of a group holds element r in its low byte, r + 64 in its high one.
    fp8 = np.random.default_rng(3).normal(size=(2, 8, 256)).astype(ml_dtypes.float8_e4m3fn)
    k8, _ = layout.mxfp8_from_checkpoint(jnp.asarray(fp8), jnp.zeros((2, 8, 8), jnp.uint8))
    assert k8.shape == (2, 128, 8) and k8.dtype == jnp.uint16
    w = np.asarray(k8)[1, 64:128, 3]  # the second group
    np.testing.assert_array_equal(w & 0xFF, fp8[1, 3, 128:192].view(np.uint8))
    np.testing.assert_array_equal(w >> 8, fp8[1, 3, 192:256].view(np.uint8))
    back = layout.decode_codes(layout.word_unpack(k8, "mxfp8"), "mxfp8")
    np.testing.assert_array_equal(np.asarray(back), fp8.astype(np.float32))


# ---- sorted-and-padded layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [None, bias_with(hot=[3]), bias_with(cold=[0, 1, 2, 5, 6])])
@pytest.mark.parametrize("T", [1, 13, 40, 400])
def test_sort_and_pad_invariants(bias: np.ndarray | None, T: int) -> None:
    p = moe_params(0, bias=bias)
    idx, w = reference.route(hidden(1, T), p["router"], p["router_bias"], TOP_K)
    bm, S = 16, E + 1
    lay = kernel.sort_and_pad(idx, w, num_slots=S, shared_slot=True, bm=bm, routed_scaling=2.0)
    assert (T * (TOP_K + 1) <= kernel.COMPARE_LAYOUT_MAX_PAIRS) == (T < 400)  # both methods covered
    slot_B, dest = np.asarray(lay.slot_B), np.asarray(lay.dest_TJ)
    row_token = np.asarray(lay.row_token_M)
    assert slot_B.shape[0] == kernel.max_row_blocks(T * (TOP_K + 1), S, bm)
    e_TJ = np.concatenate([np.asarray(idx), np.full((T, 1), E)], axis=1)
    assert len(np.unique(dest)) == dest.size  # every (token, choice) owns one row
    # A row lies in a block of its own slot and holds its token; each choice carries its combine weight.
    np.testing.assert_array_equal(slot_B[dest // bm], e_TJ)
    np.testing.assert_array_equal(row_token[dest], np.repeat(np.arange(T)[:, None], TOP_K + 1, axis=1))
    w_TJ = np.concatenate([np.asarray(w) * 2.0, np.ones((T, 1))], axis=1)
    np.testing.assert_allclose(np.asarray(lay.w_TJ), w_TJ, rtol=1e-6)
    # Used blocks come first, one slot each, in slot order (one token: its distinct slots in choice order);
    # every used block has a row.
    used = slot_B[slot_B >= 0]
    assert np.all(slot_B[: used.size] >= 0)
    assert np.all(np.diff(used) >= 0) if T > 1 else len(np.unique(used)) == used.size
    assert set(np.unique(dest // bm)) == set(range(used.size))
    # rows_B counts each block's pairs (what the half-height tail blocks go by); unused blocks hold none.
    np.testing.assert_array_equal(np.asarray(lay.rows_B), np.bincount(dest.ravel() // bm, minlength=slot_B.size))


@pytest.mark.parametrize("bias", [None, bias_with(hot=[3]), bias_with(cold=[0, 1, 2, 5, 6])])
@pytest.mark.parametrize("T", [2, 13, 40, 300])
def test_compare_layout_equals_argsort_layout(bias: np.ndarray | None, T: int) -> None:
    """The decode-size layout (masked sums) is the argsort layout, row for row and bit for bit."""
    p = moe_params(0, bias=bias)
    idx, w = reference.route(hidden(2, T), p["router"], p["router_bias"], TOP_K)
    kw = {"num_slots": E + 1, "shared_slot": True, "bm": 16, "routed_scaling": 2.0}
    a = kernel.sort_and_pad(idx, w, method="argsort", **kw)
    b = kernel.sort_and_pad(idx, w, method="compare", **kw)
    for name in ("row_token_M", "slot_B", "dest_TJ", "w_TJ", "rows_B"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)


# ---- kernels vs reference --------------------------------------------------------------------------------


ROUTINGS = {
    "random": (37, None),
    "empty_experts": (13, bias_with(cold=[0, 1, 2, 5])),
    "hot_expert": (21, bias_with(hot=[3])),
    "one_token": (1, None),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "mxfp4"])
def test_kernel_equals_reference(fmt: str, routing: str) -> None:
    """fp32 activations, so the only difference is summation order: the kernel computes exactly the function
    the reference computes on the (dequantised) weights."""
    T, bias = ROUTINGS[routing]
    p = prepare_moe(moe_params(3, bias=bias), fmt, keep_reference=False)
    assert set(p) == {"router", "router_bias", "experts"}
    h = hidden(4, T)
    want = reference.moe(h, layout.reference_params(p, jnp.float32), **KW)
    got = kernel.moe_pallas(h, p, interpret=True, **KW)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("num_valid", [1, 9, 21])
def test_padding_rows_are_computed_nowhere(num_valid: int) -> None:
    """A bucket's padding rows (from `num_valid` on) join no slot's row blocks: the real rows' outputs are the
    reference's, no expert computes a row for the padding (its outputs are 0: the shared expert is a slot here
    too), and the used blocks hold exactly the real rows' pairs."""
    T = 21
    p = prepare_moe(moe_params(7), "bf16", keep_reference=False)
    h = hidden(8, T)
    got = kernel.moe_pallas(h, p, interpret=True, num_valid=jnp.int32(num_valid), **KW)
    want = reference.moe(h[:num_valid], layout.reference_params(p, jnp.float32), **KW)
    np.testing.assert_allclose(np.asarray(got[:num_valid]), np.asarray(want), rtol=2e-5,
                               atol=2e-5 * float(jnp.abs(want).max()))
    np.testing.assert_array_equal(np.asarray(got[num_valid:]), 0.0)
    S = layout.num_slots(p["experts"])
    e_TJ, w_TJ = kernel.routed_pairs(*kernel.route(h, p["router"], p["router_bias"], TOP_K), num_slots=S,
                                     shared_slot=True, routed_scaling=2.0)
    lay = kernel.pairs_layout(jnp.where(jnp.arange(T)[:, None] >= num_valid, S, e_TJ), w_TJ, num_slots=S, bm=8)
    assert int(jnp.sum(jnp.where(lay.slot_B >= 0, lay.rows_B, 0))) == num_valid * (TOP_K + 1)


@pytest.mark.parametrize("variant", [{"mx_mode": "subdot"}, {"mx_rows": 64}])
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_kernel_mx_variants_equal_expand(fmt: str, variant: dict) -> None:
    """One dot per 32-row scale block (scaling the result, or the widened weights) computes what one dot per
    64-row half with its two blocks' scales chosen per row computes."""
    p = prepare_moe(moe_params(5), fmt)
    h = hidden(6, 19)
    assert INTERPRET_TILES.mx_rows == 32
    a = kernel.moe_pallas(h, p, interpret=True, tiles=INTERPRET_TILES, **KW)
    b = kernel.moe_pallas(h, p, interpret=True, tiles=INTERPRET_TILES.replace(**variant), **KW)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(a).max()))


@pytest.mark.parametrize("fmt,bk,split", [("bf16", 32, 2), ("bf16", 32, 4), ("mxfp8", 128, 2)])
def test_split_k_equals_reference(fmt: str, bk: int, split: int) -> None:
    """Split K (what single-token decode uses for more programs): gate_up's last program of each tile sums the
    fp32 partials in split order, down's partials are summed by the combine. An empty expert and a hot one,
    19 tokens (not a multiple of the 16-row blocks); deterministic from call to call."""
    p = prepare_moe(moe_params(11, bias=bias_with(hot=[2], cold=[5])), fmt, keep_reference=False)
    h = hidden(12, 19)
    kt = dataclasses.replace(INTERPRET_TILES.gu, bk=bk, split=split)
    tiles = INTERPRET_TILES.replace(gu=kt, dn=dataclasses.replace(kt, split=split))
    fitted = kernel.kernel_tiles(19, p["experts"], tiles=tiles, interpret=True)
    assert fitted.gu.split == split and (fitted.dn.split == split) == (fmt == "bf16")  # MX down: one K step
    want = reference.moe(h, layout.reference_params(p, jnp.float32), **KW)
    got = kernel.moe_pallas(h, p, interpret=True, tiles=tiles, **KW)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(kernel.moe_pallas(h, p, interpret=True, tiles=tiles,
                                                                                **KW)))


@pytest.mark.parametrize("fmt,heights", [("bf16", (16,)), ("mxfp8", (16,)), ("bf16", (8, 16)), ("mxfp8", (8, 16))])
def test_short_tail_blocks_equal_reference(fmt: str, heights: tuple[int, ...]) -> None:
    """Blocks holding few pairs compute fewer rows (MoeTiles.tail_heights): 32-row blocks, 57 tokens with a hot
    and an empty expert, so there are full blocks, tails of <= 8, of 9-16 and of more pairs."""
    p = prepare_moe(moe_params(13, bias=bias_with(hot=[4], cold=[6])), fmt, keep_reference=False)
    h = hidden(14, 57)
    tiles = INTERPRET_TILES.replace(bm=32, tail_heights=heights)
    idx, w = reference.route(h, p["router"], p["router_bias"], TOP_K)
    rows = np.asarray(kernel.sort_and_pad(idx, w, num_slots=E + 1, shared_slot=True, bm=32,
                                          routed_scaling=KW["routed_scaling"]).rows_B)
    assert np.any(rows == 32) and np.any((rows > 16) & (rows < 32))
    assert np.any((rows > 0) & (rows <= 8)) and np.any((rows > 8) & (rows <= 16))
    want = reference.moe(h, layout.reference_params(p, jnp.float32), **KW)
    got = kernel.moe_pallas(h, p, interpret=True, tiles=tiles, **KW)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))


MOSAIC_TILES = MoeTiles("prefill", bm=128, gu=KernelTiles(bn=128, bk=64, warps=4, stages=2),
                        dn=KernelTiles(bn=128, bk=64, warps=4, stages=2), group=2, backend="mosaic")


@pytest.mark.parametrize("routing", ["hot_and_empty", "random"])
def test_mosaic_kernels_equal_triton_kernels(routing: str) -> None:
    """The Mosaic GPU kernels (moe/kernel_mgpu.py, run by jax's GPU interpreter: warpgroups, barriers and TMA
    simulated) against the Triton kernels on the same bf16 inputs. 200 tokens: full 128-row blocks, tails of
    more than 64 pairs (both warpgroups) and of fewer (warpgroup 0 alone), an empty expert, unused blocks."""
    bias = bias_with(hot=[4], cold=[6]) if routing == "hot_and_empty" else None
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), prepare_moe(moe_params(13, bias=bias), "bf16",
                                                                      keep_reference=False))
    h = hidden(14, 200, jnp.bfloat16)
    idx, w = reference.route(h, p["router"], p["router_bias"], TOP_K)
    lay = kernel.sort_and_pad(idx, w, num_slots=E + 1, shared_slot=True, bm=128, routed_scaling=KW["routed_scaling"])
    rows = np.asarray(lay.rows_B)
    assert np.any(rows == 128) and np.any((rows > 0) & (rows <= 64)) and np.any(np.asarray(lay.slot_B) < 0)
    if routing == "hot_and_empty":
        assert np.any((rows > 64) & (rows < 128))
    got = kernel.moe_pallas(h, p, interpret=True, tiles=MOSAIC_TILES, **KW).astype(jnp.float32)
    tri = kernel.moe_pallas(h, p, interpret=True, tiles=INTERPRET_TILES, **KW).astype(jnp.float32)
    want = reference.moe(h, layout.reference_params(p, jnp.bfloat16), **KW).astype(jnp.float32)
    assert float(jnp.linalg.norm(got - tri) / jnp.linalg.norm(tri)) < 2e-4  # summation order, bf16 act ulps
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 2e-2


MOSAIC_MX_TILES = MOSAIC_TILES.replace(gu=KernelTiles(bn=64, bk=128, warps=4, stages=2),
                                      dn=KernelTiles(bn=128, bk=128, warps=4, stages=2))


@pytest.mark.parametrize("widen", ["split", "each", "swap"])
def test_mosaic_mxfp8_kernels_equal_triton_kernels(widen: str) -> None:
    """MXFP8 experts through the Mosaic GPU kernels (each 128-deep K group widened once into a bf16 tile in
    shared memory, then one wgmma), in jax's GPU interpreter, against the Triton kernels on the same words and
    scales: the widened weights are the same bf16 values, so only the summation order differs. The weights span
    scales (a block of tiny weights, one near e4m3's top) so that every scale byte of a word and subnormal e4m3
    codes are exercised. "split": the two compute warpgroups widen one half each into a shared, double-buffered
    tile (a barrier a step); "each": each widens the whole step for itself; "swap": wgmma's operands swapped,
    each warpgroup widening its own 64 columns into registers (in the interpreter, through shared memory), down's
    y stored transposed by its epilogue."""
    params = moe_params(13, bias=bias_with(hot=[4], cold=[6]))
    w_gate = np.array(params["w_gate"])
    w_gate[1, 32:64, :] *= 1e-3  # K block 1 of expert 1: scale byte 1 small, codes near the subnormal range
    w_gate[2, 96:, 5] *= 40.0  # K block 3 of a column: a large scale byte
    params["w_gate"] = jnp.asarray(w_gate)
    p = prepare_moe(params, "mxfp8", keep_reference=False)
    p = {k: (v.astype(jnp.bfloat16) if k in ("router", "router_bias") else v) for k, v in p.items()}
    h = hidden(14, 200, jnp.bfloat16)
    tiles = MOSAIC_MX_TILES.replace(mx_widen=widen)
    if widen == "swap":
        tiles = tiles.replace(gu=KernelTiles(bn=128, bk=128, warps=4, stages=2))
    got = kernel.moe_pallas(h, p, interpret=True, tiles=tiles, **KW)
    got = got.astype(jnp.float32)
    tri = kernel.moe_pallas(h, p, interpret=True, tiles=INTERPRET_TILES, **KW).astype(jnp.float32)
    want = reference.moe(h, layout.reference_params(p, jnp.bfloat16), **KW).astype(jnp.float32)
    assert float(jnp.linalg.norm(got - tri) / jnp.linalg.norm(tri)) < 2e-4  # summation order, bf16 act ulps
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 2e-2


@pytest.mark.parametrize("widen", ["split", "each", "swap"])
def test_mosaic_mxfp8_widening_is_exact(widen: str) -> None:
    """The widening alone: every e4m3 code (subnormals included) under scale bytes 100..240 comes out as the
    dequantised weight rounded to bf16. Two K groups, so that "split" runs its double buffer over two steps."""
    from pallas_kernels.moe import kernel_mgpu  # noqa: F401 - the module under test

    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    rng = np.random.default_rng(1)
    q = rng.choice(codes, size=(1, 128, 256)).view(mx.FP8)  # [S, N, K]
    s = rng.integers(100, 241, size=(1, 128, 8)).astype(np.uint8)  # 448 x 2^113: finite
    words, scales = layout.mxfp8_from_checkpoint(jnp.asarray(q), jnp.asarray(s))
    experts = {"down_q8": words, "down_s": scales, "gate_q8": words, "gate_s": scales, "up_q8": words,
               "up_s": scales}
    eye = jnp.eye(256, dtype=jnp.bfloat16)  # x = I: the kernel's output is the widened weight matrix itself
    kt = KernelTiles(bn=128, bk=128, warps=4, stages=2)
    if widen == "swap":  # act^T = I^T = I in
        out = kernel_mgpu.down_swapped(eye, jnp.zeros((2,), jnp.int32), jnp.full((2,), 128, jnp.int32), experts,
                                       kt, group=1, interpret=True)
    else:
        out = kernel_mgpu.down(eye, jnp.zeros((2,), jnp.int32), jnp.full((2,), 128, jnp.int32), experts, kt,
                               group=1, interpret=True, widen=widen)
    want = layout.dequantize_experts(experts, jnp.float32)["down"][0]
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(want.astype(jnp.bfloat16),
                                                                                  np.float32))


def test_mosaic_kernels_refuse_other_dtypes() -> None:
    p = prepare_moe(moe_params(13), "bf16", keep_reference=False)  # fp32 experts
    with pytest.raises(ValueError, match="bf16"):
        kernel.moe_pallas(hidden(14, 40, jnp.bfloat16), p, interpret=True, tiles=MOSAIC_TILES, **KW)


def _prmt(a: np.ndarray, sel: int) -> np.ndarray:
    """PTX prmt.b32 d, a, 0, sel (default mode): byte i of d is byte (sel >> 4i) & 7 of {a, 0}, or that byte's
    sign bit replicated to 8 bits when bit 3 of the selector nibble is set."""
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        src = nib & 7
        byte = (a >> (8 * src)) & 0xFF if src < 4 else np.zeros_like(a)
        if nib & 8:
            byte = np.where(byte & 0x80, 0xFF, 0).astype(a.dtype)
        out |= byte << (8 * i)
    return out


def test_e4m3_pair_widening_steps() -> None:
    """The "expand_asm" PTX, step by step in numpy from the same constants: every e4m3 code (both bytes of both
    words of a register) comes out as bf16 bits of exactly 2^-120 times its value, and the folded scale gives
    2^(s - 7). (The PTX text itself runs only on a GPU; interpret mode computes "expand_asm" the "expand" way.)"""
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint32)  # all but the NaNs
    rng = np.random.default_rng(0)
    b = rng.choice(codes, size=(4, 4096))
    reg = b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24)  # two words: (b0 lo, b1 hi), (b2 lo, b3 hi)
    fp8 = mx.FP8
    for sel, (first, second) in zip(layout.E4M3_BF16_PRMT, ((b[0], b[2]), (b[1], b[3])), strict=True):
        x = _prmt(reg, sel)
        y = ((x << layout.E4M3_BF16_SHIFT) & 0xFFFFFFFF) & layout.E4M3_BF16_MASK
        for lane, want in ((y & 0xFFFF, first), (y >> 16, second)):
            got = (lane.astype(np.uint32) << 16).view(np.float32).astype(np.float64) * 2.0**120
            np.testing.assert_array_equal(got, want.astype(np.uint8).view(fp8).astype(np.float64))
    top = layout.ASM_BF16_MAX_SCALE["mxfp8"]
    s = jnp.arange(1, top + 1, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(layout.asm_bf16_scale(s, "mxfp8").astype(jnp.float32)),
                                  np.ldexp(1.0, np.arange(1, top + 1) - 7))
    for h in (0, 1):
        ptx = layout.widening_ptx("mxfp8", h)
        assert "mul.rn.bf16x2" in ptx and f"{layout.E4M3_BF16_PRMT[h]:#x}" in ptx
        assert f"{layout.E4M3_BF16_MASK:#x}" in ptx


_PTX_INT_OPS = {"shl.b32": lambda x, y: (x << y) & 0xFFFFFFFF, "shr.b32": lambda x, y: x >> y,
                "and.b32": lambda x, y: x & y, "or.b32": lambda x, y: x | y}


def test_e2m1_widening_steps() -> None:
    """MXFP4's "expand_asm" PTX in numpy, instruction by instruction from its own text: every nibble of both words
    of a register comes out as bf16 bits of exactly 2^-126 times its E2M1 value, and the folded scale gives
    2^(s - 1), finite up to ASM_BF16_MAX_SCALE."""
    rng = np.random.default_rng(1)
    w = rng.integers(0, 1 << 16, size=(2, 4096)).astype(np.uint32)  # two 16-bit words a register
    reg = w[0] | (w[1] << 16)
    for j in range(4):
        regs = {"$1": reg}
        for line in layout.widening_ptx("mxfp4", j).splitlines():
            op, _, rest = line.strip().rstrip(";").partition(" ")
            if op in ("shl.b32", "shr.b32", "and.b32", "or.b32"):
                dst, a, b = (t.strip() for t in rest.split(","))
                x, y = regs[a], regs[b] if b in regs else np.uint32(int(b, 0))
                regs[dst] = _PTX_INT_OPS[op](x, y)
        y = regs["a"]  # the operand the final mul.rn.bf16x2 scales
        for lane, word in ((y & 0xFFFF, w[0]), (y >> 16, w[1])):
            got = (lane.astype(np.uint32) << 16).view(np.float32).astype(np.float64) * 2.0**126
            np.testing.assert_array_equal(got, mx.E2M1_LUT[(word >> (4 * j)) & 0xF].astype(np.float64))
    top = layout.ASM_BF16_MAX_SCALE["mxfp4"]
    s = jnp.arange(0, top + 1, dtype=jnp.uint8)
    got = np.asarray(layout.asm_bf16_scale(s, "mxfp4").astype(jnp.float32))
    np.testing.assert_array_equal(got, np.ldexp(1.0, np.arange(0, top + 1) - 1))
    assert np.all(np.isfinite(got)) and "mul.rn.bf16x2" in layout.widening_ptx("mxfp4", 3)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_expand_asm_mode_runs_as_expand_in_interpret_mode(fmt: str) -> None:
    p = prepare_moe(moe_params(5), fmt)
    h = hidden(6, 19)
    a = kernel.moe_pallas(h, p, interpret=True, tiles=INTERPRET_TILES, **KW)
    b = kernel.moe_pallas(h, p, interpret=True, tiles=INTERPRET_TILES.replace(mx_mode="expand_asm"), **KW)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fmt,big", [("mxfp8", 2.0**16), ("mxfp4", 16.0)])
def test_wide_scales_fall_back_from_expand_asm(fmt: str, big: float) -> None:
    """A block maximum of 2^16 (MXFP8) or 16 (MXFP4) needs an E8M0 scale that the inline-PTX widening's folded
    bf16 scale cannot hold: prepare marks such experts and the kernels run "expand" for them; ordinary weights
    keep "expand_asm"."""
    plain = prepare_moe(moe_params(5), fmt)["experts"]
    p = moe_params(5)
    p["w_up"] = p["w_up"].at[1, 3, 7].set(big)
    wide = prepare_moe(p, fmt)["experts"]
    assert layout.WIDE_SCALES not in plain and layout.WIDE_SCALES in wide
    p["w_up"] = p["w_up"].at[1, 3, 7].set(big * 0.99)  # just under: still representable
    assert layout.WIDE_SCALES not in prepare_moe(p, fmt)["experts"]
    p["w_up"] = p["w_up"].at[1, 3, 7].set(big)
    asm = pick_tiles(1, fmt).replace(mx_mode="expand_asm")
    assert kernel.kernel_tiles(1, plain, tiles=asm).mx_mode == "expand_asm"
    assert kernel.kernel_tiles(1, wide, tiles=asm).mx_mode == "expand"
    # The marked layout still computes the reference's function (the marker is not a weight).
    h = hidden(6, 19)
    pw = prepare_moe(p, fmt, keep_reference=False)
    want = reference.moe(h, layout.reference_params(pw, jnp.float32), **KW)
    got = kernel.moe_pallas(h, pw, interpret=True, **KW)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))


def test_mx_weights_differ_from_dense() -> None:
    """The MX tests would pass vacuously if quantisation were a no-op: it is not."""
    p = moe_params(3)
    d = layout.dequantize_experts(prepare_moe(p, "mxfp4")["experts"])["gate"][:E]
    assert float(jnp.abs(d - p["w_gate"]).max()) > 1e-3


@pytest.mark.parametrize("reg", ["decode", "mid", "prefill"])
def test_gpu_table_tiles_run(reg: str) -> None:
    """Each regime's GPU tiles (fitted to the tiny shapes), in bf16 activations, with the shared slot."""
    fmt = "mxfp8" if reg == "mid" else "dense"
    tiles = fit_tiles(GPU_TABLE[(reg, "dense")], D, F, fmt)
    assert tiles is not None
    p = prepare_moe(moe_params(7), "bf16" if fmt == "dense" else fmt)
    h = hidden(8, 29, jnp.bfloat16)
    want = reference.moe(h, layout.reference_params(p, jnp.bfloat16), **KW).astype(jnp.float32)
    got = kernel.moe_pallas(h, p, interpret=True, tiles=tiles, **KW).astype(jnp.float32)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 2e-2


def test_unprepared_params_read_in_place() -> None:
    """No `experts`: routed weights read where they are, the (narrower) shared expert through dense_mlp."""
    p = moe_params(9, shared_width=96)
    h = hidden(10, 11)
    np.testing.assert_allclose(np.asarray(kernel.moe_pallas(h, p, interpret=True, **KW)),
                               np.asarray(reference.moe(h, p, **KW)), rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_dispatch_override_and_model_params(fmt: str) -> None:
    # m3-tiny with MX-packable widths (D, F multiples of 128); its shared expert (48 wide) stays a dense MLP.
    cfg = dataclasses.replace(preset("m3-tiny"), hidden_size=128, moe_intermediate_size=128)
    with pytest.raises(ValueError, match="multiples of 128"):
        prepare_params(jax.tree.map(jnp.asarray, random_params(preset("m3-tiny"), seed=1)), fmt)
    params = jax.tree.map(jnp.asarray, random_params(cfg, seed=1))
    prepared = prepare_params(params, fmt)
    layer = next(i for i, t in enumerate(cfg.mlp_types) if t == "moe")
    p = layer_view(prepared, cfg, layer)["moe"]
    assert layout.weight_format(p["experts"]) == fmt
    assert layout.weight_arrays(p["experts"], "gate")[0].dtype == jnp.uint16
    assert "w_gate" in p and not layout.has_shared_slot(p)  # m3-tiny's shared expert is wider than a routed one
    h = jnp.asarray(np.random.default_rng(0).normal(size=(9, cfg.hidden_size)).astype(np.float32))
    kw = {"top_k": cfg.num_experts_per_tok, "routed_scaling": cfg.routed_scaling_factor,
          "alpha": cfg.swiglu_alpha, "limit": cfg.swiglu_limit}
    want = dispatch.moe(h, {k: v for k, v in p.items() if k != "experts"}, **kw, impl="reference")
    deq = dispatch.moe(h, layout.reference_params(p, jnp.float32), **kw, impl="reference")
    # Prepared-only params: the reference dequantises them.
    slim = layer_view(prepare_params(params, fmt, keep_reference=False), cfg, layer)["moe"]
    assert "w_gate" not in slim and "shared" in slim
    np.testing.assert_allclose(np.asarray(dispatch.moe(h, slim, **kw, impl="reference")), np.asarray(deq),
                               rtol=1e-6, atol=1e-6)
    got = dispatch.moe(h, p, **kw, impl="interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(deq), rtol=1e-5, atol=1e-5)
    # MX weights move the output by a bounded fraction of its size (MXFP4's 3 bits of magnitude: more).
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < (0.1 if fmt == "mxfp8" else 0.3)
    with pytest.raises(ValueError, match="resolve the KernelChoice"):
        dispatch.moe(h, p, **kw, impl="auto")


def test_kernel_choice_resolves_by_backend_and_device_count() -> None:
    gpu = jax.default_backend() == "gpu"
    assert KernelChoice("auto", "auto").resolve(1) == KernelChoice("pallas" if gpu else "reference",
                                                                    "pallas" if gpu else "reference")
    # The sharded ops run the MoE kernels per device (pallas_kernels/sharded.py): the device count changes nothing.
    assert KernelChoice("auto", "auto").resolve(4).moe == ("pallas" if gpu else "reference")
    assert KernelChoice("interpret", "auto").resolve(1).attention == "interpret"
    with pytest.raises(ValueError, match="not one of"):
        KernelChoice("bogus")


def test_tile_table_covers_m3() -> None:
    for T in (1, 8, 32, 128, 512, 2048, 8192):
        for fmt in ("dense", "mxfp8", "mxfp4"):
            t = pick_tiles(T, fmt)
            assert fit_tiles(t, 6144, 3072, fmt) == t, (T, fmt)
    assert pick_tiles(1, "mxfp4").gu.bk % layout.MX_GROUP == 0
    assert pick_tiles(1, "mxfp8").dn.split == 2 and pick_tiles(8, "mxfp8").dn.split == 1  # one token: split K
    assert fit_tiles(INTERPRET_TILES, 64, 48, "mxfp4") is None  # K % 128 != 0: the dispatch falls back
    assert ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max == mx.E4M3_MAX


def test_mosaic_table_only_where_the_device_runs_it() -> None:
    """MXFP8 from 1,024 tokens takes the Mosaic GPU entry when the caller says the device runs it; fewer tokens,
    and every other format, keep the Triton table, and on this CPU `kernel_tiles` never asks for it."""
    from pallas_kernels.moe.tiles import GPU_TABLE, MOSAIC_TABLE, pick_tiles

    from_tokens, mosaic_tiles = MOSAIC_TABLE["mxfp8"]
    assert pick_tiles(8192, "mxfp8", mosaic=True) == mosaic_tiles
    for T in (from_tokens, 2048):  # the mid regime's upper sizes, with the regime named as the call's
        assert pick_tiles(T, "mxfp8", mosaic=True) == mosaic_tiles.replace(regime="mid"), T
    assert pick_tiles(from_tokens - 1, "mxfp8", mosaic=True) == GPU_TABLE[("mid", "mxfp8")]
    assert pick_tiles(512, "mxfp8", mosaic=True) == GPU_TABLE[("mid", "mxfp8")]
    assert pick_tiles(8192, "mxfp8") == GPU_TABLE[("prefill", "mxfp8")]
    assert pick_tiles(8192, "dense", mosaic=True) == GPU_TABLE[("prefill", "dense")]
    assert pick_tiles(64, "mxfp8", mosaic=True) == GPU_TABLE[("decode", "mxfp8")]
    p = prepare_moe(moe_params(13), "mxfp8", keep_reference=False)
    assert kernel.kernel_tiles(8192, p["experts"]).backend == "triton"
