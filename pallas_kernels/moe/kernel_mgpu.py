"""The MoE GEMMs at prefill size on Mosaic GPU: warp-specialised, persistent, TMA-fed wgmma.

Same rows, slots and results as `kernel.gate_up` / `kernel.down` (the Triton kernels), for bf16 and MXFP8
experts. Why a second backend: at T = 8192 the Triton kernels reach ~56-61% of the bf16 peak, while jax's Mosaic
GPU lowering can keep the tensor cores fed from shared memory with one warpgroup loading (TMA) and two computing
(`plgpu.emit_pipeline_warp_specialized`); its stock Hopper matmul ran M3's gate_up shape at 704 TFLOP/s on the
H200 (benchmarks/results/mgpu-gemm-probe-h200.json).

MXFP8 experts (`layout.py`'s words and packed scales, the Triton kernels' layout, so one copy of the weights
serves both backends): each pipeline step is one 128-deep K group. The memory warpgroup TMA-loads the group's
[64, bn] words and [1, bn] scale words; each compute warpgroup widens them once into a bf16 [128, bn] tile of
its own in shared memory (word row r holds K rows r and r + 64 of the group; e4m3 -> f16 by the hardware
conversion, times the block scale), and runs the same 128-deep wgmma on it as for bf16 experts. The Triton
MXFP8 prefill kernels widen the weights per 32- or 64-row dot piece and take twice the bf16 kernels' time at
T = 8192 (docs/benchmarks.md, "MoE kernels"); here the widening is one pass over each tile beside full-depth
MMAs, which the other compute warpgroup's wgmma can overlap.

Each CTA loops over output tiles (a 128-row block of the sorted rows x `bn` columns), 132 CTAs for 132 SMs,
tiles in the Triton kernels' order (`tiles.block_and_tile`: row blocks fastest inside groups, so the CTAs in
flight share weight tiles in L2). Compute warpgroup w takes rows 64w .. 64w + 63 of the block; a block whose
pairs all fit in its first 64 rows (a slot's last block) runs only warpgroup 0, and the rows below stay
unwritten, as in the Triton kernels' tail blocks. gate_up reads x through TMA, so its rows are gathered into
sorted order first (one XLA gather); down reads gate_up's output, already in that order.

Interpret mode: `plgpu.InterpretGPUParams` (jax's GPU interpreter, threads, barriers and TMA simulated on the
CPU), which is how CI checks these kernels against the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mx
from pallas_kernels.moe import layout
from pallas_kernels.moe.reference import swiglu_oai
from pallas_kernels.moe.tiles import KernelTiles, block_and_tile

WG_ROWS = 64  # rows of one compute warpgroup's wgmma (the instruction's M)
BM = 2 * WG_ROWS  # row block height: the two compute warpgroups
EPI_COLS = 64  # columns per epilogue store (two such buffers per warpgroup)
INTERPRET_SMS = 2


def _num_sms(interpret: bool) -> int:
    if interpret:
        return INTERPRET_SMS
    return getattr(jax.devices()[0], "core_count", 132) or 132


def _swizzled(dtype: jnp.dtype, cols: int) -> tuple:
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def _widen_mxfp8(dst_smem, words_smem, scales_smem, bn: int, halves: tuple[int, ...] = (0, 1)) -> None:
    """One 128-deep K group of MXFP8 weights -> bf16 [128, bn] in `dst_smem` (K rows in natural order); `halves`
    picks which: 0 the low bytes (K rows 0..63), 1 the high bytes (rows 64..127).

    `words_smem` [64, bn] uint16: word r holds K rows r (low byte) and r + 64 (high byte); `scales_smem` [1, bn]
    uint32: byte j is the E8M0 scale of K rows 32j .. 32j + 31. Each byte is read as e4m3 and widened by the
    hardware conversion (to f16, exact, subnormals included), times the block scale 2^(s - 127) in f32 (exact),
    then rounded to bf16: the dequantised weight, as `layout.dequantize_experts` gives it, wherever bf16 holds it.
    (The Triton kernels' bit moves give bf16 values 2^-120 small, subnormal for e4m3's own subnormals, which a
    multiply that flushes subnormals would zero.)"""
    words = plgpu.load(words_smem, layout=plgpu.Layout.WGMMA)
    scale_words = plgpu.load(scales_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
    first_block = plgpu.broadcasted_iota(jnp.int32, (2 * mx.BLOCK, bn), 0, layout=plgpu.Layout.WGMMA) < mx.BLOCK

    def block_scale(j: int) -> jax.Array:  # E8M0 byte j of each column -> 2^(s - 127) as f32 (byte 0 -> 0)
        e8m0 = (scale_words >> (8 * j)) & 0xFF
        f32 = lax.bitcast_convert_type(e8m0 << 23, jnp.float32)
        return lax.broadcast_in_dim(f32, (2 * mx.BLOCK, bn), [1])

    for half in halves:  # low bytes: K rows 0..63 (scale bytes 0, 1); high bytes: rows 64..127 (bytes 2, 3)
        byte = (words & 0xFF if half == 0 else words >> 8).astype(jnp.uint8)
        e4m3 = lax.bitcast_convert_type(byte, jnp.float8_e4m3fn)
        scale = jnp.where(first_block, block_scale(2 * half), block_scale(2 * half + 1))
        dst_smem[pl.ds(half * 64, 64), :] = (e4m3.astype(jnp.float32) * scale).astype(jnp.bfloat16)


def _grouped_gemm(a_MK: jax.Array, mats: tuple[tuple[jax.Array, ...], ...], slot_B: jax.Array, rows_B: jax.Array,
                  *, fmt: str, kt: KernelTiles, group: int, epilogue, out_cols: int, name: str,
                  interpret: bool, widen: str = "each") -> jax.Array:
    """Tiles: `kt.bn` columns per matrix (gate_up has two: gate and up), `kt.bk` K per pipeline step (128, one
    MX group, for MXFP8), `kt.stages` steps in flight (`kt.warps` does not apply: 3 warpgroups).
    `mats`: per matrix its arrays, `(w [S, K, N],)` for bf16 or `(words [S, K/2, N], scales [S, K/128, N])`.
    `widen` (MXFP8): "each", every compute warpgroup widens the whole step into a tile of its own and runs its
    wgmma at once; "split", warpgroup w widens half w (the low / high bytes) into one shared tile, double-buffered
    by step, and both wait on a barrier before their wgmma (half the widening, one hand-off a step).
    out[M, N_out] per row block b (slot s = slot_B[b] >= 0), tile j:
    out[rows, j*out_cols:(j+1)*out_cols] = epilogue([a[rows] @ w[s][:, j*bn:(j+1)*bn] for w in mats])."""
    M, K = a_MK.shape
    N = mats[0][0].shape[-1]
    dt = jnp.dtype(jnp.bfloat16)
    if a_MK.dtype != dt or (fmt == "dense" and any(m[0].dtype != dt for m in mats)):
        raise ValueError(f"the Mosaic GPU MoE kernels take bf16 activations and bf16 or MXFP8 experts, got "
                         f"{a_MK.dtype} and {[str(m[0].dtype) for m in mats]}")
    if fmt not in ("dense", "mxfp8"):
        raise ValueError(f"the Mosaic GPU MoE kernels take bf16 or MXFP8 experts, not {fmt}")
    bn, bk = kt.bn, kt.bk
    nb, nt = slot_B.shape[0], N // bn
    assert nb * BM == M and K % bk == 0 and N % bn == 0 and out_cols % EPI_COLS == 0, (M, K, N, kt)
    assert fmt == "dense" or bk == layout.MX_GROUP, f"MXFP8 steps are one {layout.MX_GROUP}-deep group, not {bk}"
    assert widen in ("each", "split"), widen
    if (K // bk) % 2:
        # "split" alternates its two shared tiles by step within a tile: with an odd number of steps, a tile's
        # first step would reuse the previous tile's last buffer, which the other warpgroup may still be reading
        # (the barrier only says it has widened). Odd counts come from narrow TP shards of down (F / 8 = 384).
        widen = "each"
    tr = _swizzled(dt, bk)
    w_tr = _swizzled(dt, bn)
    out_tr = _swizzled(dt, EPI_COLS)
    if fmt == "dense":
        w_specs = [plgpu.BlockSpec((bk, bn), lambda k: (k, 0), transforms=tr, memory_space=plgpu.SMEM)]
    else:
        w_specs = [plgpu.BlockSpec((bk // 2, bn), lambda k: (k, 0), transforms=_swizzled(jnp.uint16, bn),
                                   memory_space=plgpu.SMEM),
                   plgpu.BlockSpec((1, bn), lambda k: (k, 0), memory_space=plgpu.SMEM)]
    per_mat = len(w_specs)

    def kernel(slot_ref, rows_ref, a_ref, *refs):
        w_refs, o_ref = refs[:-1], refs[-1]
        mat_refs = [w_refs[i * per_mat:(i + 1) * per_mat] for i in range(len(mats))]

        def pipeline_for(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(K // bk,), memory_registers=40,
                in_specs=[plgpu.BlockSpec((BM, bk), lambda k: (0, k), transforms=tr, memory_space=plgpu.SMEM)]
                + w_specs * len(mats),
                wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=kt.stages, compute_context=context)

        def ignore(*_, **__):
            return None

        scratch = dict(
            allocs=pipeline_for(ignore, ignore).get_allocations(a_ref, *(r.at[0] for r in w_refs)),
            out_smem=plgpu.SMEM((2, 2, WG_ROWS, EPI_COLS), dt, transforms=out_tr),
        )
        if fmt == "mxfp8":
            # "each": every compute warpgroup's widened tiles, one per matrix; "split": the shared tiles of two
            # consecutive steps (a warpgroup writes step k's while the other may still read step k - 1's).
            scratch["wide_smem"] = plgpu.SMEM((2, len(mats), bk, bn), dt, transforms=w_tr)
            if widen == "split":
                scratch["widened"] = plgpu.Barrier(num_arrivals=2)  # both halves of a step are in shared memory

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _scope(allocs, out_smem, wide_smem=None, widened=None):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((nb * nt,), collective_axes="sm")
            def _tile(info: plgpu.NDLoopInfo) -> None:
                (u,) = info.index
                b, j = block_and_tile(u, nb, nt, group)
                slot, n_rows = slot_ref[b], rows_ref[b]
                # Warpgroup 1's rows hold pairs only when the block has more than 64 of them.
                active = (wg == 0) | (n_rows > WG_ROWS)
                row0 = b * BM + wg * WG_ROWS

                def mats_of(w_smems):
                    return [w_smems[m * per_mat:(m + 1) * per_mat] for m in range(len(mats))]

                def mma(accs, a_smem, b_smems):
                    for acc, b_smem in zip(accs, b_smems, strict=True):
                        plgpu.wgmma(acc, a_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)], b_smem)
                    plgpu.wgmma_wait(0)

                def body(indices, a_smem, *rest):
                    *w_smems, accs = rest
                    if fmt == "mxfp8" and widen == "split":
                        # Warpgroup 1 widens its half even when it has no rows: warpgroup 0's wgmma needs it.
                        buf = lax.rem(indices[0], 2)
                        for half in range(2):
                            def widen_half(half: int = half) -> None:
                                for m, refs in enumerate(mats_of(w_smems)):
                                    _widen_mxfp8(wide_smem.at[buf, m], *refs, bn, halves=(half,))

                            pl.when(wg == half)(widen_half)
                        plgpu.commit_smem()  # this warpgroup's half, visible to the tensor cores
                        plgpu.barrier_arrive(widened)
                        plgpu.barrier_wait(widened)  # and the other's
                        pl.when(active)(lambda: mma(accs, a_smem, [wide_smem.at[buf, m] for m in range(len(mats))]))
                        return accs

                    @pl.when(active)
                    def _():
                        if fmt == "mxfp8":
                            for m, refs in enumerate(mats_of(w_smems)):
                                _widen_mxfp8(wide_smem.at[wg, m], *refs, bn)
                            plgpu.commit_smem()  # the widened tiles, written by this warpgroup, before wgmma reads
                            mma(accs, a_smem, [wide_smem.at[wg, m] for m in range(len(mats))])
                        else:
                            mma(accs, a_smem, w_smems)

                    return accs

                def context(run):
                    @functools.partial(pl.run_scoped,
                                       accs=tuple(plgpu.ACC((WG_ROWS, bn), jnp.float32) for _ in mats))
                    def _accs(accs):
                        run(accs)

                        @pl.when(active)
                        def _():
                            y = epilogue([acc[...] for acc in accs]).astype(dt)
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            for c in range(out_cols // EPI_COLS):
                                buf = out_smem.at[wg, c % 2]
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                buf[...] = y[:, c * EPI_COLS:(c + 1) * EPI_COLS]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(buf, o_ref.at[pl.ds(row0, WG_ROWS),
                                                                      pl.ds(j * out_cols + c * EPI_COLS, EPI_COLS)])

                    return None

                @pl.when(slot >= 0)
                def _():
                    pipeline_for(body, context)(
                        a_ref.at[pl.ds(b * BM, BM), :],
                        *(r.at[slot, :, pl.ds(j * bn, bn)] for refs in mat_refs for r in refs),
                        allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel.__name__ = kernel.__qualname__ = name  # how the kernel shows in profiles
    args = (slot_B, rows_B, a_MK, *(a for m in mats for a in m))
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((M, nt * out_cols), dt),
        grid=(_num_sms(interpret),), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*args)


def _mats(experts: dict, names: tuple[str, ...]) -> tuple[str, tuple[tuple[jax.Array, ...], ...]]:
    return layout.weight_format(experts), tuple(layout.weight_arrays(experts, n) for n in names)


def gate_up(h_TD: jax.Array, row_token_M: jax.Array, slot_B: jax.Array, rows_B: jax.Array, experts: dict,
            kt: KernelTiles, *, group: int, alpha: float, limit: float, interpret: bool = False,
            widen: str = "each") -> jax.Array:
    """act [M, F] as `kernel.gate_up` computes it (bf16 or MXFP8 experts, 128-row blocks)."""
    fmt, mats = _mats(experts, ("gate", "up"))
    x_MD = h_TD[row_token_M]  # TMA reads whole tiles: the block's rows gathered once, in sorted order

    def swiglu(vals):
        return swiglu_oai(vals[0], vals[1], alpha=alpha, limit=limit)

    return _grouped_gemm(x_MD, mats, slot_B, rows_B, fmt=fmt, kt=kt, group=group, epilogue=swiglu,
                         out_cols=kt.bn, name=f"moe_gate_up_{fmt}_mgpu", interpret=interpret, widen=widen)


def down(act_MF: jax.Array, slot_B: jax.Array, rows_B: jax.Array, experts: dict, kt: KernelTiles, *,
         group: int, interpret: bool = False, widen: str = "each") -> jax.Array:
    """y [M, D] = act @ down[slot] as `kernel.down` computes it (bf16 or MXFP8 experts, no split K)."""
    fmt, mats = _mats(experts, ("down",))
    return _grouped_gemm(act_MF, mats, slot_B, rows_B, fmt=fmt, kt=kt, group=group, epilogue=lambda vals: vals[0],
                         out_cols=kt.bn, name=f"moe_down_{fmt}_mgpu", interpret=interpret, widen=widen)
