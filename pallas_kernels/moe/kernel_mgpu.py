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
from pallas_kernels.moe.tiles import KernelTiles, MoeTiles, block_and_tile

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


def _block_scale(scale_words: jax.Array, j: int, shape: tuple[int, int], dim: int) -> jax.Array:
    """E8M0 byte j of each scale word -> 2^(s - 127) as f32 (byte 0 -> 0), broadcast to `shape` along `dim`'s
    other axis (`dim`: the axis the words run along)."""
    e8m0 = (scale_words >> (8 * j)) & 0xFF
    return lax.broadcast_in_dim(lax.bitcast_convert_type(e8m0 << 23, jnp.float32), shape, [dim])


def _dequantised(words: jax.Array, half: int, scale_first: jax.Array, scale_second: jax.Array,
                 first_block: jax.Array) -> jax.Array:
    """bf16 weights of one half of a 128-deep K group (0: the words' low bytes, K rows 0..63; 1: the high bytes,
    rows 64..127): each byte read as e4m3 and widened by the hardware conversion (to f16, exact, subnormals
    included), times its 32-row block's scale 2^(s - 127) in f32 (exact; `first_block` picks `scale_first` for
    the half's first 32 K rows), then rounded to bf16: the dequantised weight, as `layout.dequantize_experts`
    gives it, wherever bf16 holds it. (The Triton kernels' bit moves give bf16 values 2^-120 small, subnormal for
    e4m3's own subnormals, which a multiply that flushes subnormals would zero.)"""
    byte = (words & 0xFF if half == 0 else words >> 8).astype(jnp.uint8)
    e4m3 = lax.bitcast_convert_type(byte, jnp.float8_e4m3fn)
    return (e4m3.astype(jnp.float32) * jnp.where(first_block, scale_first, scale_second)).astype(jnp.bfloat16)


def _widen_mxfp8(dst_smem, words_smem, scales_smem, bn: int, halves: tuple[int, ...] = (0, 1)) -> None:
    """One 128-deep K group of MXFP8 weights -> bf16 [128, bn] in `dst_smem` (K rows in natural order); `halves`
    picks which: 0 the low bytes (K rows 0..63), 1 the high bytes (rows 64..127).

    `words_smem` [64, bn] uint16: word r holds K rows r (low byte) and r + 64 (high byte); `scales_smem` [1, bn]
    uint32: byte j is the E8M0 scale of K rows 32j .. 32j + 31."""
    words = plgpu.load(words_smem, layout=plgpu.Layout.WGMMA)
    scale_words = plgpu.load(scales_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
    shape = (2 * mx.BLOCK, bn)
    first_block = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) < mx.BLOCK
    for half in halves:
        dst_smem[pl.ds(half * 64, 64), :] = _dequantised(
            words, half, _block_scale(scale_words, 2 * half, shape, 1),
            _block_scale(scale_words, 2 * half + 1, shape, 1), first_block)


def _widen_mxfp8_transposed(words_smem, scales_smem) -> tuple[jax.Array, jax.Array]:
    """The swapped kernels' A operands: W^T of one 128-deep K group for the 64 columns `words_smem` [64, 64]
    holds, as two bf16 [64 columns, 64 K] register arrays (K rows 0..63 from the words' low bytes, 64..127 from
    the high bytes), read transposed from shared memory and never written back. `scales_smem` [1, 64]: the
    columns' scale words."""
    words = plgpu.load(words_smem.transpose((1, 0)), layout=plgpu.Layout.WGMMA)  # [column, word row]
    scale_words = plgpu.load(scales_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
    shape = (WG_ROWS, 2 * mx.BLOCK)
    first_block = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) < mx.BLOCK
    return tuple(_dequantised(words, half, _block_scale(scale_words, 2 * half, shape, 0),
                              _block_scale(scale_words, 2 * half + 1, shape, 0), first_block)
                 for half in range(2))


def _store_epilogue(y, out_smem, wg, dst, count: int, keep=None, transposed: bool = False) -> None:
    """A compute warpgroup's epilogue tile `y` out through its two shared-memory buffers, EPI_COLS columns a
    copy: chunk c goes to `dst(c)` (a gmem ref slice), and only where `keep(c)` (a traced predicate) holds;
    `transposed`: each chunk is stored transposed (a [64, EPI_COLS] chunk as the buffer's [EPI_COLS, 64])."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for c in range(count):
        def store(c: int = c) -> None:
            buf = out_smem.at[wg, c % 2]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            (buf.transpose((1, 0)) if transposed else buf)[...] = y[:, c * EPI_COLS:(c + 1) * EPI_COLS]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buf, dst(c))

        pred = None if keep is None else keep(c)
        if pred is None:
            store()
        else:
            pl.when(pred)(store)


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

        a_spec = plgpu.BlockSpec((BM, bk), lambda k: (0, k), transforms=tr, memory_space=plgpu.SMEM)

        def pipeline_for(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(K // bk,), memory_registers=40, in_specs=[a_spec] + w_specs * len(mats),
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
                    a_rows = a_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)]
                    for acc, b_smem in zip(accs, b_smems, strict=True):
                        plgpu.wgmma(acc, a_rows, b_smem)
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
                            _store_epilogue(y, out_smem, wg, lambda c: o_ref.at[
                                pl.ds(row0, WG_ROWS), pl.ds(j * out_cols + c * EPI_COLS, EPI_COLS)],
                                out_cols // EPI_COLS)

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


def _grouped_gemm_swapped(b_src: jax.Array, mats: tuple[tuple[jax.Array, jax.Array], ...], slot_B: jax.Array,
                          rows_B: jax.Array, *, rows_major: bool, kt: KernelTiles, group: int, epilogue,
                          name: str, interpret: bool) -> jax.Array:
    """MXFP8 experts with wgmma's operands swapped: outT [N, M] = (a @ w)^T, computed as w^T @ a^T, so that the
    weights are the A operand and come from registers, widened there (`_widen_mxfp8_transposed`) and never
    written back to shared memory; a compute warpgroup widens only its own 64 columns (no warpgroup widens
    another's, and no barrier between them), and the rows of a block are wgmma's N (128, or 64 for a block of
    at most 64 pairs). `b_src`: the activations, [M, K] (`rows_major`, gate_up's gathered x) or [K, M] (down's
    input, gate_up's transposed output). Tiles: `kt.bn` (128: 64 per compute warpgroup) columns per matrix,
    128-deep K steps (one MX group), `kt.stages` steps in flight.
    outT[j*bn:(j+1)*bn, rows of block b] = epilogue([(a[rows] @ w[s][:, j*bn:(j+1)*bn])^T for w in mats]).
    down (`rows_major` False, its input gate_up's output) writes out [M, N] instead: each [64, 64] epilogue chunk
    is stored transposed into shared memory, so that no transpose is left to XLA."""
    out_rows_major = not rows_major
    K = mats[0][0].shape[-2] * 2
    N = mats[0][0].shape[-1]
    M = b_src.shape[0] if rows_major else b_src.shape[1]
    dt = jnp.dtype(jnp.bfloat16)
    bn, bk = kt.bn, kt.bk
    nb, nt = slot_B.shape[0], N // bn
    assert b_src.dtype == dt and bk == layout.MX_GROUP and bn == 2 * WG_ROWS, (b_src.dtype, kt)
    assert nb * BM == M and K % bk == 0 and N % bn == 0 and (b_src.shape[1] if rows_major else b_src.shape[0]) == K
    if rows_major:  # [BM rows, bk] tiles; a half step's B operand is a 64-column slice, transposed
        b_spec = plgpu.BlockSpec((BM, bk), lambda k: (0, k), transforms=_swizzled(dt, bk), memory_space=plgpu.SMEM)
    else:  # [bk, BM rows] tiles; a half step's B operand is 64 of their rows
        b_spec = plgpu.BlockSpec((bk, BM), lambda k: (k, 0), transforms=_swizzled(dt, BM), memory_space=plgpu.SMEM)
    w_specs = [plgpu.BlockSpec((bk // 2, bn), lambda k: (k, 0), transforms=_swizzled(jnp.uint16, WG_ROWS),
                               memory_space=plgpu.SMEM),
               plgpu.BlockSpec((1, bn), lambda k: (k, 0), memory_space=plgpu.SMEM)]

    def b_half(b_smem, half: int, cols: int):
        if rows_major:
            return b_smem.at[pl.ds(0, cols), pl.ds(half * 64, 64)].transpose((1, 0))
        return b_smem.at[pl.ds(half * 64, 64), pl.ds(0, cols)]

    def kernel(slot_ref, rows_ref, b_ref, *refs):
        w_refs, o_ref = refs[:-1], refs[-1]

        def pipeline_for(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(K // bk,), memory_registers=40, in_specs=[b_spec] + w_specs * len(mats),
                wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=kt.stages, compute_context=context)

        def ignore(*_, **__):
            return None

        scratch = dict(allocs=pipeline_for(ignore, ignore).get_allocations(b_ref, *(r.at[0] for r in w_refs)),
                       out_smem=plgpu.SMEM((2, 2, WG_ROWS, EPI_COLS), dt, transforms=_swizzled(dt, EPI_COLS)))
        if interpret:
            # jax's GPU interpreter runs wgmma from shared memory only: there the A operands go through these.
            scratch["a_smem"] = plgpu.SMEM((2, len(mats), 2, WG_ROWS, 64), dt, transforms=_swizzled(dt, 64))

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _scope(allocs, out_smem, a_smem=None):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((nb * nt,), collective_axes="sm")
            def _tile(info: plgpu.NDLoopInfo) -> None:
                (u,) = info.index
                b, j = block_and_tile(u, nb, nt, group)
                slot, full = slot_ref[b], rows_ref[b] > WG_ROWS
                cols = pl.ds(wg * WG_ROWS, WG_ROWS)  # this warpgroup's columns of the tile

                def body(_, b_smem, *rest):
                    *w_smems, accs = rest

                    def step(rows: int) -> None:
                        # Matrix by matrix: the next matrix's widening can run beside this one's wgmma.
                        for m, acc in enumerate(accs):
                            words, scales = w_smems[2 * m:2 * m + 2]
                            halves = _widen_mxfp8_transposed(words.at[:, cols], scales.at[:, cols])
                            if interpret:
                                for h, a in enumerate(halves):
                                    a_smem[wg, m, h] = a
                                plgpu.commit_smem()
                                halves = [a_smem.at[wg, m, h] for h in range(2)]
                            for h, a in enumerate(halves):
                                plgpu.wgmma(acc.at[:, pl.ds(0, rows)] if rows < BM else acc, a,
                                            b_half(b_smem, h, rows))
                        plgpu.wgmma_wait(0)

                    pl.when(full)(lambda: step(BM))
                    pl.when(~full)(lambda: step(WG_ROWS))  # a block of <= 64 pairs: wgmma N = 64
                    return accs

                def context(run):
                    @functools.partial(pl.run_scoped, accs=tuple(plgpu.ACC((WG_ROWS, BM), jnp.float32)
                                                                 for _ in mats))
                    def _accs(accs):
                        run(accs)
                        y = epilogue([acc[...] for acc in accs]).astype(dt)  # [64 columns, BM rows]
                        # The rows past 64 hold pairs only in a full block.
                        if out_rows_major:
                            dst = lambda c: o_ref.at[pl.ds(b * BM + c * EPI_COLS, EPI_COLS),  # noqa: E731
                                                     pl.ds(j * bn + wg * WG_ROWS, WG_ROWS)]
                        else:
                            dst = lambda c: o_ref.at[pl.ds(j * bn + wg * WG_ROWS, WG_ROWS),  # noqa: E731
                                                     pl.ds(b * BM + c * EPI_COLS, EPI_COLS)]
                        _store_epilogue(y, out_smem, wg, dst, BM // EPI_COLS, keep=lambda c: full if c else None,
                                        transposed=out_rows_major)

                    return None

                @pl.when(slot >= 0)
                def _():
                    b_tile = b_ref.at[pl.ds(b * BM, BM), :] if rows_major else b_ref.at[:, pl.ds(b * BM, BM)]
                    pipeline_for(body, context)(
                        b_tile, *(r.at[slot, :, pl.ds(j * bn, bn)] for r in w_refs), allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel.__name__ = kernel.__qualname__ = name
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((M, N) if out_rows_major else (N, M), dt),
        grid=(_num_sms(interpret),), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(slot_B, rows_B, b_src, *(a for m in mats for a in m))


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


def grouped_gemms(h_TD: jax.Array, row_token_M: jax.Array, slot_B: jax.Array, rows_B: jax.Array, experts: dict,
                  tiles: MoeTiles, *, group: int, alpha: float, limit: float, interpret: bool = False) -> jax.Array:
    """y [M, D] = down(swiglu(gate_up(x))) over the sorted rows, as `kernel`'s two Triton kernels compute it:
    for MXFP8 experts under `tiles.mx_widen == "swap"` the swapped kernels (down's y stored transposed),
    else `gate_up` / `down` (bf16 experts have nothing to widen: "swap" means "each" for them)."""
    if tiles.mx_widen == "swap" and layout.weight_format(experts) == "mxfp8":
        actT_FM = gate_up_swapped(h_TD, row_token_M, slot_B, rows_B, experts, tiles.gu, group=group, alpha=alpha,
                                  limit=limit, interpret=interpret)
        # down's epilogue stores y transposed back to [M, D]. Left as y^T, XLA folded its transpose into the
        # combine's gather, which then read y^T column by column (8k tokens, H100: a 4.06 ms combine against 0.23;
        # benchmarks/results/moe-mosaic-mx-h100-5d34121.json); down reading act^T as a transposed operand instead
        # took 5.5 ms against 3.7 (moe-mosaic-mx-h100-8aad53c.json).
        return down_swapped(actT_FM, slot_B, rows_B, experts, tiles.dn, group=group, interpret=interpret)
    widen = "each" if tiles.mx_widen == "swap" else tiles.mx_widen
    act_MF = gate_up(h_TD, row_token_M, slot_B, rows_B, experts, tiles.gu, group=group, alpha=alpha, limit=limit,
                     interpret=interpret, widen=widen)
    return down(act_MF, slot_B, rows_B, experts, tiles.dn, group=group, interpret=interpret, widen=widen)


def gate_up_swapped(h_TD: jax.Array, row_token_M: jax.Array, slot_B: jax.Array, rows_B: jax.Array, experts: dict,
                    kt: KernelTiles, *, group: int, alpha: float, limit: float, interpret: bool = False) -> jax.Array:
    """actT [F, M]: `gate_up`'s act, transposed, through the swapped kernel (MXFP8 experts)."""
    fmt, mats = _mats(experts, ("gate", "up"))
    if fmt != "mxfp8":
        raise ValueError(f"the swapped Mosaic GPU MoE kernels take MXFP8 experts, not {fmt}")

    def swiglu(vals):
        return swiglu_oai(vals[0], vals[1], alpha=alpha, limit=limit)

    return _grouped_gemm_swapped(h_TD[row_token_M], mats, slot_B, rows_B, rows_major=True, kt=kt, group=group,
                                 epilogue=swiglu, name="moe_gate_up_mxfp8_mgpu_swapped", interpret=interpret)


def down_swapped(actT_FM: jax.Array, slot_B: jax.Array, rows_B: jax.Array, experts: dict, kt: KernelTiles, *,
                 group: int, interpret: bool = False) -> jax.Array:
    """y [M, D] = act @ down[slot] from `gate_up_swapped`'s actT (MXFP8 experts): computed as y^T, stored
    transposed by the epilogue."""
    fmt, mats = _mats(experts, ("down",))
    if fmt != "mxfp8":
        raise ValueError(f"the swapped Mosaic GPU MoE kernels take MXFP8 experts, not {fmt}")
    return _grouped_gemm_swapped(actT_FM, mats, slot_B, rows_B, rows_major=False, kt=kt, group=group,
                                 epilogue=lambda vals: vals[0], name="moe_down_mxfp8_mgpu_swapped",
                                 interpret=interpret)
