"""The MoE GEMMs at prefill size on Mosaic GPU: warp-specialised, persistent, TMA-fed wgmma.

Same rows, slots and results as `kernel.gate_up` / `kernel.down` (the Triton kernels), for bf16 experts. Why a
second backend: at T = 8192 the Triton kernels reach ~56-61% of the bf16 peak, while jax's Mosaic GPU
lowering can keep the tensor cores fed from shared memory with one warpgroup loading (TMA) and two computing
(`plgpu.emit_pipeline_warp_specialized`); its stock Hopper matmul ran M3's gate_up shape at 704 TFLOP/s on the
H200 (benchmarks/results/mgpu-gemm-probe-h200.json).

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


def _grouped_gemm(a_MK: jax.Array, ws: tuple[jax.Array, ...], slot_B: jax.Array, rows_B: jax.Array, *,
                  kt: KernelTiles, group: int, epilogue, out_cols: int, name: str, interpret: bool) -> jax.Array:
    """Tiles: `kt.bn` columns per B operand (gate_up has two: gate and up), `kt.bk` K per pipeline step,
    `kt.stages` steps in flight (`kt.warps` does not apply: 3 warpgroups).
    out[M, N_out] per row block b (slot s = slot_B[b] >= 0), tile j:
    out[rows, j*out_cols:(j+1)*out_cols] = epilogue([a[rows] @ w[s][:, j*bn:(j+1)*bn] for w in ws])."""
    M, K = a_MK.shape
    N = ws[0].shape[-1]
    if {a_MK.dtype, *(w.dtype for w in ws)} != {jnp.dtype(jnp.bfloat16)}:
        raise ValueError(f"the Mosaic GPU MoE kernels take bf16 activations and experts, got {a_MK.dtype} and "
                         f"{[str(w.dtype) for w in ws]}")
    bn, bk, dt = kt.bn, kt.bk, a_MK.dtype
    nb, nt = slot_B.shape[0], N // bn
    assert nb * BM == M and K % bk == 0 and N % bn == 0 and out_cols % EPI_COLS == 0, (M, K, N, kt)
    tr = _swizzled(dt, bk)
    out_tr = _swizzled(dt, EPI_COLS)

    def kernel(slot_ref, rows_ref, a_ref, *refs):
        w_refs, o_ref = refs[:len(ws)], refs[-1]

        def pipeline_for(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(K // bk,), memory_registers=40,
                in_specs=[plgpu.BlockSpec((BM, bk), lambda k: (0, k), transforms=tr, memory_space=plgpu.SMEM)]
                + [plgpu.BlockSpec((bk, bn), lambda k: (k, 0), transforms=tr, memory_space=plgpu.SMEM)
                   for _ in ws],
                wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=kt.stages, compute_context=context)

        def ignore(*_, **__):
            return None

        scratch = dict(
            allocs=pipeline_for(ignore, ignore).get_allocations(a_ref, *(w.at[0] for w in w_refs)),
            out_smem=plgpu.SMEM((2, 2, WG_ROWS, EPI_COLS), dt, transforms=out_tr),
        )

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _scope(allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((nb * nt,), collective_axes="sm")
            def _tile(info: plgpu.NDLoopInfo) -> None:
                (u,) = info.index
                b, j = block_and_tile(u, nb, nt, group)
                slot, n_rows = slot_ref[b], rows_ref[b]
                # Warpgroup 1's rows hold pairs only when the block has more than 64 of them.
                active = (wg == 0) | (n_rows > WG_ROWS)
                row0 = b * BM + wg * WG_ROWS

                def body(_, a_smem, *rest):
                    *b_smems, accs = rest

                    @pl.when(active)
                    def _():
                        for acc, b_smem in zip(accs, b_smems, strict=True):
                            plgpu.wgmma(acc, a_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)], b_smem)
                        plgpu.wgmma_wait(0)

                    return accs

                def context(run):
                    @functools.partial(pl.run_scoped,
                                       accs=tuple(plgpu.ACC((WG_ROWS, bn), jnp.float32) for _ in ws))
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
                        a_ref.at[pl.ds(b * BM, BM), :], *(w.at[slot, :, pl.ds(j * bn, bn)] for w in w_refs),
                        allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel.__name__ = kernel.__qualname__ = name  # how the kernel shows in profiles
    args = (slot_B, rows_B, a_MK, *ws)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((M, nt * out_cols), dt),
        grid=(_num_sms(interpret),), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*args)


def gate_up(h_TD: jax.Array, row_token_M: jax.Array, slot_B: jax.Array, rows_B: jax.Array, experts: dict,
            kt: KernelTiles, *, group: int, alpha: float, limit: float, interpret: bool = False) -> jax.Array:
    """act [M, F] as `kernel.gate_up` computes it (bf16 experts, 128-row blocks)."""
    assert layout.weight_format(experts) == "dense"
    x_MD = h_TD[row_token_M]  # TMA reads whole tiles: the block's rows gathered once, in sorted order

    def swiglu(vals):
        return swiglu_oai(vals[0], vals[1], alpha=alpha, limit=limit)

    return _grouped_gemm(x_MD, (experts["gate"], experts["up"]), slot_B, rows_B, kt=kt, group=group,
                         epilogue=swiglu, out_cols=kt.bn, name="moe_gate_up_dense_mgpu", interpret=interpret)


def down(act_MF: jax.Array, slot_B: jax.Array, rows_B: jax.Array, experts: dict, kt: KernelTiles, *,
         group: int, interpret: bool = False) -> jax.Array:
    """y [M, D] = act @ down[slot] as `kernel.down` computes it (bf16 experts, no split K)."""
    assert layout.weight_format(experts) == "dense"
    return _grouped_gemm(act_MF, (experts["down"],), slot_B, rows_B, kt=kt, group=group,
                         epilogue=lambda vals: vals[0], out_cols=kt.bn, name="moe_down_dense_mgpu",
                         interpret=interpret)
